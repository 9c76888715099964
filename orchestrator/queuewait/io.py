"""Queue-wait I/O: read SWF traces and sacct output, run sacct, and submit live probe jobs.

The analysis itself is pure (orchestrator/queuewait/waits.py). Live probes are real jobs on a real
partition: their number and run time are bounded, and every probe still queued or running is
cancelled on the way out, whatever the way out is (normal end, error, Ctrl-C, SIGTERM).
"""
from __future__ import annotations

import gzip
import logging
import math
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from core.progress import progress
from orchestrator import commands
from orchestrator.queuewait.waits import SACCT_FIELDS, QueueWaitError, WaitData, parse_sacct, parse_swf

log = logging.getLogger(__name__)

PROBE_NAME = "islands-probe"
MAX_PROBES = 64
_CMD_TIMEOUT_S = 60


def read_text(path: str | Path) -> str:
    """A text file, gunzipped when it is gzip (by content, not by name)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise QueueWaitError(f"cannot read {p}: {exc.strerror or exc}; check the path") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise QueueWaitError(f"{p} looks gzipped but does not decompress ({exc}); is it truncated?") from None
    return raw.decode("utf-8", errors="replace")


def read_swf(path: str | Path, cores_per_node: float | None = None) -> WaitData:
    return parse_swf(read_text(path).splitlines(), cores_per_node, source=f"swf:{Path(path).name}")


def read_sacct_file(path: str | Path, partition: str | None = None, user: str | None = None) -> WaitData:
    return parse_sacct(read_text(path), source=f"sacct:{Path(path).name}", partition=partition, user=user)


def _run(args: list[str], what: str, stderr_too: bool = False) -> str:
    """The command's stdout (`stderr_too`: and its stderr, where sbatch --test-only answers)."""
    if shutil.which(args[0]) is None:
        raise QueueWaitError(f"{args[0]} is not on PATH; {what} needs Slurm's client commands "
                             "(or read a saved file: --sacct FILE / --swf FILE)")
    try:
        out = commands.run(args, timeout=_CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise QueueWaitError(f"`{' '.join(args)}` did not answer within {_CMD_TIMEOUT_S}s ({what})") from None
    if out.returncode != 0:
        raise QueueWaitError(f"`{' '.join(args)}` failed with exit code {out.returncode} ({what}): "
                             f"{out.stderr.strip() or out.stdout.strip()}")
    return out.stdout + out.stderr if stderr_too else out.stdout


def sacct_command(since: str | None, partition: str | None, user: str | None,
                  job_ids: Sequence[str] = ()) -> list[str]:
    """The sacct call: allocations only (-X), parsable, with a header line naming the fields."""
    args = ["sacct", "-P", "-X", "-o", ",".join(SACCT_FIELDS)]
    if job_ids:
        args += ["-j", ",".join(job_ids)]
    else:
        args += ["-S", since or "now-7days", "-E", "now"]
        args += ["-u", user] if user else ["-a"]
    if partition:
        args += ["-r", partition]
    return args


def read_sacct_live(since: str | None = None, partition: str | None = None, user: str | None = None) -> WaitData:
    """This cluster's job history; jobs still pending are censored at now (sacct's wall clock, read as UTC)."""
    text = _run(sacct_command(since, partition, user), "reading the cluster's job history")
    now = datetime.now().replace(tzinfo=timezone.utc).timestamp()
    return parse_sacct(text, source=f"sacct:live since {since or 'now-7days'}", partition=partition, user=user, now=now)


# ---------------------------------------------------------------- the scheduler's own estimate

_TEST_ONLY = re.compile(r"to start at (\S+) using (\d+) processors on nodes (\S+) in partition (\S+)")


def test_only_command(nodes: int, time_limit_s: float, partition: str | None, gpus_per_node: int) -> list[str]:
    """`sbatch --test-only` for a worker's shape: whole nodes, its time limit, partition and GPUs."""
    args = ["sbatch", "--test-only", "-N", str(nodes), "--exclusive", "-t", str(max(1, math.ceil(time_limit_s / 60))),
            "-J", PROBE_NAME]
    args += ["-p", partition] if partition else []
    args += [f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []
    return args + ["--wrap", "true"]


def estimate_starts(node_counts: Sequence[int], time_limit_s: float, partition: str | None = None,
                    gpus_per_node: int = 0) -> list[dict[str, Any]]:
    """The scheduler's start estimate (`sbatch --test-only`: nothing is submitted) of a whole-node
    job of each size with this time limit: what a worker of that shape would wait if submitted now,
    by the scheduler's current plan (it changes as jobs end early or arrive)."""
    if not node_counts or min(node_counts) < 1:
        raise QueueWaitError(f"--probe-nodes {list(node_counts)} must be positive node counts")
    out = []
    for n in node_counts:
        args = test_only_command(n, time_limit_s, partition, gpus_per_node)
        text = _run(args, f"asking when a {n}-node job would start (--live)", stderr_too=True).strip()
        m = _TEST_ONLY.search(text)
        if not m:
            raise QueueWaitError(f"`{' '.join(args)}` gave no start estimate: {text[-300:]}")
        now = datetime.now()  # sbatch prints the cluster's local time, without a zone
        start = datetime.fromisoformat(m.group(1))
        out.append({"nodes": n, "time_limit_s": time_limit_s, "gpus_per_node": gpus_per_node,
                    "start": m.group(1), "wait_s": max(0.0, (start - now).total_seconds()),
                    "processors": int(m.group(2)), "on_nodes": m.group(3), "partition": m.group(4)})
    return out


# ---------------------------------------------------------------- live probes


class ProbeInterrupted(KeyboardInterrupt):
    """SIGTERM during probing, raised like Ctrl-C so that every cleanup path runs."""


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def handler(signum: int, frame: object) -> None:
        raise ProbeInterrupted(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def probe_plan(node_counts: Sequence[int], per_size: int) -> list[int]:
    """Node count of every probe, interleaved (1,2,4,1,2,4,...) so no size is always first."""
    if not node_counts or min(node_counts) < 1 or per_size < 1:
        raise QueueWaitError(f"--probe-nodes {list(node_counts)} and --probes-per-size {per_size} must be positive")
    plan = [n for _ in range(per_size) for n in node_counts]
    if len(plan) > MAX_PROBES:
        raise QueueWaitError(f"{len(plan)} probes asked for (--probe-nodes x --probes-per-size); "
                             f"at most {MAX_PROBES} are submitted")
    return plan


def sbatch_probe(nodes: int, partition: str | None) -> list[str]:
    args = ["sbatch", "--parsable", "-N", str(nodes), "-t", "1", "--job-name", PROBE_NAME,
            "-o", "/dev/null", "-e", "/dev/null"]
    if partition:
        args += ["-p", partition]
    return args + ["--wrap", "sleep 1"]


def run_probes(node_counts: Sequence[int], per_size: int = 2, partition: str | None = None,
               max_seconds: float = 300.0, poll_s: float = 1.0) -> WaitData:
    """Submit probe jobs, wait until all started (or `max_seconds`), measure submit-to-start.

    Probes still pending at the deadline are skipped and counted ("not started within ...").
    Every probe is cancelled on exit.
    """
    plan = probe_plan(node_counts, per_size)
    nodes_there = partition_nodes(partition)
    if max(plan) > nodes_there:
        raise QueueWaitError(f"partition {partition or '(default)'} has {nodes_there} node(s) but --probe-nodes "
                             f"asks for {max(plan)}; such a probe would pend forever")
    ids: list[str] = []
    with _sigterm_as_interrupt():
        try:
            for nodes in plan:
                out = _run(sbatch_probe(nodes, partition), f"submitting a {nodes}-node probe")
                ids.append(out.strip().split(";")[0])
            log.info("submitted %d probe jobs: %s", len(ids), ",".join(ids))
            text = _wait_started(ids, max_seconds, poll_s)
        finally:
            cancel_probes(ids)
    data = parse_sacct(text, source=f"live:{partition or 'default partition'}")
    late = len(ids) - len(data.jobs)  # pending at the deadline, or not yet in sacct
    return WaitData(data.source, data.jobs, {f"not started within {max_seconds:g}s": late} if late else {})


def partition_nodes(partition: str | None) -> int:
    """Number of nodes in `partition` (default: the default partition, marked * by sinfo)."""
    rows = [line.split("|") for line in _run(["sinfo", "-h", "-N", "-o", "%N|%P"], "sizing the probes").split()]
    name = partition or next((p.rstrip("*") for _, p in rows if p.endswith("*")), None)
    nodes = {n for n, p in rows if p.rstrip("*") == name}
    if not nodes:
        known = sorted({p.rstrip("*") for _, p in rows})
        raise QueueWaitError(f"partition {name or '(default)'} not found by sinfo; known: {', '.join(known) or 'none'}")
    return len(nodes)


def _wait_started(ids: list[str], max_seconds: float, poll_s: float) -> str:
    """sacct text for the probes once all have a start time (or at the deadline).

    A failing sacct (slurmdbd restarting) is retried until the deadline."""
    deadline = time.monotonic() + max_seconds
    started = 0
    with progress(len(ids), "probe jobs started", unit="jobs") as bar:
        while True:
            try:
                text = _run(sacct_command(None, None, None, ids), "measuring the probes")
            except QueueWaitError as exc:
                if time.monotonic() >= deadline:
                    raise
                log.warning("%s; retrying", exc)
                time.sleep(max(poll_s, 2.0))
                continue
            data = parse_sacct(text)
            bar.advance(len(data.jobs) - started)
            started = len(data.jobs)
            if len(data.jobs) == len(ids) or time.monotonic() >= deadline:
                if len(data.jobs) < len(ids):
                    log.warning("%d of %d probes had not started after %gs", len(ids) - len(data.jobs), len(ids), max_seconds)
                return text
            time.sleep(poll_s)


def cancel_probes(ids: Sequence[str]) -> None:
    """scancel our own probes by id (never by name: other people's probes are theirs)."""
    if not ids:
        return
    try:
        out = commands.run(["scancel", *ids], timeout=_CMD_TIMEOUT_S)
        if out.returncode != 0:  # also when some had already ended: harmless
            log.warning("scancel %s: %s; check with `squeue -j %s` and cancel what is left by hand",
                        " ".join(ids), out.stderr.strip(), ",".join(ids))
        else:
            log.info("cancelled probe jobs %s", ",".join(ids))
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.error("could not cancel probe jobs %s (%s); cancel them by hand: scancel %s", ids, exc, " ".join(ids))
