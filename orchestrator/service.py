"""The merge service: drives a run from storage alone.

For each round: submit the workers (one batch), poll the run directory and the scheduler, decide
(orchestrator.plan) whether to wait, resubmit or merge, merge (merge.rounds), evaluate the new
global model, and commit the round by writing its record last. Everything it knows is in the run
directory, so a killed service is resumed by starting it again: a round with a record is never
redone, a round without one is merged again from the same inputs (the outer-optimizer state of
round r is read from state_r and written to state_r+1, so it is never applied twice); a resumed
service rebuilds a committed round's missing state (orchestrator.outer_state).

Every contribution is untrusted: its weight is derived from what the service asked of its worker
(orchestrator.plan.contribution_weight), never taken from its manifest, and whatever goes wrong
while it is read or folded rejects it with the reason in the round's record; the file is moved to
the round's `rejected/` folder, and the round goes on.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from core.checkpoint import read_manifest
from core.config import Config
from core.errors import CheckpointError, RunError
from core.failpoints import failpoint
from core.layout import RunLayout, manifest_key
from core.storage import Storage
from core.task import WorkerTask
from merge.outer import outer_step
from merge.rounds import Contribution, QuorumError, RunningSum, merge_round
from merge.lte import merge_lte_round
from orchestrator.executor import Executor, JobStatus
from orchestrator.plan import Decision, WorkerView, contribution_weight, decide, next_bases
from orchestrator import late
from orchestrator.metrics import write_round_metrics
from orchestrator.outer_state import ensure_outer_state
from orchestrator.runstate import Evaluator, arrived_workers, export_final, jobs_of_round

log = logging.getLogger(__name__)
L = RunLayout()


_UNKNOWN = JobStatus("?", "UNKNOWN")  # not polled yet: assume alive


class Cancelled(RunError):
    pass


class RoundService:
    def __init__(self, storage: Storage, cfg: Config, executor: Executor,
                 on_round: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.storage, self.cfg, self.executor = storage, cfg, executor
        self.on_round = on_round or (lambda record: None)
        self.evaluator = Evaluator(cfg)
        self._states: dict[str, JobStatus] = {}
        self._last_arrived: set[int] = set()
        self._last_sched = 0.0
        self._sched_interval = cfg.round.poll_s
        self._sum: RunningSum | None = None  # round `_sum_round`'s contributions folded as they land
        self._sum_round = -1
        # torch.optim's first step pays ~1.5 s of lazy imports: pay it now, not inside round 0's merge.
        outer_step(torch.zeros(1), torch.zeros(1), {}, cfg.outer)

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> None:
        # Starting (or resuming) the service is the decision to carry on: clear the stop markers.
        self.storage.remove(L.FAILED)
        self.storage.remove(L.CANCEL)
        r = self.first_open_round()
        ensure_outer_state(self.storage, self.cfg, r, self.evaluator.metadata)  # a service that died writing it
        self._evaluate_missing(r)
        while r < self.cfg.rounds:
            record = self.run_round(r)
            if r + 1 < self.cfg.rounds:  # the next round's workers queue while we evaluate this one
                self._ensure_submitted(r + 1)
            self._evaluate(record)
            r += 1
        export_final(self.storage, self.cfg)

    def _ensure_submitted(self, r: int) -> dict[str, Any]:
        jobs = jobs_of_round(self.storage, r)
        if not jobs["workers"]:
            bases = self._bases(r)
            adopted = self._assign_persistent(r, jobs, bases)
            todo = [w for w in range(self.cfg.workers) if w not in adopted]
            if todo:
                self._submit(r, jobs, todo, bases)
            else:
                self.storage.write_json(L.round_jobs(r), jobs)
        return jobs

    def _assign_persistent(self, r: int, jobs: dict[str, Any], bases: dict[int, str]) -> list[int]:
        """Hand round r to persistent jobs of round r-1 that are still alive: no sbatch, no queue."""
        if self.cfg.round.worker_mode != "persistent" or r == 0:
            return []
        prev = jobs_of_round(self.storage, r - 1)["workers"]
        latest = {int(w): e["job_ids"][-1] for w, e in prev.items()}
        states = self.executor.status(list(latest.values()))
        adopted = [w for w, j in latest.items() if states[j].alive]
        now = time.time()
        digests = self._base_digests({bases[w] for w in adopted})
        for w in adopted:
            jobs["workers"][str(w)] = {"attempts": 1, "job_ids": [latest[w]], "base": bases[w], "persistent": True,
                                       "base_digest": digests[bases[w]], "submitted_at": now}
        jobs.setdefault("submitted_at", now)
        return adopted

    def _evaluate(self, record: dict[str, Any]) -> None:
        """Add the new global model's eval loss to a committed round record (off the critical path)."""
        r = record["round"]
        record["eval_loss"] = self.evaluator.loss(self.storage, L.global_weights(r + 1))
        self.storage.write_json(L.round_record(r), record)
        write_round_metrics(self.storage, self.cfg, record)  # metrics/round_r.jsonl (docs/observability.md)
        self.on_round(record)

    def _evaluate_missing(self, upto: int) -> None:
        """A service killed between commit and evaluation left rounds without an eval loss."""
        for r in range(upto):
            record = self.storage.read_json(L.round_record(r)) or {}
            if record.get("eval_loss") is None and record:
                self._evaluate(record)

    def first_open_round(self) -> int:
        r = 0
        while r < self.cfg.rounds and self.storage.exists(L.round_record(r)):
            r += 1
        return r

    # -- one round --------------------------------------------------------------------------
    def run_round(self, r: int) -> dict[str, Any]:
        """Drive round r to its commit; returns the record (without the eval loss yet)."""
        jobs = self._ensure_submitted(r)
        while True:
            self._check_cancel(r, jobs)
            decision = self._decide(r, jobs)
            if decision.action != "merge":  # fold what landed; what lands last is folded at the merge
                self._stream(r, jobs)
            if decision.action == "merge":
                try:
                    return self._merge(r, jobs, decision)
                except QuorumError as exc:  # too many were refused: retry those workers instead
                    log.warning("round %d: %s", r, exc)
                    self._set_aside(r, jobs, exc.rejected)
                    continue
            if decision.action == "resubmit":
                log.warning("round %d: %s; resubmitting", r, decision.reason)
                self._record_losses(r, jobs, decision.workers)
                self._submit(r, jobs, list(decision.workers), {w: jobs["workers"][str(w)]["base"] for w in decision.workers})
            elif decision.action == "fail":
                self._record_losses(r, jobs, [int(w) for w in jobs["workers"]])
                self.storage.write_json(L.FAILED, {"round": r, "reason": decision.reason, "at": time.time()})
                raise RunError(f"round {r} cannot be merged: {decision.reason}. Fix the cause (see the job logs in "
                               f"{self.executor.folder}), then `orchestrate resume {self.storage.display()}`")
            time.sleep(self.cfg.round.poll_s)

    def _bases(self, r: int) -> dict[int, str]:
        if r == 0:
            return {w: L.global_weights(0) for w in range(self.cfg.workers)}
        prev = self.storage.read_json(L.round_record(r - 1)) or {}
        late_keys = {int(w): L.contribution(r - 1, int(w)) for w in prev.get("late", [])}
        # lte: a contribution holds heads, not weights to continue from: every worker takes the new base
        policy = "restart" if self.cfg.algorithm == "lte" else self.cfg.round.late_policy
        return next_bases(self.cfg.workers, prev.get("merged", []), late_keys, policy, L.global_weights(r))

    def _submit(self, r: int, jobs: dict[str, Any], workers: list[int], bases: dict[int, str]) -> None:
        threads = self._threads()
        digests = self._base_digests({bases[w] for w in workers})
        tasks = []
        for w in workers:
            entry = jobs["workers"].setdefault(str(w), {"attempts": 0, "job_ids": []})
            entry.update(base=bases[w], base_digest=digests[bases[w]])
            persistent = self.cfg.round.worker_mode == "persistent"
            entry["persistent"] = persistent
            tasks.append(WorkerTask(self.storage.url, r, w, bases[w], attempt=entry["attempts"], threads=threads,
                                    persistent=persistent))
        ids = self.executor.submit(tasks)
        now = time.time()
        for w, job_id in zip(workers, ids):
            entry = jobs["workers"][str(w)]
            entry["attempts"] += 1
            entry["job_ids"].append(job_id)
            entry["submitted_at"] = now
        jobs.setdefault("submitted_at", now)
        jobs["sbatch_calls"] = jobs.get("sbatch_calls", 0) + 1
        self.storage.write_json(L.round_jobs(r), jobs)
        log.info("round %d: submitted workers %s as jobs %s", r, workers, ids)

    def _base_digests(self, keys: set[str]) -> dict[str, str]:
        """digest of each distinct base checkpoint: K workers mostly share one, read its manifest once."""
        return {k: read_manifest(self.storage, k)["digest"] for k in keys}

    def _threads(self) -> int:
        if self.cfg.inner.threads:
            return self.cfg.inner.threads
        if self.executor.kind == "local":  # K processes share this machine's cores
            import os
            return max(1, (os.cpu_count() or 1) // self.cfg.workers)
        return self.cfg.executor.cpus_per_task

    def _decide(self, r: int, jobs: dict[str, Any]) -> Decision:
        arrived = self._arrived(r)
        latest = {w: e["job_ids"][-1] for w, e in jobs["workers"].items()}
        waiting = [j for w, j in latest.items() if int(w) not in arrived]
        states = self._poll_scheduler(waiting, arrived)
        if any(not states.get(j, _UNKNOWN).alive for j in waiting):
            # a job that published and ended between the listing and the scheduler's answer is not
            # a loss: list again, after the answer (storage first would miss it, storage after cannot)
            arrived = self._arrived(r)
        views = [WorkerView(int(w), int(w) in arrived, int(w) not in arrived and states.get(j, _UNKNOWN).alive,
                            jobs["workers"][w]["attempts"]) for w, j in latest.items()]
        return decide(views, quorum=self.cfg.quorum, elapsed_s=time.time() - jobs["submitted_at"],
                      deadline_s=self.cfg.round.deadline_s, max_retries=self.cfg.round.max_retries)

    def _poll_scheduler(self, job_ids: list[str], arrived: set[int]) -> dict[str, JobStatus]:
        """Job states, asked of the scheduler with back-off: storage tells arrivals at once, the
        scheduler is only needed to notice dead jobs, and one sacct per poll per run is the most we
        ever send. The interval doubles (up to 30 s) while nothing changes."""
        now = time.monotonic()
        changed = arrived != self._last_arrived or set(job_ids) - set(self._states)
        if changed:
            self._sched_interval = self.cfg.round.poll_s
        if changed or now - self._last_sched >= self._sched_interval:
            self._states.update(self.executor.status(job_ids))
            self._last_sched = now
            self._sched_interval = min(30.0, self._sched_interval * 2)
        self._last_arrived = set(arrived)
        return self._states

    def _arrived(self, r: int) -> set[int]:
        return set(arrived_workers(self.storage, r))

    def _check_cancel(self, r: int, jobs: dict[str, Any]) -> None:
        if self.storage.exists(L.CANCEL):
            self.executor.cancel([e["job_ids"][-1] for e in jobs["workers"].values()])
            raise Cancelled(f"run cancelled during round {r} (marker {self.storage.display(L.CANCEL)})")

    def _set_aside(self, r: int, jobs: dict[str, Any], rejected: dict[int, str]) -> None:
        """Move refused contributions out of the round (kept as evidence) so their workers rerun."""
        for w, why in rejected.items():
            entry = jobs["workers"][str(w)]
            dest = L.rejected_contribution(r, w, entry["attempts"])
            src = L.contribution(r, w)
            for a, b in ((manifest_key(src), manifest_key(dest)), (src, dest)):  # unpublish first
                with contextlib.suppress(FileNotFoundError):
                    self.storage.move(a, b)  # a rename: whatever it is (a FIFO too), it is not read
            self.storage.write_json(L.rejected_reason(r, w, entry["attempts"]), {"worker": w, "reason": why,
                                    "job_id": entry["job_ids"][-1], "at": time.time()})
            entry.setdefault("failures", []).append({"job_id": entry["job_ids"][-1], "rejected": why})
        self.storage.write_json(L.round_jobs(r), jobs)

    def _record_losses(self, r: int, jobs: dict[str, Any], workers: list[int] | tuple[int, ...]) -> None:
        for w in workers:
            entry = jobs["workers"][str(w)]
            job_id = entry["job_ids"][-1]
            state = self._states.get(job_id, _UNKNOWN).state
            entry.setdefault("failures", []).append({"job_id": job_id, "state": state,
                                                     "log_tail": self.executor.stderr_tail(job_id)[-2000:]})
            log.warning("round %d: worker %s job %s ended (%s) without a contribution", r, w, job_id, state)

    # -- merge + commit ---------------------------------------------------------------------
    def _merge(self, r: int, jobs: dict[str, Any], decision: Decision) -> dict[str, Any]:
        self._idle: dict[int, float] = {}
        self._digests: dict[int, str] = {}  # of each contribution merged: what a replay must find (bench/chaos.py)
        stale, contribs = self._contributions(r, jobs, decision.workers)
        t0 = time.time()
        fold = self.cfg.round.late_policy == "fold" and self.cfg.algorithm != "lte"
        folded, fold_refused = late.prepare_folds(self.storage, self.cfg, r) if fold else ([], [])
        try:
            if self.cfg.algorithm == "lte":  # W <- W + (s/N) sum_n B_n A_n, the rest averaged (merge/lte.py)
                from worker.lora import contribution_shapes
                result = merge_lte_round(
                    self.storage, L.global_weights(r), contribs, L.global_weights(r + 1),
                    scale=self.cfg.lte.alpha / self.cfg.lte.rank, rank=self.cfg.lte.rank,
                    expected=contribution_shapes(self.cfg.model, self.cfg.lte.rank),
                    min_inputs=self.cfg.quorum, metadata=self.evaluator.metadata, manifest={"round": r + 1})
            else:
                result = merge_round(
                    self.storage, L.global_weights(r), contribs + late.fold_inputs(folded), L.global_weights(r + 1),
                    self.cfg.outer,
                    state_in_key=L.outer_state(r) if r > 0 else None, state_out_key=L.outer_state(r + 1),
                    min_inputs=self.cfg.quorum, metadata=self.evaluator.metadata, manifest={"round": r + 1},
                    accumulator=self._sum if self._sum_round == r else None)
        except QuorumError as exc:
            exc.rejected = {w: why for w, why in {**exc.rejected, **stale}.items() if w >= 0}  # < 0: folds
            raise
        self._sum, self._sum_round = None, -1  # spent: it holds the mean now
        merged, on_time_rejected, merged_folds, refused = late.split_merged(result.merged, result.rejected, folded)
        if len(merged) < self.cfg.quorum:  # folds never make up a quorum: not committed, global_r+1 is redone
            raise QuorumError(f"only {len(merged)} on-time contribution(s) merged, the quorum is {self.cfg.quorum}",
                              {**stale, **on_time_rejected})
        rejected = {**stale, **on_time_rejected}
        everyone = set(range(self.cfg.workers))
        dropped = sorted(everyone - set(merged) - set(rejected))
        why = self._why_dropped(r, jobs, dropped)
        latest = {w: e["job_ids"][-1] for w, e in jobs["workers"].items()}
        final = self.executor.status(list(latest.values()))  # one call: queue wait and run time per job
        stragglers = [jobs["workers"][str(w)]["job_ids"][-1] for w in dropped if why[str(w)].startswith("still")]
        if fold and r + 1 < self.cfg.rounds:  # fold: stragglers run on; their work joins a later merge
            stragglers = []
        elif fold:  # the last round: no later merge can fold anything in
            stragglers += late.unfinished_late_jobs(self.storage, r, self.cfg.round.max_staleness)
        self.executor.cancel(stragglers)
        record = {
            "round": r, "merged": merged, "dropped": dropped, "rejected": sorted(rejected),
            "rejected_reasons": {str(w): why for w, why in rejected.items()}, "dropped_reasons": why,
            "late": sorted(set(dropped) & self._arrived(r)),
            "reason": decision.reason, "eval_loss": None,
            "merge_seconds": round(result.seconds, 3), "bytes_read": result.bytes_read,
            "outer_grad_norm": result.outer_grad_norm, "weights": {str(c.worker): c.weight for c in contribs},
            "submitted_at": jobs["submitted_at"], "merge_started_at": t0, "committed_at": time.time(),
            "global_digest": result.manifest["digest"], "merge_order": result.order,
            "contrib_digest": {str(w): self._digests[w] for w in merged}, "folded": merged_folds, "fold_rejected": fold_refused + refused,
            "worker_idle_s": {str(w): s for w, s in self._idle.items()},  # persistent workers waiting for this round
            "jobs": {w: {**final[j].as_dict(), "attempts": jobs["workers"][w]["attempts"]} for w, j in latest.items()},
        }
        failpoint("service.before_record")
        self.storage.write_json(L.round_record(r), record)  # the commit point of the round
        failpoint("service.after_record")
        self._set_aside(r, jobs, rejected)  # after the commit: a resumed round finds them where the merge did
        return record

    def _why_dropped(self, r: int, jobs: dict[str, Any], dropped: list[int]) -> dict[str, str]:
        """For each dropped worker: its job's end state (recorded with its log), or that it is a straggler."""
        why = {}
        ended = []
        for w in dropped:
            job_id = jobs["workers"][str(w)]["job_ids"][-1]
            status = self._states.get(job_id, _UNKNOWN)
            why[str(w)] = f"job {job_id} ended {status.state} without a contribution" if not status.alive \
                else f"still {status.state} at the merge (straggler): job {job_id} " + (
                    "runs on, to be folded in later" if self.cfg.round.late_policy == "fold" and r + 1 < self.cfg.rounds
                    else "cancelled")
            if not status.alive:
                ended.append(w)
        if ended:
            self._record_losses(r, jobs, ended)
            self.storage.write_json(L.round_jobs(r), jobs)
        return why

    def _contributions(self, r: int, jobs: dict[str, Any], workers: tuple[int, ...]) -> tuple[dict[int, str], list[Contribution]]:
        """Contributions to merge; those trained from the wrong base are rejected as stale."""
        stale: dict[int, str] = {}
        out = []
        for w in workers:
            c, why, m = self._contribution(r, jobs, w)
            if c is None:  # stale, or an invalid manifest
                stale[w] = why
                continue
            out.append(c)
            self._digests[w] = m.get("digest")
            if m.get("waited_s") is not None:
                self._idle[w] = m["waited_s"]
        return stale, out

    def _contribution(self, r: int, jobs: dict[str, Any], w: int) -> tuple[Contribution | None, str, dict[str, Any]]:
        """(worker w's contribution, or None and why it is stale; its manifest)."""
        key = L.contribution(r, w)
        try:
            m = read_manifest(self.storage, key) or {}
        except CheckpointError as exc:  # an invalid manifest (core.manifest.check_manifest): refused
            return None, str(exc), {}
        want = jobs["workers"].get(str(w), {}).get("base_digest")
        if m.get("round") != r or m.get("worker") != w or (want and m.get("base_digest") != want):
            return None, (f"stale contribution: manifest says round {m.get('round')} worker {m.get('worker')} base "
                          f"{str(m.get('base_digest'))[:12]}, expected round {r} worker {w} base {str(want)[:12]}"), m
        weight = contribution_weight(m, self.cfg)
        if isinstance(weight, str):  # a manifest whose figures do not add up: refused like a bad file
            return None, f"worker {w} ({self.storage.display(key)}): {weight}", m
        return Contribution(w, key, weight), "", m

    def _stream(self, r: int, jobs: dict[str, Any]) -> None:
        """Fold each contribution into the round's running sum as it lands (round.stream_merge)."""
        if not self.cfg.round.stream_merge or self.cfg.algorithm == "lte":
            return
        if self._sum_round != r:
            self._sum = None  # the last round's copies go before this round's come
            # held in memory while the workers train: the outer step after the last fold reads nothing
            self._sum = RunningSum(self.storage, L.global_weights(r), state_key=L.outer_state(r) if r > 0 else None,
                                   preload=True)
            self._sum_round = r
        folded = {f.worker for f in self._sum.folded}
        for w in sorted(self._arrived(r) - folded):
            c, _, _ = self._contribution(r, jobs, w)
            if c is not None:  # a stale one is reported by the merge; a refused one is kept in _sum.rejected
                self._sum.add(c)
