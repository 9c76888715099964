"""What the merge service writes about a round: the jobs it submitted and the record that commits it.

Both are JSON files in the run directory (rounds/r/jobs.json, rounds/r/record.json; their keys in
docs/observability.md), read back by a resumed service, `status`, `report`, the replay and the chaos
check, each only through `load` here. Reading one checks every field against its declared type
(finite numbers, no bool for an int): a file that is not what the service wrote is refused with its
path and the field, never half-used.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from core.coerce import coerce
from core.errors import RunError
from core.layout import RunLayout
from core.storage import Storage

L = RunLayout()


def text(v: Any, limit: int = 4000) -> str | None:
    """A string from a run directory, fit for a terminal: control characters (escape sequences that
    retitle a window or clear a screen) removed, length bounded; None for anything not a string."""
    if not isinstance(v, str):
        return None
    return "".join(c for c in v[:limit] if c.isprintable() or c in "\n\t")


def number(v: Any) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return v if ok else None


LIMIT = 16 << 20
RUN_INFO = "run.json"
T = TypeVar("T")


def _name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def checked(cls: type[T], raw: Any, where: str) -> T:
    """`cls` (a dataclass) from the JSON object `raw`, every field checked against its type; unknown
    keys ignored (a newer writer's), missing ones take their defaults. RunError names the field."""
    if not isinstance(raw, dict):
        raise RunError(f"{where} is not a record islands wrote: a JSON {type(raw).__name__}, not an object")
    hints = typing.get_type_hints(cls)
    got = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RunError(f"{where} is not a record islands wrote: no {f.name!r}")
            continue
        problems: list[str] = []
        coerce(hints[f.name], raw[f.name], f.name, problems, strict=True)  # core/coerce.py, as the config's
        if problems:
            raise RunError(f"{where} is not a record islands wrote: {f.name!r} is {text(repr(raw[f.name]), 80)}, "
                           f"not {_name(hints[f.name])}")
        got[f.name] = raw[f.name]
    return cls(**got)


@dataclass
class JobEntry:
    """One worker's jobs in a round: every attempt's job id, and what it was asked to train from."""

    attempts: int = 0
    job_ids: list[str] = field(default_factory=list)
    base: str = ""
    """The checkpoint the worker starts the round from."""
    base_digest: str = ""
    """Its digest: a contribution naming another base is stale."""
    persistent: bool = False
    submitted_at: float = 0.0
    failures: list[dict[str, Any]] = field(default_factory=list)
    """Each attempt that ended without a contribution (its state and log tail), or was rejected."""

    @property
    def latest(self) -> str:
        return self.job_ids[-1]


JOBS_FIX = "; move it aside and `orchestrate resume` resubmits the round"


@dataclass
class RoundJobs:
    round: int
    workers: dict[int, JobEntry] = field(default_factory=dict)
    submitted_at: float | None = None
    """When the round's first jobs were submitted (the deadline counts from it)."""
    sbatch_calls: int = 0

    def latest(self) -> dict[int, str]:
        """worker -> its latest job id."""
        return {w: e.latest for w, e in self.workers.items()}

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "submitted_at": self.submitted_at, "sbatch_calls": self.sbatch_calls,
                "workers": {str(w): dataclasses.asdict(e) for w, e in sorted(self.workers.items())}}

    @classmethod
    def load(cls, storage: Storage, r: int) -> RoundJobs:
        """Round r's jobs file, checked; an empty one when there is none. RunError says how to recover."""
        where = storage.display(L.round_jobs(r))
        raw = storage.read_json(L.round_jobs(r), limit=LIMIT)
        if raw is None:
            return cls(r)
        fix = JOBS_FIX
        try:
            top = checked(_JobsFile, raw, where)
            workers = {}
            for w, e in top.workers.items():
                entry = checked(JobEntry, e, f"{where} (worker {text(w, 16)})")
                if not w.isdigit() or len(w) > 6 or not entry.job_ids:
                    raise RunError(f"{where} is not a jobs file this service wrote: worker {text(w, 16)!r} "
                                   "is not a worker number with at least one job id")
                workers[int(w)] = entry
        except RunError as exc:
            raise RunError(f"{exc}{fix}") from None
        if top.round != r:
            raise RunError(f"{where} is round {top.round}'s jobs file, not round {r}'s{fix}")
        return cls(r, workers, top.submitted_at, top.sbatch_calls)

    def save(self, storage: Storage) -> None:
        storage.write_json(L.round_jobs(self.round), self.to_json())


@dataclass(frozen=True)
class _JobsFile:
    """rounds/r/jobs.json as written by RoundJobs.to_json (its workers checked one by one as JobEntry)."""

    round: int
    workers: dict[str, Any]
    submitted_at: float | None = None
    sbatch_calls: int = 0


