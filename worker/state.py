"""A worker's own state on storage: which snapshot of its AdamW state (and error-feedback buffer) a
job starts from, each checked before it is used.

A state file or in-flight checkpoint is untrusted like any file in the run (a half-synced client, a
co-tenant, a bug): past the checkpoint format's own checks (core.checkpoint), every tensor must be
floating point and finite, AdamW's second moments and step counts non-negative, and the
error-feedback buffer within what rounds of training can leave (core.codec.max_update), since it is
sent with the next contribution. A file that fails is named, set aside under the worker's
`rejected/` folder with a `.reason.json`, and the job falls back to the previous snapshot, or to
fresh AdamW state, saying so: it never fails job after job on the same file.
"""
from __future__ import annotations

import contextlib
import logging
import math
import posixpath
import time

import torch

from core.checkpoint import load_checkpoint, read_manifest
from core.codec import check_bound
from core.errors import CheckpointError, StorageError
from core.layout import RunLayout, manifest_key
from core.storage import Storage
from worker.params import FEEDBACK, SEP

log = logging.getLogger(__name__)
L = RunLayout()


def check_state(tensors: dict[str, torch.Tensor], label: str, feedback_bound: float) -> None:
    """CheckpointError naming `label` and the tensor when a state file's tensors cannot be a worker's."""
    for key, t in tensors.items():
        if not t.is_floating_point():
            raise CheckpointError(f"{label}: tensor {key} is {t.dtype}, not floating point: a worker writes its "
                                  "AdamW state and error feedback in floating point; the file is damaged or forged")
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{label}: tensor {key} has NaN or Inf values: the file is damaged, or the "
                                  "training that wrote it diverged")
        slot = key.rpartition(SEP)[2] if SEP in key else ""
        if slot in ("exp_avg_sq", "step", "max_exp_avg_sq") and t.numel() and bool((t < 0).any()):
            raise CheckpointError(f"{label}: tensor {key} (AdamW's {slot}) has negative values: the file is damaged "
                                  "or forged")
        if key.startswith(FEEDBACK):
            check_bound(label, key, t, feedback_bound, what="(the error-feedback buffer) holds an entry of magnitude")


def set_aside(storage: Storage, key: str, why: str) -> str | None:
    """Move a refused state file (manifest first: unpublished before the file) to the worker's
    `rejected/` folder with a `.reason.json`; where it went, or None when it could not be moved
    (it is then left in place, and never read again by this job)."""
    folder, name = posixpath.split(key)
    stem = f"{name.removesuffix('.safetensors')}_{int(time.time() * 1000)}"
    dest = posixpath.join(folder, "rejected", stem + ".safetensors")
    try:
        with contextlib.suppress(FileNotFoundError):
            storage.move(manifest_key(key), manifest_key(dest))
        with contextlib.suppress(FileNotFoundError):
            storage.move(key, dest)
        storage.write_json(posixpath.join(folder, "rejected", stem + ".reason.json"), {"file": key, "reason": why,
                                                                                      "at": time.time()})
        return dest
    except (StorageError, OSError) as exc:
        log.warning("%s could not be set aside (%s); it is left in place", storage.display(key), exc)
        return None


def checked(storage: Storage, key: str, label: str, feedback_bound: float) -> dict[str, torch.Tensor] | None:
    """The tensors of the state file or in-flight checkpoint at `key`, checked (check_state); None
    when it has no manifest. One that fails is set aside, naming why, and its CheckpointError raised."""
    try:
        if read_manifest(storage, key, label) is None:
            return None
        tensors = load_checkpoint(storage, key, label)[0]
        check_state(tensors, label, feedback_bound)
        return tensors
    except CheckpointError as exc:
        where = set_aside(storage, key, str(exc))
        log.warning("%s; set aside%s", exc, f" to {storage.display(where)}" if where else " (left in place)")
        raise


def usable_state(storage: Storage, worker: int, before_round: int, feedback_bound: float = math.inf
                 ) -> tuple[str, dict[str, torch.Tensor]] | None:
    """This worker's newest optimizer-state snapshot before `before_round` that passes check_state,
    with its tensors; a damaged one is set aside (naming it and why) and the one before is tried.
    None: no usable snapshot, the job starts from fresh AdamW state (and says so when one was refused)."""
    rounds = {r for n in storage.list(L.worker_dir(worker)) if (r := L.parse_round(n, "state")) is not None}
    refused = 0
    for r in sorted((r for r in rounds if r < before_round), reverse=True):
        key = L.worker_state(worker, r)
        try:
            tensors = checked(storage, key, f"worker {worker} optimizer state {storage.display(key)}", feedback_bound)
        except CheckpointError:
            refused += 1
            continue
        if tensors is None:
            continue
        if refused:
            log.warning("worker %d: starting from its optimizer state of round %d, an older snapshot", worker, r)
        return key, tensors
    if refused:
        log.warning("worker %d: no usable optimizer-state snapshot is left: fresh AdamW state (and error feedback)",
                    worker)
    return None


def inflight_tensors(storage: Storage, key: str, label: str, base_digest: str, steps: int, bound: float
                     ) -> dict[str, torch.Tensor] | None:
    """The in-flight checkpoint's tensors when this round resumes from it (trained from this base,
    its figures a worker's, its tensors checked: check_state), else None; a damaged one is set aside."""
    try:
        m = read_manifest(storage, key, label)
    except CheckpointError as exc:
        m = {"damaged": str(exc)}
    if m is None or m.get("base_digest") != base_digest and "damaged" not in m:
        return None
    done = m.get("steps_done")
    if "damaged" in m or not (type(done) is int and 0 <= done <= steps):
        why = m.get("damaged") or f"{label}: its manifest's steps_done {done!r} is not a step of this round"
        set_aside(storage, key, why)
        log.warning("%s; set aside: the round starts again from its base", why)
        return None
    try:
        return checked(storage, key, label, bound)
    except CheckpointError:  # set aside, said: the round starts again from its base
        return None
