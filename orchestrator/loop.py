"""The merge service: drives a run from storage alone. Read it top to bottom.

For each round r: submit its workers (orchestrator.submission); then, every round.poll_s, list the
contributions that arrived, ask the scheduler which jobs are alive, and decide (orchestrator.plan):
wait (folding what landed into the running sum), resubmit lost workers, give up, or merge
(orchestrator.round_merge) and commit the round by writing its record last. Round r+1's jobs queue
while the new global model is evaluated.

Everything the service knows is in the run directory, so a killed service is resumed by starting
it again: a round with a record is never redone; a round without one is merged again from the same
inputs (round r's merge reads outer/state_r and writes state_r+1, so it is never applied twice);
a committed round's missing outer state is rebuilt (orchestrator.outer_state).

Only the holder of the run's lease drives it (orchestrator.lease): every write goes through the
lease's fenced storage, and the loop stops at its next poll once another service has taken the run.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from core.config import Config
from core.errors import RunError
from core.layout import RunLayout
from core.outer import outer_step
from merge.rounds import QuorumError
from orchestrator.executor import Executor, JobStatus
from orchestrator.lease import Lease
from orchestrator.observe.metrics import write_round_metrics
from orchestrator.observe.trackers import Trackers
from orchestrator.outer_state import ensure_outer_state
from orchestrator.plan import Decision, WorkerView, decide
from orchestrator import retention
from core.records import Failure, JobEntry, RoundJobs, RoundRecord, RunInfo, number
from orchestrator.round_merge import RoundMerger
from orchestrator.runstate import arrived_workers
from orchestrator.run_models import Evaluator, export_final
from orchestrator.submission import UNKNOWN, Submitter

log = logging.getLogger(__name__)
L = RunLayout()


class Cancelled(RunError):
    pass


class Service:
    def __init__(self, lease: Lease, cfg: Config, executor: Executor,
                 on_round: Callable[[RoundRecord], None] | None = None, trackers: Trackers | None = None) -> None:
        self.lease, self.cfg, self.executor = lease, cfg, executor
        self.trackers = trackers or Trackers()  # W&B, MLflow (log.*): sent each round's metrics
        self.phase = "training"
        """What the service does now, for the live footer: training (waiting for the round's workers),
        merging, or evaluating (the round just committed)."""
        self.storage = lease.storage  # fenced: nothing is written once another service holds the run
        self.on_round = on_round or (lambda record: None)
        self.evaluator = Evaluator(cfg)
        self.submitter = Submitter(self.storage, cfg, executor)
        self.merger = RoundMerger(self.submitter, self.evaluator.metadata)
        self._arrived_before: set[int] = set()
        self._kept_from = 0  # rounds before it hold no tensor retention would delete (orchestrator/retention.py)
        # torch.optim's first step pays its lazy imports (seconds): pay them now, not inside round 0's merge.
        outer_step(torch.zeros(1), torch.zeros(1), {}, cfg.outer)

    def run(self) -> None:
        # Starting (or resuming) the service is the decision to carry on: clear the stop markers.
        self.storage.remove(L.FAILED)
        self.storage.remove(L.CANCEL)
        self.storage.remove(L.STOP)
        r = self.first_open_round()
        ensure_outer_state(self.storage, self.cfg, r, self.evaluator.metadata)  # a service that died writing it
        for done in range(r):  # a service killed between commit and evaluation left rounds without a loss
            record = RoundRecord.load(self.storage, done)
            if record is not None and record.eval_loss is None:
                self.evaluate(record)
        while r < self.cfg.rounds:
            record = self.run_round(r)
            if r + 1 < self.cfg.rounds:  # the next round's workers queue while we evaluate this one
                self.submitter.ensure(r + 1)
            self.evaluate(record)
            retention.prune(self.storage, self.cfg, r, self._kept_from)
            self._kept_from = retention.kept_from(self.cfg, r)
            r += 1
        export_final(self.storage, self.cfg)
        info = RunInfo.load(self.storage)
        if info.finished_at is None:  # the last write: `status` says done from here on
            info.finished_at = time.time()
            info.save(self.storage)

    def first_open_round(self) -> int:
        r = 0
        while r < self.cfg.rounds and self.storage.exists(L.round_record(r)):
            r += 1
        return r

    def run_round(self, r: int) -> RoundRecord:
        """Drive round r to its commit; returns the record (without the eval loss yet)."""
        jobs = self.submitter.ensure(r)
        while True:
            self.lease.check()
            self._check_cancel(jobs)
            decision, states = self._poll(jobs)
            if decision.action == "merge":
                self.phase = "merging"
                try:
                    record = self.merger.merge(jobs, decision, states)
                except QuorumError as exc:  # too many were refused: retry those workers instead
                    log.warning("round %d: %s", r, exc)
                    self.merger.set_aside(jobs, exc.rejected)
                    self.phase = "training"
                    continue
                self.merger.commit(jobs, record)
                return record
            self.merger.stream(jobs)  # fold what landed; what lands last is folded at the merge
            if decision.action == "resubmit":
                ours = all(self.executor.cancelled_here(jobs.workers[w].latest) for w in decision.workers)
                log.log(logging.INFO if ours else logging.WARNING, "round %d: %s; resubmitting", r,
                        decision.reason + (" (islands cancelled them: Ctrl-C or `orchestrate cancel`)" if ours else ""))
                self.submitter.resubmit(jobs, decision.workers, states)
            elif decision.action == "fail":
                self._fail(jobs, decision, states)
            time.sleep(self.cfg.round.poll_s)

    def _poll(self, jobs: RoundJobs) -> tuple[Decision, dict[str, JobStatus]]:
        """What arrived (storage) and which jobs still run (the scheduler, with back-off), decided."""
        arrived = set(arrived_workers(self.storage, jobs.round))
        waiting = [j for w, j in jobs.latest().items() if w not in arrived]
        states = self.executor.watch(waiting, news=arrived != self._arrived_before)
        self._arrived_before = arrived
        if any(not states.get(j, UNKNOWN).alive for j in waiting):
            # a job that published and ended between the listing and the scheduler's answer is not
            # a loss: list again, after the answer (storage first would miss it, storage after cannot)
            arrived = set(arrived_workers(self.storage, jobs.round))
        views = [WorkerView(w, w in arrived, w not in arrived and states.get(j, UNKNOWN).alive, self._attempts(jobs.workers[w]))
                 for w, j in jobs.latest().items()]
        decision = decide(views, quorum=self.cfg.quorum, elapsed_s=time.time() - (jobs.submitted_at or time.time()),
                          deadline_s=self.cfg.round.deadline_s, max_retries=self.cfg.round.max_retries)
        return decision, states

    def _attempts(self, entry: JobEntry) -> int:
        """A worker's attempts at a round that count against round.max_retries: a job islands stopped
        itself (Ctrl-C, `orchestrate cancel`, then `resume`) spends no retry."""
        return entry.attempts - sum(self.executor.cancelled_here(j) for j in entry.job_ids)

    def evaluate(self, record: RoundRecord) -> None:
        """Add the new global model's eval metrics to a committed round record (off the critical path)."""
        self.phase = "evaluating"
        metrics = self.evaluator.metrics(self.storage, L.global_weights(record.round + 1))
        bad = sorted(k for k, v in metrics.items() if number(v) is None)
        if bad:  # a record never carries a non-finite figure: its loader would refuse the whole record
            log.warning("round %d: eval %s not a finite number; recorded as missing", record.round, ", ".join(bad))
        metrics = {k: v for k, v in metrics.items() if k not in bad}
        record.eval_loss, record.eval_metrics = metrics.pop("loss", None), metrics
        record.save(self.storage)
        lines = write_round_metrics(self.storage, self.cfg, record.to_json())  # metrics/round_r.jsonl (docs/observability.md)
        self.trackers.send(lines)
        self.phase = "training"
        self.on_round(record)

    def _check_cancel(self, jobs: RoundJobs) -> None:
        if self.storage.exists(L.CANCEL):  # the workers see it too: each saves where it is, then ends
            from orchestrator.executor import STOP_WAIT_S
            self.executor.end_gracefully(list(jobs.latest().values()), STOP_WAIT_S)
            raise Cancelled(f"run cancelled during round {jobs.round} (marker {self.storage.display(L.CANCEL)})")

    def _fail(self, jobs: RoundJobs, decision: Decision, states: dict[str, JobStatus]) -> None:
        self.submitter.record_losses(jobs, list(jobs.workers), states)
        jobs.save(self.storage)
        reason = decision.reason + self.submitter.errors(jobs)
        Failure(jobs.round, reason, time.time()).save(self.storage)
        raise RunError(f"round {jobs.round} cannot be merged: {reason}. Fix the cause (see the job logs in "
                       f"{self.executor.folder}), then `orchestrate resume {self.storage.display()}`")
