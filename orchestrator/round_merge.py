"""Merging a round: which contributions count and what they weigh, folding them as they land, the
merge itself (round_spec, then merge.rounds.merge_round), and the record that commits it.

Every contribution is untrusted: its weight is derived from what the service asked of its worker
(orchestrator.plan.contribution_weight), never taken from its manifest, and whatever goes wrong
while it is read or folded rejects it with the reason in the round's record; the file is moved to
the round's `rejected/` folder, and the round goes on.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

from core import codec, replay
from core.checkpoint import read_manifest
from core.config import Config
from core.outer import outer_at
from core.errors import CheckpointError, StorageError
from core.failpoints import failpoint
from core.layout import RunLayout, manifest_key
from merge.inputs import refusal
from merge.round_spec import Contribution, LteRule, MergeResult, QuorumError, RoundSpec
from merge.rounds import RunningSum, merge_round
from orchestrator import late
from orchestrator.executor import JobStatus
from orchestrator.plan import Decision, JobView, contribution_weight, dropped_workers
from core.records import RoundJobs, RoundRecord, number
from orchestrator.runstate import arrived_workers
from orchestrator.submission import UNKNOWN, Submitter

log = logging.getLogger(__name__)
L = RunLayout()


def round_spec(cfg: Config, r: int, metadata: Mapping[str, str], min_inputs: int) -> RoundSpec:
    """Round r's merge as the run's config says: global_r and the contributions in, global_{r+1}
    (and the outer state) out, with a quorum of `min_inputs`."""
    if cfg.algorithm == "lte":
        from worker.lora import contribution_shapes  # torch and the model code: only an LTE service needs them
        rule = LteRule(scale=cfg.lte.alpha / cfg.lte.rank, rank=cfg.lte.rank,
                       expected=contribution_shapes(cfg, cfg.lte.rank))
        return RoundSpec(base=L.global_weights(r), out=L.global_weights(r + 1), lte=rule, min_inputs=min_inputs,
                         metadata=metadata, manifest={"round": r + 1})
    return RoundSpec(base=L.global_weights(r), out=L.global_weights(r + 1), outer=outer_at(cfg.outer, r),
                     state_in=L.outer_state(r) if r > 0 else None, state_out=L.outer_state(r + 1),
                     min_inputs=min_inputs, aggregate=cfg.round.aggregate, trim=cfg.round.trim, metadata=metadata,
                     manifest={"round": r + 1})


class RoundMerger:
    def __init__(self, submitter: Submitter, metadata: dict[str, str]) -> None:
        self.submitter, self.metadata = submitter, metadata
        self.storage, self.cfg, self.executor = submitter.storage, submitter.cfg, submitter.executor
        # an outer merge is linear: contributions can be folded into a running sum as they land, and a
        # late one re-based onto a later round's global; LTE heads are relative to the base they trained on
        self.linear = self.cfg.algorithm != "lte"
        self.bound = codec.max_update(self.cfg)  # what an outer-gradient entry may be (LTE's merge has its own checks)
        self._sum: RunningSum | None = None  # round `_sum_round`'s contributions folded as they land
        self._sum_round = -1
        self.schedule = replay.of_run(self.storage, self.cfg)  # a replay sums in its source's order
        # (round, worker) -> the identity of the contribution's manifest and data when first read: a refused
        # one is set aside only if it is still the file there (a worker's valid one may land meanwhile)
        self._seen: dict[tuple[int, int], tuple] = {}
        self._since = time.time()  # the service's start, then its last commit: a round's time counts from it

    def stream(self, jobs: RoundJobs) -> None:
        """Fold each contribution into the round's running sum as it lands (round.stream_merge)."""
        r = jobs.round
        if not (self.cfg.round.stream_merge and self.linear):
            return
        if self._sum_round != r:
            self._sum = None  # the last round's copies go before this round's come
            # held in memory while the workers train: the outer step after the last fold reads nothing
            self._sum = RunningSum(self.storage, L.global_weights(r), state_key=L.outer_state(r) if r > 0 else None,
                                   preload=True)
            self._sum_round = r
        folded = {f.worker for f in self._sum.folded}
        for w in sorted(set(arrived_workers(self.storage, r)) - folded):
            c, _, _ = self._contribution(jobs, w)
            if c is not None:  # a stale one is reported by the merge; a refused one is kept in _sum.rejected
                self._sum.add(c)

    def merge(self, jobs: RoundJobs, decision: Decision, states: dict[str, JobStatus]) -> RoundRecord:
        """Merge what `decision` names into global_{r+1}; the record to commit (not written yet).
        Raises QuorumError (with the refused workers) when too few valid contributions remain."""
        r, t0 = jobs.round, time.time()
        stale, contribs, manifests = self._contributions(jobs, decision.workers)
        if self.schedule is not None:
            order = self.schedule.order[r]
            contribs.sort(key=lambda c: order.index(c.worker))
        fold = self.cfg.round.late_policy == "fold"  # never with lte (core.config_parse)
        folded, fold_refused = late.prepare_folds(self.storage, self.cfg, r) if fold else ([], [])
        try:
            result = self._merge(r, contribs + late.fold_inputs(folded, self.bound))
        except QuorumError as exc:
            exc.rejected = {w: why for w, why in {**exc.rejected, **stale}.items() if w >= 0}  # < 0: folds
            raise
        self._sum, self._sum_round = None, -1  # spent: it holds the mean now
        merged, on_time_rejected, merged_folds, refused = late.split_merged(result.merged, result.rejected, folded)
        rejected = {**stale, **on_time_rejected}
        if len(merged) < self.cfg.quorum:  # folds never make up a quorum: not committed, global_r+1 is redone
            raise QuorumError(f"only {len(merged)} on-time contribution(s) merged, the quorum is {self.cfg.quorum}",
                              rejected)
        views = {w: JobView(e.latest, (s := states.get(e.latest, UNKNOWN)).state, s.alive) for w, e in jobs.workers.items()}
        dropped = dropped_workers(self.cfg.workers, merged, list(rejected), views, runs_on=fold and r + 1 < self.cfg.rounds)
        if dropped.ended:
            self.submitter.record_losses(jobs, list(dropped.ended), states)
            jobs.save(self.storage)
        final = self.executor.status(list(jobs.latest().values()))  # one call: queue wait and run time per job
        self._cancel(r, list(dropped.cancel), fold)
        committed = time.time()
        return RoundRecord(
            round=r, merged=merged, dropped=list(dropped.workers), rejected=sorted(rejected),
            rejected_reasons={str(w): why for w, why in rejected.items()}, dropped_reasons=dropped.reasons,
            late=sorted(set(dropped.workers) & set(arrived_workers(self.storage, r))), reason=decision.reason,
            merge_seconds=round(result.seconds, 3), bytes_read=result.bytes_read,
            outer_grad_norm=number(result.outer_grad_norm), weights={str(c.worker): c.weight for c in contribs},
            submitted_at=jobs.submitted_at or t0, merge_started_at=t0, committed_at=committed,
            round_s=round(committed - self._since, 3),
            global_digest=result.manifest["digest"], merge_order=result.order,
            contrib_digest={str(w): manifests[w].get("digest") for w in merged}, folded=merged_folds,
            fold_rejected=fold_refused + refused, worker_idle_s=_per_worker(manifests, "waited_s"),
            worker_train_s=_per_worker(manifests, "seconds"),
            contribution_bytes={str(w): n for w in merged if (n := _count(manifests[w], "bytes")) is not None},
            fp32_bytes=next((n for w in merged if (n := _count(manifests[w], "fp32_bytes")) is not None), None),
            worker_read={str(w): n for w in merged if (n := _count(manifests[w], "io_read")) is not None},
            worker_written={str(w): n for w in merged if (n := _count(manifests[w], "io_written")) is not None},
            replayed=[w for w in merged if manifests[w].get("replica") is True],
            worker_state=worker_state(manifests, restart_only=self.cfg.round.worker_mode == "persistent"
                                      and self.cfg.algorithm != "lte"),
            jobs={str(w): {**final[j].as_dict(), "attempts": jobs.workers[w].attempts} for w, j in jobs.latest().items()})

    def commit(self, jobs: RoundJobs, record: RoundRecord) -> None:
        failpoint("service.before_record")
        record.save(self.storage)  # the commit point of the round
        self._since = record.committed_at
        failpoint("service.after_record")
        # after the commit: a resumed round finds them where the merge did
        self.set_aside(jobs, {int(w): why for w, why in record.rejected_reasons.items()})
        self._seen = {k: v for k, v in self._seen.items() if k[0] != jobs.round}

    def _merge(self, r: int, inputs: list[Contribution]) -> MergeResult:
        return merge_round(self.storage, round_spec(self.cfg, r, self.metadata, self.cfg.quorum), inputs,
                            self._sum if self._sum_round == r else None)

    def set_aside(self, jobs: RoundJobs, rejected: dict[int, str]) -> None:
        """Move refused contributions out of the round (kept as evidence) so their workers rerun; one
        that is no longer the file that was refused (a new one landed at its key) is left where it is."""
        r = jobs.round
        for w, why in rejected.items():
            e = jobs.workers[w]
            dest, src = L.rejected_contribution(r, w, e.attempts), L.contribution(r, w)
            seen = self._seen.pop((r, w), None)
            try:
                moved = self._move_refused(src, dest, seen)
                if moved:
                    self.storage.write_json(L.rejected_reason(r, w, e.attempts),
                                            {"worker": w, "reason": why, "job_id": e.latest, "at": time.time()})
            except (StorageError, CheckpointError, OSError) as exc:  # a link or a file at rejected/: refused too, never fatal
                e.failures.append({"job_id": e.latest, "rejected": why, "not_set_aside": self._drop_refused(src, seen, exc)})
                continue
            if not moved:
                log.warning("round %d worker %d: a new contribution landed after the refused one was read; it is left "
                            "in place, not set aside under the old one's reason", r, w)
                e.failures.append({"job_id": e.latest, "rejected": why, "left_in_place": "a new file landed at its "
                                   "key after the merge read the refused one: not set aside"})
                continue
            e.failures.append({"job_id": e.latest, "rejected": why})
        jobs.save(self.storage)

    def _drop_refused(self, src: str, seen: tuple | None, exc: Exception) -> str:
        """A refused contribution that cannot be set aside (what is at its `rejected/` folder is
        refused: a link, a file) is removed instead, if it is still the file the merge read, so that
        its worker runs again; what happened, for its jobs.json entry."""
        what = f"it could not be set aside ({exc})"
        try:
            if seen is None or self._identity(src) == seen:
                self.storage.remove(manifest_key(src))
                self.storage.remove(src)
                what += ", so it was removed"
        except (StorageError, CheckpointError, OSError) as again:
            what += f", nor removed ({again})"
        log.warning("%s: %s", self.storage.display(src), what)
        return what

    def _identity(self, key: str) -> tuple:
        return self.storage.identity(manifest_key(key)), self.storage.identity(key)

    def _move_refused(self, src: str, dest: str, seen: tuple | None) -> bool:
        """Move the refused contribution at `src` (manifest first: unpublished before the file) to
        `dest`, each file only if it is still the one the merge read (`seen`, its identities: a rename
        moves whatever is there, a FIFO too, without reading it); False when a new one landed."""
        for (a, b), ident in zip(((manifest_key(src), manifest_key(dest)), (src, dest)), seen or (None, None)):
            if seen is None:  # read before this service started: nothing to tell it from
                with contextlib.suppress(FileNotFoundError):
                    self.storage.move(a, b)
            elif not self.storage.move_if(a, b, ident):
                return False
        return True

    def _cancel(self, r: int, stragglers: list[str], fold: bool) -> None:
        """Cancel the stragglers' jobs; in the last round of a fold run, the late jobs still running
        too (no later merge can fold anything in)."""
        if fold and r + 1 >= self.cfg.rounds:
            stragglers += late.unfinished_late_jobs(self.storage, r, self.cfg.round.max_staleness)
        if stragglers:
            self.storage.check_fence(L.round_record(r))  # a service whose run was taken cancels nothing
        self.executor.cancel(stragglers)

    def _contributions(self, jobs: RoundJobs, workers: tuple[int, ...]
                       ) -> tuple[dict[int, str], list[Contribution], dict[int, dict[str, Any]]]:
        """(stale or invalid ones with why, contributions to merge, their manifests by worker)."""
        stale, out, manifests = {}, [], {}
        for w in sorted(workers):  # worker order: a merge of the same inputs sums them in the same order
            c, why, m = self._contribution(jobs, w)
            if c is None:
                stale[w] = why
                continue
            out.append(c)
            manifests[w] = m
        return stale, out, manifests

    def _contribution(self, jobs: RoundJobs, w: int) -> tuple[Contribution | None, str, dict[str, Any]]:
        """(worker w's contribution, or None and why it is stale or invalid; its manifest)."""
        r, key = jobs.round, L.contribution(jobs.round, w)
        label = f"worker {w} ({self.storage.display(key)})"
        self._seen.setdefault((r, w), self._identity(key))  # before anything of it is read
        m: dict[str, Any] = {}
        try:
            m = read_manifest(self.storage, key) or {}  # an invalid one (core.manifest.check_manifest): refused
            want = jobs.workers[w].base_digest if w in jobs.workers else None
            if m.get("round") != r or m.get("worker") != w or (want and m.get("base_digest") != want):
                raise CheckpointError(f"stale contribution: manifest says round {m.get('round')} worker "
                                      f"{m.get('worker')} base {str(m.get('base_digest'))[:12]}, expected round {r} "
                                      f"worker {w} base {str(want)[:12]}")
            weight = contribution_weight(m, self.cfg)
            if isinstance(weight, str):  # a manifest whose figures do not add up: refused like a bad file
                raise CheckpointError(f"{label}: {weight}")
        except CheckpointError as exc:
            return None, refusal(label, exc), m
        return Contribution(w, key, weight, self.bound), "", m


