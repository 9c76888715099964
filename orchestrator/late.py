"""Late contributions under `round.late_policy: fold`: find them, check them, make them merge inputs.

A worker that missed round q's deadline keeps training (its job is not cancelled) and publishes
its round-q contribution later. Its pseudo-gradient is relative to ITS base B (global_q), not to
the global weights G_r of the round r > q that folds it in: it enters as the virtual input
V = G_r + (W - B) (merge.late.rebase, which says why), with weight w * staleness_decay ** (r - q).
V is written to rounds/r/folded/ (kept: a replay of the run's merges reads it, or rebuilds it from
W, B and G_r bit for bit) and checked before the merge (names, shapes, dtypes, finite values,
digest of all three files), so the engine does not reject it.
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

from core.checkpoint import read_manifest
from core.config import Config
from core.errors import CheckpointError, ContributionRejected, RunError
from core.layout import RunLayout
from core.records import JOBS_FIX, RoundJobs, RoundRecord
from core.storage import Storage
from merge.late import rebase
from merge.rounds import Contribution
from orchestrator.plan import Fold, contribution_weight, fold_plan
from orchestrator.runstate import arrived_workers

log = logging.getLogger(__name__)
L = RunLayout()


@dataclass(frozen=True)
class Folded:
    worker: int
    from_round: int
    staleness: int
    weight: float
    """Its usual weight (tokens or 1) x staleness_decay ** staleness."""
    key: str
    """The virtual input V = G_r + (W - B) the merge reads."""
    source: str
    """W: the late contribution itself."""
    base: str
    """B: the checkpoint the late contribution was trained from."""
    source_digest: str
    """digest of W as merged: a replay checks it finds the same bytes."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def late_window(storage: Storage, r: int, max_staleness: int) -> tuple[dict[int, list[int]], set[tuple[int, int]]]:
    """(round -> workers published there but not merged or rejected, (round, worker) already
    folded or refused a fold) over the rounds a merge of round r may still fold from."""
    unmerged: dict[int, list[int]] = {}
    done: set[tuple[int, int]] = set()
    for q in range(max(0, r - max_staleness), r):
        rec = RoundRecord.load(storage, q)
        for f in [*rec.folded, *rec.fold_rejected] if rec else []:
            done.add((int(f["from_round"]), int(f["worker"])))
        taken = set(rec.merged + rec.rejected) if rec else set()
        unmerged[q] = [w for w in arrived_workers(storage, q) if w not in taken]
    return unmerged, done


def prepare_folds(storage: Storage, cfg: Config, r: int) -> tuple[list[Folded], list[dict[str, Any]]]:
    """The late contributions the merge of round r folds in (virtual inputs written), and those
    refused with the reason (each fold is attempted once: a refused one is recorded, never retried)."""
    unmerged, done = late_window(storage, r, cfg.round.max_staleness)
    plan = fold_plan(r, unmerged, done, decay=cfg.round.staleness_decay, max_staleness=cfg.round.max_staleness)
    folded, refused = [], []
    for f in plan:
        try:
            folded.append(_fold_one(storage, cfg, r, f))
        except ContributionRejected as exc:
            log.warning("round %d: late contribution of worker %d from round %d not folded: %s", r, f.worker,
                        f.from_round, exc.reason)
            refused.append({"worker": f.worker, "from_round": f.from_round, "reason": exc.reason})
    return folded, refused


def _fold_one(storage: Storage, cfg: Config, r: int, f: Fold) -> Folded:
    src = L.contribution(f.from_round, f.worker)
    try:
        m = read_manifest(storage, src) or {}
    except CheckpointError as exc:
        raise ContributionRejected(f.worker, str(exc)) from None
    try:
        entry = RoundJobs.load(storage, f.from_round).workers.get(f.worker)
    except RunError as exc:  # a damaged or planted jobs file: this input is refused, the round goes on
        raise ContributionRejected(f.worker, str(exc).removesuffix(JOBS_FIX)) from None
    base, want = (entry.base, entry.base_digest) if entry else (None, None)
    if m.get("round") != f.from_round or m.get("worker") != f.worker or not base or m.get("base_digest") != want:
        raise ContributionRejected(f.worker, f"stale late contribution: manifest says round {m.get('round')} worker "
                                             f"{m.get('worker')} base {str(m.get('base_digest'))[:12]}, expected round "
                                             f"{f.from_round} worker {f.worker} base {str(want)[:12]}")
    weight = contribution_weight(m, cfg)
    if isinstance(weight, str):
        raise ContributionRejected(f.worker, f"late contribution {storage.display(src)}: {weight}")
    out = L.folded_contribution(r, f.worker, f.from_round)
    try:
        rebase(storage, L.global_weights(r), src, base, out,
               manifest={"round": r, "worker": f.worker, "from_round": f.from_round, "source_digest": m["digest"]})
    except Exception as exc:  # noqa: BLE001 - whatever a bad file does, it is one rejection
        raise ContributionRejected(f.worker, str(exc) if isinstance(exc, CheckpointError) else
                                   f"{storage.display(src)}: {type(exc).__name__}: {exc}") from None
    return Folded(f.worker, f.from_round, f.staleness, weight * f.factor, out, src, base, m["digest"])


def unfinished_late_jobs(storage: Storage, r: int, max_staleness: int) -> list[str]:
    """Jobs of earlier rounds still owing a late contribution: at the last round nothing can fold
    them any more, so the service cancels them."""
    unmerged, _ = late_window(storage, r, max_staleness)
    ids = []
    for q in range(max(0, r - max_staleness), r):
        rec = RoundRecord.load(storage, q)
        owing = [w for w in (rec.dropped if rec else []) if w not in unmerged.get(q, [])]
        if owing:
            try:
                jobs = RoundJobs.load(storage, q).workers
            except RunError as exc:
                log.warning("round %d: its late jobs are not cancelled: %s", q, exc)
                continue
            ids += [jobs[w].latest for w in owing if w in jobs]
    return ids


def fold_inputs(folded: list[Folded], bound: float = math.inf) -> list[Contribution]:
    """The folded inputs as merge contributions. They carry negative ids (-1, -2, ...) so that the
    engine's per-input bookkeeping never confuses one with the same worker's on-time contribution.
    `bound`: core.codec.max_update, as for on-time ones (a re-based input moves the global by the
    late worker's own training)."""
    return [Contribution(-(i + 1), f.key, f.weight, bound) for i, f in enumerate(folded)]


def split_merged(merged: list[int], rejected: dict[int, str], folded: list[Folded]
                 ) -> tuple[list[int], dict[int, str], list[dict[str, Any]], list[dict[str, Any]]]:
    """(on-time workers merged, on-time rejected, folds merged, folds refused) from a merge result.
    A merged fold keeps its input id (`id`, as in the merge's order) for a replay of the merge."""
    merged_folds = [{**f.as_dict(), "id": -(i + 1)} for i, f in enumerate(folded) if -(i + 1) in merged]
    refused = [{"worker": f.worker, "from_round": f.from_round, "reason": rejected[-(i + 1)]}
               for i, f in enumerate(folded) if -(i + 1) in rejected]
    return ([w for w in merged if w >= 0], {w: why for w, why in rejected.items() if w >= 0}, merged_folds, refused)
