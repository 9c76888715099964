"""A run's metrics as JSON lines in the run directory: one schema, documented in docs/observability.md.

Storage may be an object store, where nothing can be appended: each round's metrics are one file,
`metrics/round_00003.jsonl`, written whole (atomically) by the merge service once the round is
evaluated, and rewritten with the same content if that round is evaluated again after a restart.
`read_metrics` concatenates the files in round order; a committed round whose file is missing (a
service killed between its record and its metrics) is derived on the fly from its record and
manifests, so readers always see every committed round.

Four kinds of line, every line carrying `kind` and `schema` (FIELDS lists the keys of each):

    run     once, first line of round 0: the run's shape and the initial eval loss (step 0)
    round   one per round: eval loss, who was merged / dropped / rejected, bytes, timings
    worker  one per worker per round: its job's timings, steps, tokens, first and last loss
    step    one per inner step per contributing worker: its training loss at that global step

Steps count inner steps since the start of the run: round r's inner steps are r*H+1 .. r*H+H, and
the eval loss of round r's merged model sits at step (r+1)*H, so both share one x axis.

When `torch.utils.tensorboard` can be imported and the run directory is local, the same numbers
also go to TensorBoard event files under `tensorboard/` (skipped silently otherwise).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from core.checkpoint import read_manifest
from core.config import Config
from core.errors import IslandsError, StorageError
from core.layout import RunLayout
from core.local_files import PRIVATE_FILE
from core.storage import Storage
from core.records import RoundJobs, RoundRecord, RunInfo, utilization
from orchestrator.runstate import arrived_workers

log = logging.getLogger(__name__)
L = RunLayout()
SCHEMA = 1

FIELDS: dict[str, tuple[str, ...]] = {
    "run": ("kind", "schema", "t", "algorithm", "workers", "rounds", "inner_steps", "params", "created_at",
            "step", "eval_loss", "eval_metrics"),
    "round": ("kind", "schema", "t", "round", "step", "eval_loss", "eval_metrics", "evaluated_at", "merged", "dropped", "rejected",
              "late", "dropped_reasons", "rejected_reasons", "weights", "outer_grad_norm", "merge_seconds",
              "round_seconds", "bytes_read", "bytes_contributions", "bytes_global", "bytes_outer_state", "bytes_worker_states",
              "tokens", "train_loss", "utilization", "submitted_at", "merge_started_at", "committed_at"),
    "worker": ("kind", "schema", "t", "round", "worker", "contributed", "merged", "job_id", "attempts", "persistent", "state",
               "submitted_at", "queue_wait_s", "run_s", "seconds", "written_at", "steps", "tokens", "bytes",
               "fp32_bytes", "codec", "loss_first", "loss_last", "waited_s", "ahead_s", "io_read", "io_written", "replica"),
    "step": ("kind", "schema", "round", "worker", "step", "loss"),
}


# -- pure: lines from what the run directory holds ---------------------------------------------
def run_line(cfg: Config, info: Mapping[str, Any], t: float) -> dict[str, Any]:
    return {"kind": "run", "schema": SCHEMA, "t": t, "algorithm": cfg.algorithm, "workers": cfg.workers,
            "rounds": cfg.rounds, "inner_steps": cfg.inner.steps, "params": info.get("params"),
            "created_at": info.get("created_at"), "step": 0, "eval_loss": info.get("initial_eval_loss"),
            "eval_metrics": dict(info.get("initial_eval_metrics") or {})}


def round_line(record: Mapping[str, Any], manifests: Mapping[int, Mapping[str, Any]], sizes: Mapping[str, Any],
               inner_steps: int, t: float, evaluated_at: float | None) -> dict[str, Any]:
    """The round's line. `manifests`: contributions published to the round, by worker; `sizes`:
    bytes of the global checkpoint, outer state and worker optimizer states it wrote."""
    r = record["round"]
    merged = list(record.get("merged", []))
    losses = [manifests[w]["loss_last"] for w in merged if w in manifests and manifests[w].get("loss_last") is not None]
    sub, committed = record.get("submitted_at"), record.get("committed_at")
    return {
        "kind": "round", "schema": SCHEMA, "t": t, "round": r, "step": (r + 1) * inner_steps,
        "eval_loss": record.get("eval_loss"), "eval_metrics": dict(record.get("eval_metrics") or {}),
        "evaluated_at": evaluated_at, "merged": merged,
        "dropped": list(record.get("dropped", [])), "rejected": list(record.get("rejected", [])),
        "late": list(record.get("late", [])), "dropped_reasons": dict(record.get("dropped_reasons", {})),
        "rejected_reasons": dict(record.get("rejected_reasons", {})),
        "weights": dict(record.get("weights", {})),
        "outer_grad_norm": record.get("outer_grad_norm"), "merge_seconds": record.get("merge_seconds"),
        "round_seconds": record.get("round_s") if record.get("round_s") is not None else
        None if sub is None or committed is None else round(committed - sub, 3),
        "bytes_read": record.get("bytes_read"),
        "bytes_contributions": sum(int(m.get("bytes", 0)) for m in manifests.values()),
        "bytes_global": sizes.get("global"), "bytes_outer_state": sizes.get("outer_state"),
        "bytes_worker_states": sizes.get("worker_states"),
        "tokens": sum(int(manifests[w].get("tokens", 0)) for w in merged if w in manifests),
        "train_loss": sum(losses) / len(losses) if losses else None,
        "utilization": utilization([record]),
        "submitted_at": sub, "merge_started_at": record.get("merge_started_at"), "committed_at": committed,
    }


def worker_lines(record: Mapping[str, Any], jobs: Mapping[str, Any], manifests: Mapping[int, Mapping[str, Any]],
                 t: float) -> list[dict[str, Any]]:
    """One line per worker that had a job in the round (contributed or not)."""
    r, merged = record["round"], set(record.get("merged", []))
    entries = jobs.get("workers", {})
    out = []
    for w in sorted({int(k) for k in entries} | set(manifests)):
        entry, m = entries.get(str(w), {}), manifests.get(w, {})
        sched = record.get("jobs", {}).get(str(w), {})
        out.append({"kind": "worker", "schema": SCHEMA, "t": t, "round": r, "worker": w, "contributed": w in manifests,
                    "merged": w in merged, "job_id": (entry.get("job_ids") or [m.get("job_id")])[-1],
                    "attempts": entry.get("attempts"), "persistent": bool(entry.get("persistent")), "state": sched.get("state"),
                    "submitted_at": entry.get("submitted_at", jobs.get("submitted_at")),
                    "queue_wait_s": sched.get("queue_wait_s"), "run_s": sched.get("run_s"),
                    **{k: m.get(k) for k in ("seconds", "written_at", "steps", "tokens", "bytes", "fp32_bytes",
                                             "loss_first", "loss_last", "waited_s", "io_read", "io_written", "replica")},
                    "codec": (m.get("contribution") or {}).get("codec", "weights" if m else None),
                    "ahead_s": (m.get("overlap") or {}).get("ahead_s")})
    return out


def step_lines(r: int, manifests: Mapping[int, Mapping[str, Any]], inner_steps: int) -> list[dict[str, Any]]:
    """Every inner step's training loss of every contribution, numbered from the start of the run."""
    return [{"kind": "step", "schema": SCHEMA, "round": r, "worker": w, "step": r * inner_steps + i + 1, "loss": loss}
            for w in sorted(manifests) for i, loss in enumerate(manifests[w].get("losses", []))]


