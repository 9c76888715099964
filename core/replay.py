"""Replaying a run (`orchestrate submit --replay RUN`): the same config and seed, the same bytes.

A run's bytes depend on its config, its seed, and on what its timing decided, and each of those
decisions is recorded in the run directory: how many steps each worker trained in each round
(`steps` in its contribution's manifest; round.budget: seconds stops on the clock), the step at
which an overlapped worker adopted its round's base (`overlap.adopted_at_step`; round.overlap), and
the order each merge summed its contributions in (`merge_order` in the round's record). A replay's
schedule (`replay.json`, written when the replay is created) holds them: its workers train exactly
those steps and adopt at exactly those steps, and its service sums in exactly that order, so every
published global equals the source run's bit for bit.

Only a finished run in which every round merged every worker's contribution can be replayed:
which contributions a merge took (a deadline, a rejection, a late fold) is not something a worker
can be made to repeat. The schedule is read back from storage, so it is checked like any other
file there before anyone uses it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from core.config import Config
from core.errors import CheckpointError, RunError
from core.layout import RunLayout
from core.manifest import read_manifest
from core.records import RoundRecord
from core.storage import Storage

L = RunLayout()
LIMIT = 1 << 24
"""Bytes a schedule may have (K x T entries of a few dozen bytes: 1000 x 1000 fits)."""


@dataclass(frozen=True)
class Schedule:
    source: str
    """The run this one replays, as its directory was displayed."""
    steps: dict[tuple[int, int], int]
    """(round, worker) -> inner steps it trained."""
    adopted_at: dict[tuple[int, int], int | None]
    """(round, worker) -> the step at which it adopted the round's base (round.overlap), or None when
    it trained the round from its base."""
    order: dict[int, list[int]]
    """round -> the workers in the order its merge summed them."""
    threads: int | None = None
    """torch CPU threads of every source worker (all ranks together), when they all had the same:
    the replay's inner.threads, since sums split over another number of threads differ in the last bits."""

    def to_json(self) -> dict[str, Any]:
        rounds = sorted(self.order)
        return {"source": self.source, "threads": self.threads, "rounds": [
            {"round": r, "order": self.order[r],
             "workers": {str(w): {"steps": self.steps[r, w], "adopted_at_step": self.adopted_at[r, w]}
                         for w in sorted(self.order[r])}} for r in rounds]}

    def save(self, storage: Storage) -> None:
        storage.write_json(L.REPLAY, self.to_json())


def from_run(storage: Storage, workers: int, rounds: int, max_steps: int) -> Schedule:
    """The schedule of the finished run at `storage` (K = workers, T = rounds, H = max_steps), or a
    RunError listing every reason it cannot be replayed."""
    problems: list[str] = []
    steps, adopted, order, threads = {}, {}, {}, set()
    for r in range(rounds):
        try:
            record = RoundRecord.load(storage, r)
        except RunError as exc:
            problems.append(str(exc))
            continue
        if record is None:
            problems.append(f"round {r} is not committed (no {storage.display(L.round_record(r))}): only a finished "
                            "run can be replayed")
            continue
        merged, folded = record.merged, record.folded
        if merged != list(range(workers)) or folded:
            problems.append(f"round {r} merged workers {str(merged)[:80]} and {len(folded)} "
                            f"late fold(s), not all {workers} workers: a replay cannot make a merge leave out or fold in "
                            "the same contributions")
            continue
        order[r] = record.merge_order or merged
        for w in range(workers):
            try:
                m = read_manifest(storage, L.contribution(r, w)) or {}
            except CheckpointError as exc:
                problems.append(str(exc))
                continue
            steps[r, w] = m.get("steps")
            adopted[r, w] = (m.get("overlap") or {}).get("adopted_at_step")  # checked by read_manifest
            t, n = m.get("threads"), m.get("ranks", 1)  # per rank; ranks
            threads.add(t * n if all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 4096 for v in (t, n))
                        else None)
    if problems:
        raise RunError(f"{storage.display()} cannot be replayed:\n  - " + "\n  - ".join(problems))
    schedule = Schedule(storage.display(), steps, adopted, order, threads.pop() if len(threads) == 1 else None)
    if problems := check(schedule, workers, rounds, max_steps):
        raise RunError(f"{storage.display()} cannot be replayed, its records do not add up:\n  - " + "\n  - ".join(problems))
    return schedule


