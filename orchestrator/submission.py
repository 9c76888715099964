"""Putting a round's workers on the scheduler: what each starts from, new jobs or persistent ones
adopted, resubmissions of lost ones, and the record of each loss."""
from __future__ import annotations

import logging
import os
import re
import time

from core.checkpoint import read_manifest
from core.config import Config
from core.layout import RunLayout
from core.storage import Storage
from core.assignment import Assignment
from orchestrator.executor import Executor, JobStatus
from orchestrator.plan import next_bases
from core.errors import RunError
from core.records import JOBS_FIX, JobEntry, RoundJobs, RoundRecord, text

log = logging.getLogger(__name__)
L = RunLayout()
UNKNOWN = JobStatus("?", "UNKNOWN")  # not polled yet: assume alive


class Submitter:
    def __init__(self, storage: Storage, cfg: Config, executor: Executor) -> None:
        self.storage, self.cfg, self.executor = storage, cfg, executor
        self._jobs: dict[int, RoundJobs] = {}  # what this service saved: a file planted since is not read back

    def jobs(self, r: int) -> RoundJobs:
        """Round r's jobs as this service keeps them, else from its jobs file, checked. A damaged
        or planted file is set aside with a warning and the round's jobs start over (its
        persistent workers, finding other job ids, stop)."""
        if (jobs := self._jobs.get(r)) is None:
            try:
                jobs = RoundJobs.load(self.storage, r)
            except RunError as exc:
                aside = f"{L.round_jobs(r)}.rejected-{int(time.time() * 1000)}"
                self.storage.move(L.round_jobs(r), aside)
                log.warning("round %d: %s. Set aside to %s; the round's jobs are submitted again", r,
                            str(exc).removesuffix(JOBS_FIX), self.storage.display(aside))
                jobs = RoundJobs(r)
            self._jobs = {k: v for k, v in self._jobs.items() if k >= r - 1}
            self._jobs[r] = jobs
        return jobs

    def ensure(self, r: int) -> RoundJobs:
        """Round r's jobs, submitting them first if that has not been done."""
        jobs = self.jobs(r)
        if not jobs.workers:
            bases = self._bases(r)
            adopted = self._adopt_persistent(jobs, bases)
            todo = [w for w in range(self.cfg.workers) if w not in adopted]
            if todo:
                self.submit(jobs, todo, bases)
            else:
                jobs.save(self.storage)
        return jobs

    def submit(self, jobs: RoundJobs, workers: list[int], bases: dict[int, str]) -> None:
        persistent = self.cfg.round.worker_mode == "persistent"
        digests = self._digests({bases[w] for w in workers})
        tasks = []
        for w in workers:
            e = jobs.workers.setdefault(w, JobEntry())
            e.base, e.base_digest, e.persistent = bases[w], digests[bases[w]], persistent
            tasks.append(Assignment(self.storage.url, jobs.round, w, e.base, attempt=e.attempts, threads=self._threads(),
                                    persistent=persistent))
        self.storage.check_fence(L.round_jobs(jobs.round))  # a service whose run was taken submits nothing
        ids = self.executor.submit(tasks)
        now = time.time()
        for w, job_id in zip(workers, ids):
            e = jobs.workers[w]
            e.attempts += 1
            e.job_ids.append(job_id)
            e.submitted_at = now
        jobs.submitted_at = jobs.submitted_at or now
        jobs.sbatch_calls += 1
        jobs.save(self.storage)
        log.info("round %d: submitted workers %s as jobs %s", jobs.round, workers, ids)

    def resubmit(self, jobs: RoundJobs, workers: tuple[int, ...], states: dict[str, JobStatus]) -> None:
        self.record_losses(jobs, workers, states)
        self.submit(jobs, list(workers), {w: jobs.workers[w].base for w in workers})

    def record_losses(self, jobs: RoundJobs, workers: tuple[int, ...] | list[int], states: dict[str, JobStatus]) -> None:
        """Note each worker's latest job as ended without a contribution, with its log's tail."""
        for w in workers:
            e = jobs.workers[w]
            state = states.get(e.latest, UNKNOWN).state
            e.failures.append({"job_id": e.latest, "state": state, "log_tail": self.executor.stderr_tail(e.latest)[-2000:]})
            level = logging.INFO if self.executor.cancelled_here(e.latest) else logging.WARNING  # the user's own stop
            log.log(level, "round %d: worker %s job %s ended (%s) without a contribution", jobs.round, w, e.latest, state)

    @staticmethod
    def errors(jobs: RoundJobs) -> str:
        """Why the round's workers failed, each in the words of its job's last error (a task's NaN
        loss, an import error): what status and failed.json say, not only the job logs."""
        said: dict[str, list[int]] = {}
        for w, e in sorted(jobs.workers.items()):
            tail = next((f["log_tail"] for f in reversed(e.failures) if isinstance(f.get("log_tail"), str)), "")
            line = job_error(tail)
            if line:
                said.setdefault(line, []).append(w)
        return "".join(f"; worker{'s' if len(ws) > 1 else ''} {', '.join(map(str, ws))}: {line}" for line, ws in said.items())

    def _adopt_persistent(self, jobs: RoundJobs, bases: dict[int, str]) -> list[int]:
        """Hand round r to persistent jobs of round r-1 that are still alive: no sbatch, no queue."""
        r = jobs.round
        if self.cfg.round.worker_mode != "persistent" or r == 0:
            return []
        latest = self.jobs(r - 1).latest()
        states = self.executor.status(list(latest.values()))
        adopted = [w for w, j in latest.items() if states[j].alive]
        digests = self._digests({bases[w] for w in adopted})
        now = time.time()
        for w in adopted:
            jobs.workers[w] = JobEntry(1, [latest[w]], bases[w], digests[bases[w]], True, now)
        jobs.submitted_at = jobs.submitted_at or now
        return adopted

    def _bases(self, r: int) -> dict[int, str]:
        if r == 0:
            return {w: L.global_weights(0) for w in range(self.cfg.workers)}
        prev = RoundRecord.load(self.storage, r - 1)
        late_keys = {w: L.contribution(r - 1, w) for w in (prev.late if prev else [])}
        # lte: a contribution holds heads, not weights to continue from: every worker takes the new base
        policy = "restart" if self.cfg.algorithm == "lte" else self.cfg.round.late_policy
        return next_bases(self.cfg.workers, prev.merged if prev else [], late_keys, policy, L.global_weights(r))

    def _digests(self, keys: set[str]) -> dict[str, str]:
        """digest of each distinct base checkpoint: K workers mostly share one, read its manifest once."""
        return {k: read_manifest(self.storage, k)["digest"] for k in keys}

    def _threads(self) -> int:
        if self.cfg.inner.threads:
            return self.cfg.inner.threads
        if self.executor.kind == "inline":  # one thread each: torch's thread count is the process's (orchestrator/inline.py)
            return 1
        if self.executor.here:  # K processes share this machine's cores
            return max(1, (os.cpu_count() or 1) // self.cfg.workers)
        return self.cfg.executor.cpus_per_task


_ERROR_LINE = re.compile(r"(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit)\w*): (.+)")


def job_error(tail: str) -> str | None:
    """The last `SomeError: message` line of a job's log (a traceback's last line), fit for a terminal."""
    for line in reversed(tail.splitlines()):
        m = _ERROR_LINE.fullmatch(line.strip())
        if m:
            return text(f"{m.group(1)}: {m.group(2)}", 500)
    return None