def to_jsonl(lines: Iterable[Mapping[str, Any]]) -> bytes:
    """Strict JSON, one object a line: a non-finite number (a diverged loss) is written as null."""
    return "".join(json.dumps(_finite(line), sort_keys=True, allow_nan=False) + "\n" for line in lines).encode()


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


_WHOLE = ("round", "step", "worker", "schema", "workers", "rounds", "inner_steps", "attempts", "io_read", "io_written")


def _bad_field(line: dict[str, Any]) -> str | None:
    """What is wrong with a metrics line's values (None: nothing): whole numbers where counts are, and
    otherwise only numbers, short strings, and lists or objects of them (what the service writes)."""
    for k in _WHOLE:
        v = line.get(k)
        if v is not None and (type(v) is not int):
            return f"{k} is {str(v)[:40]!r}, not a whole number"

    def plain(v: Any, depth: int = 0) -> bool:
        if v is None or isinstance(v, (bool, int, float)):
            return True
        if isinstance(v, str):
            return len(v) <= 10_000
        if depth < 3 and isinstance(v, list):
            return all(plain(x, depth + 1) for x in v)
        if depth < 3 and isinstance(v, dict):
            return all(isinstance(k, str) and plain(x, depth + 1) for k, x in v.items())
        return False
    bad = next((k for k, v in line.items() if not plain(v)), None)
    return None if bad is None else f"{bad} is not a value the service writes"