def of_run(storage: Storage, cfg: Config) -> Schedule | None:
    """The schedule a run follows when its config says it is a replay (round.replay), else None."""
    return load(storage, cfg.workers, cfg.rounds, cfg.inner.steps) if cfg.round.replay else None


def load(storage: Storage, workers: int, rounds: int, max_steps: int) -> Schedule:
    """The replay schedule of the run at `storage`, checked against its K, T and H."""
    where = storage.display(L.REPLAY)
    again = "create the replay again with `orchestrate submit --replay RUN`"
    try:
        raw = json.loads(storage.read_bytes(L.REPLAY, limit=LIMIT))
    except FileNotFoundError:
        raise RunError(f"{where} is missing: this run is a replay (round.replay) and needs it; {again}") from None
    except (ValueError, UnicodeDecodeError, RecursionError, CheckpointError) as exc:  # not JSON, or too large
        raise RunError(f"{where} is not a replay schedule islands wrote ({type(exc).__name__}: {str(exc)[:200]}); "
                       f"{again}") from None
    try:
        threads = raw.get("threads")
        schedule = Schedule(str(raw["source"]), *_parse_rounds(raw["rounds"]), None if threads is None else _int(threads))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RunError(f"{where} is not a replay schedule islands wrote ({type(exc).__name__}: {exc}); {again}") from None
    if problems := check(schedule, workers, rounds, max_steps):
        raise RunError(f"{where} does not fit this run:\n  - " + "\n  - ".join(problems[:10]))
    return schedule


def _parse_rounds(rounds: Any) -> tuple[dict, dict, dict]:
    steps, adopted, order = {}, {}, {}
    for entry in rounds:
        r = _int(entry["round"])
        order[r] = [_int(w) for w in entry["order"]]
        for w, e in entry["workers"].items():
            steps[r, _int(w)] = e["steps"]
            adopted[r, _int(w)] = e["adopted_at_step"]
    return steps, adopted, order


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise TypeError(f"{v!r} is not a whole number")
    return int(v)


def check(s: Schedule, workers: int, rounds: int, max_steps: int) -> list[str]:
    """Everything that keeps schedule `s` from being followed by a run of K workers, T rounds, H steps."""
    problems = []
    if s.threads is not None and not 1 <= s.threads <= 4096:
        problems.append(f"{s.threads} threads per worker, not in [1, 4096]")
    if sorted(s.order) != list(range(rounds)):
        problems.append(f"it schedules rounds {sorted(s.order)[:8]}, not 0..{rounds - 1}")
    for r, o in sorted(s.order.items()):
        if sorted(o) != list(range(workers)):
            problems.append(f"round {r}: merge order {o[:8]} is not an order of the {workers} workers")
    for (r, w), n in sorted(s.steps.items()):
        a = s.adopted_at.get((r, w))
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_steps:
            problems.append(f"round {r} worker {w}: {n!r} steps, not a whole number in [1, inner.steps = {max_steps}]")
        elif a is not None and (isinstance(a, bool) or not isinstance(a, int) or not 0 <= a <= n):
            problems.append(f"round {r} worker {w}: adopted its base at step {a!r}, not a step in [0, {n}]")
        elif a is not None and r == 0:
            problems.append(f"round 0 worker {w}: adopted at step {a}, but no worker trains ahead into round 0")
    missing = [(r, w) for r in range(rounds) for w in range(workers) if (r, w) not in s.steps]
    if missing:
        problems.append(f"no steps for (round, worker) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return problems