def worker_state(manifests: dict[int, dict[str, Any]], restart_only: bool) -> dict[str, str]:
    """Where a worker's AdamW state came from, where that is news: fresh state past round 0 (a hard
    loss, or no usable snapshot), snapshots refused, and (`restart_only`: persistent workers,
    whose state otherwise stays in memory) a restart from a snapshot. In the workers' words, checked."""
    out = {}
    for w, m in manifests.items():
        refused = m.get("state_refused_rounds")
        refused = [r for r in refused if type(r) is int][:8] if isinstance(refused, list) else []
        src = m.get("state_from_round")
        said = ("fresh AdamW state" if m.get("state_fresh") is True else
                f"its snapshot of round {src}" if type(src) is int and (restart_only or refused) else None)
        if said:
            out[str(w)] = said + (f" (refused: its snapshot{'s' if len(refused) > 1 else ''} of round "
                                  f"{', '.join(map(str, refused))})" if refused else "")
    return out


def _count(manifest: dict[str, Any], key: str) -> int | None:
    """A byte count a worker wrote in its manifest, if it is one (the manifest is a worker's word)."""
    v = manifest.get(key)
    return v if type(v) is int and 0 <= v < 1 << 62 else None


def _per_worker(manifests: dict[int, dict[str, Any]], key: str) -> dict[str, float]:
    """{worker: manifest[key]} for the manifests that have it (persistent workers' waits, for one)."""
    return {str(w): m[key] for w, m in manifests.items() if m.get(key) is not None}