@dataclass
class RoundRecord:
    """The commit of round r, written last: global_{r+1} and outer/state_{r+1} exist once it does."""

    round: int
    merged: list[int]
    """Workers whose on-time contributions were merged."""
    dropped: list[int]
    """Workers not merged and not rejected (ended without a contribution, or stragglers)."""
    rejected: list[int]
    rejected_reasons: dict[str, str]
    dropped_reasons: dict[str, str]
    late: list[int]
    """Dropped workers whose contribution had arrived by the time of the record (too late)."""
    reason: str
    """Why the round was merged when it was (orchestrator.plan.decide)."""
    merge_seconds: float
    bytes_read: int
    outer_grad_norm: float | None
    weights: dict[str, float]
    submitted_at: float
    merge_started_at: float
    committed_at: float
    global_digest: str
    merge_order: list[int]
    """The order the inputs were summed in (floating-point sums depend on it): a replay needs it."""
    contrib_digest: dict[str, str]
    folded: list[dict[str, Any]]
    fold_rejected: list[dict[str, Any]]
    worker_idle_s: dict[str, float]
    """Persistent workers: seconds each sat idle before the round, waiting for its global (not the queue)."""
    jobs: dict[str, dict[str, Any]]
    """worker -> its latest job's state, queue wait, run time and attempts."""
    eval_loss: float | None = None
    """Filled in after the commit (the evaluation is off the critical path)."""
    eval_metrics: dict[str, float] = field(default_factory=dict)
    """The task's other eval metrics (e.g. accuracy), filled in with eval_loss."""
    worker_train_s: dict[str, float] = field(default_factory=dict)
    """Seconds each contributing worker spent on the round: loading its base, training, writing its contribution."""
    contribution_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of each merged contribution's file (what crossed storage, once written and once read)."""
    fp32_bytes: int | None = None
    """What one contribution's weights take in fp32: the ratio's yardstick."""
    round_s: float | None = None
    """The round's time: from the service's previous commit (for the first round it commits, from its
    start) to this commit. The one round time: the round line, the ETA, status and the report show it."""
    worker_read: dict[str, int] = field(default_factory=dict)
    """Bytes each merged worker's job read since its previous contribution (or its start): its
    base, or the contributions it replayed it from, and its data (its /proc/self/io)."""
    worker_written: dict[str, int] = field(default_factory=dict)
    """Bytes each merged worker's job wrote since its previous contribution: that contribution and
    any optimizer-state snapshot."""
    replayed: list[int] = field(default_factory=list)
    """Merged workers whose base of this round was made from the previous round's contributions
    (worker/replica.py), not read."""
    worker_state: dict[str, str] = field(default_factory=dict)
    """Where a worker's AdamW state came from, where that is news (orchestrator.round_merge.worker_state):
    fresh after a hard loss, a restart from a snapshot, snapshots refused."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def load(cls, storage: Storage, r: int) -> RoundRecord | None:
        """Round r's commit, checked; None when the round is not committed."""
        raw = storage.read_json(L.round_record(r), limit=LIMIT)
        if raw is None:
            return None
        rec = checked(cls, raw, storage.display(L.round_record(r)))
        if rec.round != r:
            raise RunError(f"{storage.display(L.round_record(r))} is round {rec.round}'s record, not round {r}'s")
        return rec

    def save(self, storage: Storage) -> None:
        storage.write_json(L.round_record(self.round), self.to_json())


@dataclass(frozen=True)
class RecordedInput:
    """One input a committed round merged, as its record names it."""

    worker: int
    """The worker id; a late fold's input: a negative id (orchestrator/late.py)."""
    key: str
    """Its checkpoint in the run directory."""
    weight: float


def recorded_inputs(record: Mapping[str, Any]) -> tuple[list[RecordedInput], str | None]:
    """The inputs a committed round merged, in the order its merge summed them (`merge_order`:
    floating-point sums depend on it), and what is wrong with the record's order, if anything (the
    inputs then come in the record's order of workers, then folds). Folds carry the service's
    negative ids (orchestrator.late.fold_inputs)."""
    r = record["round"]
    by_id = {int(w): RecordedInput(int(w), L.contribution(r, int(w)), float(record["weights"][str(w)]))
             for w in record["merged"]}
    for i, f in enumerate(record.get("folded", [])):  # no `id` (older records): its place, right if all merged
        fid = int(f.get("id", -(i + 1)))
        by_id[fid] = RecordedInput(fid, f["key"], float(f["weight"]))
    order = record.get("merge_order") or list(by_id)
    if sorted(order) != sorted(by_id):
        return list(by_id.values()), f"merge_order {order} does not name the merged inputs {sorted(by_id)}"
    return [by_id[i] for i in order], None


@dataclass
class Failure:
    """failed.json: why the run stopped for good (orchestrator/loop.py writes it)."""

    round: int | None = None
    reason: str = "(no reason recorded)"
    at: float | None = None

    @classmethod
    def load(cls, storage: Storage) -> Failure | None:
        raw = storage.read_json(L.FAILED, limit=LIMIT)
        return None if raw is None else checked(cls, raw, storage.display(L.FAILED))

    def save(self, storage: Storage) -> None:
        storage.write_json(L.FAILED, dataclasses.asdict(self))


@dataclass
class RunInfo:
    """run.json: written when the run is made, once more with the initial model's eval, and once
    the run is finished (its last round evaluated, its final model exported)."""

    created_at: float | None = None
    host: str | None = None
    params: int | None = None
    initial_eval_loss: float | None = None
    initial_eval_metrics: dict[str, float] = field(default_factory=dict)
    finished_at: float | None = None
    """When the service finished the run; until then a run whose rounds are all committed is finishing."""

    @classmethod
    def load(cls, storage: Storage) -> RunInfo:
        """The run's info, checked; empty when there is none. RunError for one that is not as written."""
        raw = storage.read_json(RUN_INFO, limit=LIMIT)
        return cls() if raw is None else checked(cls, raw, storage.display(RUN_INFO))

    def save(self, storage: Storage) -> None:
        storage.write_json(RUN_INFO, dataclasses.asdict(self))


def utilization(records: Iterable[Mapping[str, Any]]) -> float | None:
    """Busy time / (busy + idle) of the persistent workers in `records` (round records as JSON):
    how much of the time their nodes were held they trained. None without persistent workers
    (a per-round job's node is given back between rounds: its idle time is not measured)."""
    busy = idle = 0.0
    for rec in records:
        train, wait = rec.get("worker_train_s") or {}, rec.get("worker_idle_s") or {}
        for w in set(train) & set(wait):
            busy, idle = busy + train[w], idle + wait[w]
    return round(busy / (busy + idle), 4) if busy + idle > 0 else None
