"""Helpers for tests that need a real Slurm cluster (e.g. `slurm_templates/local-cluster.sh up`).

Use in a test module::

    from slurm_support import slurm_test, wait_for_sacct_state
    pytestmark = slurm_test

Without a usable cluster such tests are skipped with the reason. With ISLANDS_REQUIRE_SLURM=1 in
the environment (CI sets it) they error at setup instead, which fails the run, so a broken cluster
cannot pass as "all skipped".
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterable

import pytest

REQUIRED_COMMANDS = ("sbatch", "sacct", "squeue", "sinfo")
# sinfo %t short states of a node that can run (or is running) jobs. A trailing "*" (not
# responding), "~" (powered off) or "drain"/"down" means the node is not usable.
UP_NODE_STATES = frozenset({"idle", "mix", "alloc", "comp"})
# sacct states after which a job (or array task) will not change again by itself.
TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE"}
)
_COMMAND_TIMEOUT_S = 15


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False)


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "(no output)"


def slurm_available() -> tuple[bool, str]:
    """(True, description) if jobs can be submitted and accounted here, else (False, why not).

    Accounting is part of the check: without it submitit never sees a cancelled or killed job end.
    """
    missing = [cmd for cmd in REQUIRED_COMMANDS if shutil.which(cmd) is None]
    if missing:
        return False, f"Slurm commands not on PATH: {', '.join(missing)}"
    try:
        # sacct first: it fails at once without slurmdbd, while sinfo retries ~9 s without slurmctld
        sacct = _run(["sacct", "-n", "-X", "-S", "now-1minutes"])
        if sacct.returncode != 0:
            return False, f"sacct failed (accounting/slurmdbd down?): {_last_line(sacct.stderr)}"
        sinfo = _run(["sinfo", "-h", "-N", "-o", "%N %t"])
        if sinfo.returncode != 0:
            return False, f"sinfo failed (slurmctld down?): {_last_line(sinfo.stderr)}"
        rows = [line.split() for line in sinfo.stdout.splitlines()]
        up = sorted({row[0] for row in rows if len(row) == 2 and row[1] in UP_NODE_STATES})
        if not up:
            return False, f"no Slurm node is up; sinfo says: {sinfo.stdout.strip() or '(no nodes)'}"
    except subprocess.TimeoutExpired as exc:
        return False, f"{exc.cmd[0]} did not answer within {_COMMAND_TIMEOUT_S}s"
    return True, f"Slurm usable: {len(up)} node(s) up ({', '.join(up)})"


def slurm_required() -> bool:
    return os.environ.get("ISLANDS_REQUIRE_SLURM", "") not in ("", "0")


SLURM_OK, SLURM_REASON = slurm_available()


class SlurmRequiredError(RuntimeError):
    """Raised (as a test error) when ISLANDS_REQUIRE_SLURM=1 but Slurm is unusable."""


class _UnavailableButRequired:
    """A skipif condition that cannot be evaluated.

    pytest evaluates a skipif condition with bool() during each test's setup; an exception there
    makes the test ERROR with the message below instead of skipping. That way a plain list of
    marks is enough, with no conftest hook.
    """

    def __bool__(self) -> bool:
        raise SlurmRequiredError(f"ISLANDS_REQUIRE_SLURM=1 but Slurm is not usable: {SLURM_REASON}")


if SLURM_OK or not slurm_required():
    requires_slurm = pytest.mark.skipif(not SLURM_OK, reason=SLURM_REASON)
else:
    requires_slurm = pytest.mark.skipif(_UnavailableButRequired(), reason=SLURM_REASON)

# pytestmark = slurm_test  (the `slurm` marker is registered in pyproject.toml)
slurm_test = [pytest.mark.slurm, requires_slurm]


def require_slurm() -> None:
    """Imperative form: skip (or fail under ISLANDS_REQUIRE_SLURM=1) unless Slurm is usable."""
    if SLURM_OK:
        return
    if slurm_required():
        pytest.fail(f"ISLANDS_REQUIRE_SLURM=1 but Slurm is not usable: {SLURM_REASON}", pytrace=False)
    pytest.skip(SLURM_REASON)


class SlurmJobError(RuntimeError):
    """A job reached a final sacct state other than the ones waited for."""


def sacct_states(job_id: str | int) -> dict[str, str]:
    """{JobID: State} for the job's allocation rows (array tasks are separate rows).

    The state is its first word: sacct writes e.g. "CANCELLED by 0". Empty right after sbatch:
    records reach the accounting DB asynchronously (typically within a second).
    """
    out = _run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "JobID,State"])
    if out.returncode != 0:
        raise RuntimeError(f"sacct -j {job_id} failed: {out.stderr.strip()}")
    rows = (line.split("|", 1) for line in out.stdout.splitlines() if "|" in line)
    return {jid: state.split()[0] if state.split() else state for jid, state in rows}


def wait_for_sacct_state(
    job_id: str | int,
    states: str | Iterable[str],
    timeout_s: float = 60.0,
    poll_s: float = 0.5,
    array_tasks: Iterable[int] | None = None,
) -> dict[str, str]:
    """Poll sacct until every row of `job_id` is in one of `states`; return {JobID: State}.

    For a job array pass `array_tasks` (e.g. range(2)): it then also waits until sacct lists
    exactly those tasks ("12_0", "12_1"). A pending array shows as one row such as "12_[0-1]", and
    for a moment after the first task starts sacct may list it as plain "12".
    Raises SlurmJobError as soon as all rows are final but some not in `states` (e.g. FAILED while
    waiting for COMPLETED), TimeoutError after `timeout_s`.
    """
    wanted = {states} if isinstance(states, str) else set(states)
    want_ids = None if array_tasks is None else {f"{job_id}_{task}" for task in array_tasks}
    deadline = time.monotonic() + timeout_s
    seen: dict[str, str] = {}
    while True:
        seen = sacct_states(job_id)
        ids_ok = bool(seen) if want_ids is None else set(seen) == want_ids
        if ids_ok and all(state in wanted for state in seen.values()):
            return seen
        if ids_ok and all(state in TERMINAL_STATES | wanted for state in seen.values()):
            raise SlurmJobError(f"job {job_id} ended in {seen}, wanted {sorted(wanted)}")
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"job {job_id} not in {sorted(wanted)} after {timeout_s}s; sacct says {seen or 'nothing'}"
            )
        time.sleep(poll_s)
