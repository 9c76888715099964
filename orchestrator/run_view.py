"""What `submit` and `resume` show while the merge service drives a run.

One line per round, the same on a terminal and in a log file: its eval loss, who was merged, the
merge's and the round's wall time, and the ETA from the rounds measured so far. On a terminal a
live footer below those lines shows the round in progress: each worker's step and loss from its
heartbeat, ETA and rounds per hour (rich, redrawn once a second). Log records are not shown here
unless asked for (`-v`); they always go to the run's log file (orchestrator.console).

Rounds count from 0 wherever a person reads one (these lines, `status`, `report`, `cancel`, log
records and error messages), as in the run directory: round 0 is rounds/00000 and turns
global/round_00000 into global/round_00001. `(1/8)` beside it counts rounds done.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console, Group
from rich.text import Text

from core.config import Config
from orchestrator.console import say
from core.storage import Storage
from core.records import utilization
from orchestrator.runstate import arrived_workers, read_heartbeat

SHOWN_WORKERS = 8
"""Workers listed one per line in the footer; beyond, a summary line."""


def duration(seconds: float) -> str:
    """12s, 3m05s, 2h10m: what a person reads at a glance."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class RunView:
    """The round lines and, on a terminal, the live footer. `round_done(record)` after each round."""

    def __init__(self, console: Console, storage: Storage, cfg: Config, first_round: int,
                 phase: Callable[[], str] = lambda: "training") -> None:
        self.console, self.storage, self.cfg = console, storage, cfg
        self.phase = phase  # the service's: training, merging or evaluating (orchestrator.loop.Service.phase)
        self.current = first_round
        self.resumed_at = first_round if first_round > 0 else None
        self.last = time.time()  # the service's start, then its last commit: the round in progress runs since
        self.measured: list[float] = []
        """The round times (RoundRecord.round_s) of the rounds this service committed: the ETA's."""

    def round_done(self, rec: dict[str, Any]) -> None:
        wall = None
        if rec["round"] >= self.current:  # not a round committed before a resume, evaluated only now
            self.current = rec["round"] + 1
            if rec.get("round_s") is not None:
                wall = rec["round_s"]
                if rec["round"] != self.resumed_at:  # a resumed round: its workers may go on from mid-round
                    self.measured.append(wall if self.measured else self._recurring(rec))
                self.last = rec["committed_at"]
        say(round_line(rec, self.cfg.rounds, self.cfg.workers, wall, self.eta()), self.console)  # wrapped between words
        self.console.file.flush()  # a file or a pipe (a Slurm log, `| tee`) gets each round when it ends

    def _recurring(self, rec: dict[str, Any]) -> float:
        """What of the first round this service measures comes again each round: persistent workers
        start (processes, imports, the model built, the first steps compiled) in it only, so its
        workers' round time and the merge; per-round jobs start every round, so all of it."""
        train = [v for v in (rec.get("worker_train_s") or {}).values() if isinstance(v, (int, float))]
        if self.cfg.round.worker_mode != "persistent" or not train:
            return rec["round_s"]
        return min(rec["round_s"], max(train) + (rec.get("merge_seconds") or 0.0))

    def eta(self) -> float | None:
        """Seconds left from now: the mean round time of this service's rounds (its first without its
        jobs' start; a resume's first left out, as its workers may have gone on from mid-round) times
        the rounds left, less the time the round in progress has run; None before a round was
        measured. The round line and the footer both say this."""
        if not self.measured:
            return None
        left = sum(self.measured) / len(self.measured) * max(0, self.cfg.rounds - self.current)
        return max(0.0, left - (time.time() - self.last))

    @contextmanager
    def live(self) -> Iterator[None]:
        """The footer, on a terminal only; elsewhere (a pipe, a Slurm log) nothing but the lines."""
        if not self.console.is_terminal or self.console.is_dumb_terminal:
            yield
            return
        from rich.live import Live
        with Live(console=self.console, get_renderable=self.footer, refresh_per_second=1, transient=True):
            yield

    def footer(self) -> Group | Text:
        try:  # drawn from rich's refresh thread: a storage hiccup is shown, never raised there
            return self._footer()
        except Exception as exc:  # noqa: BLE001
            return Text(f"round {self.current}: progress unavailable ({type(exc).__name__}: {exc})")

    def _footer(self) -> Group:
        r, total, now = self.current, self.cfg.rounds, time.time()
        if r >= total:  # the last round is committed: the final model is being written
            return Group(Text(f"all {total} rounds done: writing the final model", style="bold"))
        phase = self.phase()
        if phase == "evaluating":  # round r is committed; its line comes with its eval loss
            return Group(Text(f"round {r} ({r + 1}/{total}) merged: evaluating the new global model", style="bold"))
        head = f"round {r} ({r + 1}/{total}) " + ("merging" if phase == "merging" else "running") + \
            f" for {duration(now - self.last)}"
        if (eta := self.eta()) is not None:
            spent = sum(self.measured)
            rate = 3600 * len(self.measured) / spent if spent > 0 else 0.0
            head += f", ETA {duration(eta)}, {rate:.0f} rounds/h"
        lines = [Text(head, style="bold")]
        arrived = set(arrived_workers(self.storage, r))
        for w in range(min(self.cfg.workers, SHOWN_WORKERS)):
            lines.append(Text(f"  worker {w}: {worker_state(w, r, arrived, read_heartbeat(self.storage, w))}"))
        if self.cfg.workers > SHOWN_WORKERS:
            lines.append(Text(f"  ... {len(arrived)}/{self.cfg.workers} workers published"))
        return Group(*lines)


def worker_state(w: int, r: int, arrived: set[int], beat: dict[str, Any] | None) -> str:
    if w in arrived:  # round.overlap: it may already train the next round's steps
        ahead = beat is not None and beat["round"] == r + 1 and beat.get("ahead")
        return f"published; training ahead, step {beat['step']}" if ahead else "published"  # type: ignore[index]
    if beat is None or beat["round"] != r:
        return "starting"
    loss = "" if beat["loss"] is None else f", loss {beat['loss']:.3f}"
    return f"step {beat['step']}/{beat['steps']}{loss}"


def round_line(rec: dict[str, Any], total: int, workers: int, wall_s: float | None, eta_s: float | None) -> str:
    r = rec["round"]
    loss = "not evaluated" if rec["eval_loss"] is None else f"{rec['eval_loss']:.4f}"
    line = f"round {r} ({r + 1}/{total}): eval loss {loss}"
    line += "".join(f", {k} {v:.4f}" for k, v in (rec.get("eval_metrics") or {}).items())  # the task's, e.g. accuracy
    line += f", merged {len(rec['merged'])}/{workers}"
    if rec["dropped"]:
        line += f", dropped {rec['dropped']}"
    if rec["rejected"]:
        line += f", rejected {rec['rejected']}"
    line += f", merge {rec['merge_seconds']:.2f}s"
    if wall_s is not None:
        line += f", round {duration(wall_s)}"
    if (busy := utilization([rec])) is not None:
        line += f", workers busy {100 * busy:.0f}%"
    if eta_s is not None and r + 1 < total:
        line += f", ETA {duration(eta_s)}"
    return line
