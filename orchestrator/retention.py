"""What a run keeps: after each commit, the tensors of committed rounds that nothing needs any more
are deleted, so that a run's footprint is flat in rounds (round.keep_last, round.keep_every).

Kept, once round r is committed (the service's next round is r+1):
- every record, jobs file and manifest (small; the replay and `status` read them), the final model,
  the evidence in rejected/ folders;
- global_r+1 and its outer state (where round r+1 starts), global_r, outer state r and round r's
  contributions and folds (what `resume` needs to rebuild a lost outer state r+1 by redoing round
  r's merge, and the bases of round r's late workers under late_policy continue); with keep_last
  N, the last N committed rounds' tensors;
- round.late_policy fold: the contributions of the rounds a later merge may still fold in
  (round.max_staleness);
- round 0's global, the run's base (its initial model: `orchestrate merge --base RUN` names it);
- with keep_every N, every N-th global.
The rest goes: the tensors of older globals, outer states, contributions and re-based folds. A
worker keeps its own newest optimizer-state snapshot (worker/publish.py). Deletion goes through the
service's storage (core.storage: by name inside the run's folders, never through a link, fenced: a
service whose run was taken deletes nothing).
"""
from __future__ import annotations

import logging
import posixpath

from core.config import Config
from core.layout import RunLayout
from core.storage import Storage

log = logging.getLogger(__name__)
L = RunLayout()


def _windows(cfg: Config, committed: int) -> tuple[int, int]:
    """(the oldest committed round whose global, state and contributions stay; the oldest whose
    contributions and global stay: older under late_policy fold, whose later merges re-base a late
    contribution of those rounds onto its own base, that round's global)."""
    rc = cfg.round
    oldest = committed - rc.keep_last + 1
    return oldest, oldest if rc.late_policy != "fold" else min(oldest, committed + 1 - rc.max_staleness)


def doomed(cfg: Config, committed: int, first: int = 0) -> list[tuple[str, int]]:
    """(what, round) of the tensors to delete once round `committed` is: 'global', 'state',
    'contrib' or 'folded' of a round in [first, ...) (what earlier commits deleted is not asked for
    again). Pure: the plan, from the config alone."""
    rc = cfg.round
    if rc.keep_last <= 0:
        return []
    oldest, contrib_oldest = _windows(cfg, committed)
    # round 0's global is the run's base, kept: task vectors (TIES, task arithmetic) are taken against it
    out = [("global", q) for q in range(max(first, 1), contrib_oldest) if not (rc.keep_every and q % rc.keep_every == 0)]
    out += [("state", q) for q in range(max(first, 1), oldest)]
    out += [(what, q) for q in range(first, max(contrib_oldest, 0)) for what in ("contrib", "folded")]
    return out


def kept_from(cfg: Config, committed: int) -> int:
    """The first round a later prune needs to look at: everything before it is dealt with."""
    return max(0, _windows(cfg, committed)[1])


def prune(storage: Storage, cfg: Config, committed: int, first: int = 0) -> int:
    """Delete what `doomed` names that is still there; the bytes freed. A file that cannot be
    deleted (a link or a folder where a file is due) is logged and left: retention never stops a run."""
    freed = 0
    for what, q in doomed(cfg, committed, first):
        try:
            keys = _keys(storage, what, q)
        except Exception as exc:  # noqa: BLE001 - a folder that cannot be listed: left, the run goes on
            log.warning("retention: round %d's %s not listed (%s)", q, what, exc)
            continue
        for key in keys:
            try:
                size = storage.size(key)
                storage.remove(key)
                freed += size
            except FileNotFoundError:
                continue
            except Exception as exc:  # noqa: BLE001 - whatever is in the way, the run goes on
                log.warning("retention: %s not deleted (%s)", storage.display(key), exc)
    if freed:
        log.info("retention after round %d: %.1f MB of older rounds' tensors deleted", committed, freed / 1e6)
    return freed


def _keys(storage: Storage, what: str, q: int) -> list[str]:
    """The tensor files of `what` in round q (manifests stay: a record of what was there)."""
    if what == "global":
        return [L.global_weights(q)]
    if what == "state":
        return [L.outer_state(q)]
    folder = L.contributions_dir(q) if what == "contrib" else posixpath.join(L.round_dir(q), "folded")
    return [f"{folder}/{n}" for n in storage.list(folder) if n.endswith(".safetensors")]