def parse_jsonl(data: bytes, source: str) -> list[dict[str, Any]]:
    """Lines of a metrics file, checked against the schema; the error names the file and line."""
    out = []
    for n, text in enumerate(data.decode(errors="replace").splitlines(), 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise StorageError(f"{source} line {n} is not JSON ({str(exc)[:120]}); delete the file: it is derived again "
                               "from the round's record") from None
        if not isinstance(line, dict) or (bad := _bad_field(line)):
            raise StorageError(f"{source} line {n}: {'not an object' if not isinstance(line, dict) else bad}; delete "
                               "the file: it is derived again from the round's record")
        if line.get("kind") not in FIELDS or line.get("schema") != SCHEMA:
            raise StorageError(f"{source} line {n}: unknown kind {line.get('kind')!r} or schema {line.get('schema')!r} "
                               f"(this version reads schema {SCHEMA}, kinds {sorted(FIELDS)})")
        out.append(line)
    return out


# -- I/O: gather, write, read -------------------------------------------------------------------
def _bytes_of(storage: Storage, key: str) -> int | None:
    m = read_manifest(storage, key)
    return None if m is None else m.get("bytes")


def gather_round(storage: Storage, r: int) -> tuple[dict[str, Any], dict[int, dict[str, Any]], dict[str, Any]]:
    """Round r's jobs, published contributions' manifests and written sizes, from storage."""
    jobs = RoundJobs.load(storage, r).to_json()
    manifests = {w: m for w in arrived_workers(storage, r) if (m := read_manifest(storage, L.contribution(r, w)))}
    states = [_bytes_of(storage, L.worker_state(w, r)) for w in manifests]
    sizes = {"global": _bytes_of(storage, L.global_weights(r + 1)), "outer_state": _bytes_of(storage, L.outer_state(r + 1)),
             "worker_states": sum(s for s in states if s is not None) if any(s is not None for s in states) else None}
    return jobs, manifests, sizes


def round_metrics(storage: Storage, cfg: Config, record: Mapping[str, Any], evaluated_at: float | None,
                  t: float | None = None) -> list[dict[str, Any]]:
    """Every line of one round (plus the run line before round 0)."""
    t = time.time() if t is None else t
    r = record["round"]
    jobs, manifests, sizes = gather_round(storage, r)
    head = [run_line(cfg, dataclasses.asdict(RunInfo.load(storage)), t)] if r == 0 else []
    return [*head, round_line(record, manifests, sizes, cfg.inner.steps, t, evaluated_at),
            *worker_lines(record, jobs, manifests, t), *step_lines(r, manifests, cfg.inner.steps)]


def write_round_metrics(storage: Storage, cfg: Config, record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The merge service's hook, called once a round is evaluated; the lines (for the trackers). Never
    fails the run: a metrics problem is logged and the round goes on (readers derive a missing file
    from the record)."""
    try:
        now = time.time()
        lines = round_metrics(storage, cfg, record, evaluated_at=now, t=now)
    except (IslandsError, OSError, TypeError, ValueError, KeyError) as exc:
        log.warning("round %s: metrics not gathered (%s); `orchestrate report` derives them from the record",
                    record.get("round"), exc)
        return []
    try:
        storage.write_bytes(L.round_metrics(record["round"]), to_jsonl(lines))
    except (IslandsError, OSError) as exc:
        log.warning("round %s: metrics not written (%s); `orchestrate report` derives them from the record",
                    record.get("round"), exc)
    write_tensorboard(storage, lines)
    return lines


def read_metrics(storage: Storage, cfg: Config) -> list[dict[str, Any]]:
    """Every committed round's lines in round order: written files, or derived from the records."""
    names = set(storage.list(L.METRICS))
    out: list[dict[str, Any]] = []
    for r in range(cfg.rounds):
        key = L.round_metrics(r)
        if key.rsplit("/", 1)[-1] in names:
            out += parse_jsonl(storage.read_bytes(key), storage.display(key))
            continue
        record = RoundRecord.load(storage, r)
        if record is None:
            break
        out += round_metrics(storage, cfg, record.to_json(), evaluated_at=None)
    return out


def write_tensorboard(storage: Storage, lines: list[dict[str, Any]]) -> bool:
    """The same numbers as TensorBoard scalars, when tensorboard is importable and storage is local."""
    folder = storage.local_path(L.TENSORBOARD)
    if folder is None:
        return False
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return False
    try:
        with storage.local_folder(L.TENSORBOARD) as fd:  # private (0700), reached through no link
            pinned = f"/proc/self/fd/{fd}"  # that folder, whatever is put at its name meanwhile (Linux)
            with SummaryWriter(log_dir=pinned if os.path.isdir(pinned) else folder) as tb:
                for line in lines:
                    for tag, step, value in tensorboard_scalars(line):
                        tb.add_scalar(tag, value, step)
            for name in os.listdir(fd):  # the event files TensorBoard made (by the umask): the run's, private
                with contextlib.suppress(OSError):  # a link or a FIFO someone put there: not ours, left alone
                    f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
                    try:
                        os.fchmod(f, PRIVATE_FILE)
                    finally:
                        os.close(f)
    except (OSError, ValueError, IslandsError) as exc:  # never fail a run for a dashboard
        log.warning("tensorboard events not written (%s)", exc)
        return False
    return True


def tensorboard_scalars(line: Mapping[str, Any]) -> list[tuple[str, int, float]]:
    """(tag, step, value) of one metrics line; steps are inner steps, or rounds for per-round costs."""
    kind = line["kind"]
    if kind == "step":
        pairs = [(f"train_loss/worker_{line['worker']:03d}", line["step"], line["loss"])]
    elif kind in ("run", "round"):
        pairs = [("eval_loss", line["step"], line["eval_loss"])]
        pairs += [(f"eval_{k}", line["step"], v) for k, v in (line.get("eval_metrics") or {}).items()]  # e.g. accuracy
        if kind == "round":
            r = line["round"] + 1
            pairs += [(f"round/{k}", r, line[k]) for k in ("outer_grad_norm", "merge_seconds", "round_seconds",
                                                          "bytes_read", "bytes_contributions", "train_loss",
                                                          "utilization")]
            pairs += [("round/merged", r, len(line["merged"])), ("round/dropped", r, len(line["dropped"])),
                      ("round/rejected", r, len(line["rejected"]))]
    else:
        pairs = []
    return [(tag, int(step), float(v)) for tag, step, v in pairs if v is not None and math.isfinite(float(v))]
