"""Rebuilding the outer optimizer state of a committed round when it is missing or damaged.

A round's merge writes `outer/state_{r+1}` beside the new global weights, before the round's record
commits it. Should it be gone or damaged afterwards (deleted by hand, a disk fault, a run begun by
an islands that wrote it after the record), it is rebuilt here: round r's merge is done again from what its
record names (the same contributions and late folds, with the same weights, summed in the
recorded order, from global_r and state_r), which gives the same bytes; the redone global must
hash to the published one, or nothing is written. Contributions and folds are never deleted from
the run directory, so the inputs are there.
"""
from __future__ import annotations

import dataclasses
import logging
import posixpath
from collections.abc import Mapping

from core.checkpoint import read_manifest
from core.config import Config
from core.errors import CheckpointError, RunError
from core.layout import RunLayout, manifest_key
from core.records import RoundRecord, recorded_inputs
from core.storage import Storage
from merge.round_spec import Contribution
from merge.rounds import merge_round
from orchestrator.round_merge import round_spec

log = logging.getLogger(__name__)
L = RunLayout()


def ensure_outer_state(storage: Storage, cfg: Config, r: int, metadata: Mapping[str, str]) -> None:
    """Make sure the outer state that round r's merge reads is on storage: rebuilt from round
    r-1's record when that round is committed and its state is missing or damaged."""
    if r == 0 or cfg.algorithm == "lte" or not storage.exists(L.round_record(r - 1)):
        return  # lte has none; an uncommitted round's merge is redone whole, state included
    try:
        if read_manifest(storage, L.outer_state(r)) is not None:
            return
        why = "is missing"
    except CheckpointError as exc:
        why = f"is damaged ({exc})"
    ensure_outer_state(storage, cfg, r - 1, metadata)
    log.warning("outer optimizer state %s %s: rebuilding it from round %d's merge inputs",
                storage.display(L.outer_state(r)), why, r - 1)
    rebuild_outer_state(storage, cfg, r - 1, metadata)


def rebuild_outer_state(storage: Storage, cfg: Config, r: int, metadata: Mapping[str, str]) -> None:
    """Write outer/state_{r+1} by doing committed round r's merge again (see the module's doc)."""
    target = storage.display(L.outer_state(r + 1))
    fix = (f"restore the round's files from a backup, or delete {storage.display(L.round_record(r))} so that "
           f"`orchestrate resume` merges round {r} again (its workers rerun if their contributions are gone)")
    try:
        loaded = RoundRecord.load(storage, r)
    except RunError as exc:  # it names the damaged field
        raise RunError(f"cannot rebuild {target}: {exc}; {fix}") from None
    record = loaded.to_json() if loaded else {}
    if not record:
        raise RunError(f"cannot rebuild {target}: round {r} has no record")
    try:
        inputs, problem = recorded_inputs(record)
        contribs = [Contribution(i.worker, i.key, i.weight) for i in inputs]
        changed = [w for w in record["merged"]
                   if (read_manifest(storage, L.contribution(r, w)) or {}).get("digest") != record["contrib_digest"][str(w)]]
        published = str(record["global_digest"])
    except (KeyError, TypeError, ValueError) as exc:  # a record not as the service writes it
        raise RunError(f"cannot rebuild {target}: {storage.display(L.round_record(r))} is damaged "
                       f"({type(exc).__name__}: {exc}); {fix}") from None
    if problem or changed:
        raise RunError(f"cannot rebuild {target}: " + (problem or f"the contributions of workers {changed} "
                       f"changed or disappeared since round {r} merged them") + f"; {fix}")
    if read_manifest(storage, L.global_weights(r + 1)) is None:  # a commit publishes the global before its record
        raise RunError(f"cannot rebuild {target}: round {r}'s record names {L.global_weights(r + 1)}, which is not there: "
                       f"the round was never committed (the record is forged or left from elsewhere); {fix}")
    scratch, scratch_state = L.rebuilt_global(r), L.rebuilt_state(r)
    try:
        try:
            spec = dataclasses.replace(round_spec(cfg, r, metadata, len(contribs)), out=scratch, state_out=scratch_state)
            result = merge_round(storage, spec, contribs)
        except (RunError, CheckpointError) as exc:
            raise RunError(f"cannot rebuild {target}: round {r}'s merge failed again: {exc}; {fix}") from None
        if result.rejected or result.manifest["digest"] != published:
            raise RunError(f"cannot rebuild {target}: round {r}'s merge done again does not give the published "
                           f"{storage.display(L.global_weights(r + 1))} (digest {result.manifest['digest'][:12]}, "
                           f"recorded {published[:12]}; refused {result.rejected or 'none'}); {fix}")
        manifest = read_manifest(storage, scratch_state)
        storage.move(scratch_state, L.outer_state(r + 1))
        storage.write_json(manifest_key(L.outer_state(r + 1)), {**(manifest or {}), "file": posixpath.basename(
            L.outer_state(r + 1))})  # the manifest last: the state is whole from here on
    finally:
        storage.remove(L.rebuild_dir(r), recursive=True)
    log.info("outer optimizer state %s rebuilt from round %d's inputs", target, r)
