"""A worker's own state on storage: which snapshot of its AdamW state (and error-feedback buffer) a
job starts from, each checked before it is used.

A state file or in-flight checkpoint is untrusted like any file in the run (a half-synced client, a
co-tenant, a bug): past the checkpoint format's own checks (core.checkpoint), every tensor must be
floating point and finite, AdamW's second moments and step counts non-negative, and the
error-feedback buffer within what rounds of training can leave (core.codec.max_update), since it is
sent with the next contribution. A file that fails is named, set aside under the worker's
`rejected/` folder with a `.reason.json`, and the job falls back to the previous snapshot, or to
fresh AdamW state, saying so: it never fails job after job on the same file.

A sharded worker's snapshot is a set of rank files (core/shards.py): each rank reads and checks the
rows it holds, the ranks agree on one verdict (one rank's problem is every rank's), and rank 0 sets
the whole set aside.
"""
from __future__ import annotations

import contextlib
import logging
import math
import posixpath
import time
from dataclasses import dataclass, field

import torch

from core.checkpoint import read_manifest
from core.codec import check_bound
from core.errors import CheckpointError, StorageError
from core.layout import SAFETENSORS, RunLayout
from core.shards import Want, checkpoint_files, read_checkpoint
from core.storage import Storage
from worker.ranks import SOLO, Ranks

log = logging.getLogger(__name__)
L = RunLayout()
SEP = "::"  # optimizer state keys are `param<SEP>slot`
FEEDBACK = "error_feedback/"  # round.codec topk: the error-feedback buffer's keys are `FEEDBACK<param>`


@dataclass(frozen=True)
class Reader:
    """What this rank reads of a state file or in-flight checkpoint, and which ranks agree on it."""

    ranks: Ranks = SOLO
    want: Want | None = field(default=None, compare=False)
    """Which tensors, whole or which rows (core.shards.Want); None: all of them, whole."""


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
    """Move a refused state file or set of rank files (manifest first: unpublished before the data)
    to the worker's `rejected/` folder with a `.reason.json`; where it went, or None when it could
    not be moved (it is then left in place, and never read again by this job)."""
    folder, name = posixpath.split(key)
    stem = name.removesuffix(SAFETENSORS)
    tag = f"{stem}_{int(time.time() * 1000)}"
    dest = posixpath.join(folder, "rejected", tag + SAFETENSORS)
    try:
        for k in checkpoint_files(storage, key):
            with contextlib.suppress(FileNotFoundError):
                storage.move(k, posixpath.join(folder, "rejected", tag + posixpath.basename(k)[len(stem):]))
        storage.write_json(posixpath.join(folder, "rejected", tag + ".reason.json"), {"file": key, "reason": why,
                                                                                     "at": time.time()})
        return dest
    except (StorageError, OSError) as exc:
        log.warning("%s could not be set aside (%s); it is left in place", storage.display(key), exc)
        return None


def checked(storage: Storage, key: str, label: str, feedback_bound: float, reader: Reader = Reader()
            ) -> dict[str, torch.Tensor] | None:
    """What `reader` reads of the state file or in-flight checkpoint at `key`, checked
    (check_state); None when it has no manifest. One that fails on any rank is set aside, naming
    why, and its CheckpointError raised on every rank."""
    ranks, problem, tensors, present = reader.ranks, None, None, False
    try:
        manifest = read_manifest(storage, key, label)
        present = manifest is not None
        if present:
            tensors = read_checkpoint(storage, key, label, reader.want, prefer=ranks.rank, manifest=manifest)
            check_state(tensors, label, feedback_bound)
    except CheckpointError as exc:
        problem = str(exc)
    if (problem := ranks.first(problem)) is not None:
        where = set_aside(storage, key, problem) if ranks.lead else None
        log.warning("%s; set aside%s", problem, f" to {storage.display(where)}" if where else "")
        raise CheckpointError(problem)
    return tensors if not ranks.any(not present) else None


def usable_state(storage: Storage, worker: int, before_round: int, feedback_bound: float = math.inf,
                 reader: Reader = Reader()) -> tuple[str, dict[str, torch.Tensor]] | None:
    """This worker's newest optimizer-state snapshot before `before_round` that passes check_state,
    with its tensors; a damaged one is set aside (naming it and why) and the one before is tried.
    None: no usable snapshot, the job starts from fresh AdamW state (and says so when one was refused)."""
    ranks = reader.ranks
    rounds = ranks.lead_says(sorted({r for n in storage.list(L.worker_dir(worker)) if (r := L.parse_state(n)) is not None})
                             if ranks.lead else None)
    refused = 0
    for r in sorted((r for r in rounds if r < before_round), reverse=True):
        key = L.worker_state(worker, r)
        try:
            tensors = checked(storage, key, f"worker {worker} optimizer state {storage.display(key)}", feedback_bound,
                              reader)
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


def inflight_tensors(storage: Storage, key: str, label: str, base_digest: str, steps: int, bound: float,
                     reader: Reader = Reader()) -> dict[str, torch.Tensor] | None:
    """What `reader` reads of the in-flight checkpoint when this round resumes from it (trained from
    this base, its figures a worker's, its tensors checked: check_state), else None; a damaged one
    is set aside. Rank 0 reads the manifest and decides for every rank."""
    go = None
    if reader.ranks.lead:
        try:
            m = read_manifest(storage, key, label)
        except CheckpointError as exc:
            m = {"damaged": str(exc)}
        done = None if m is None else m.get("steps_done")
        if m is None or m.get("base_digest") != base_digest and "damaged" not in m:
            go = False
        elif "damaged" in m or not (type(done) is int and 0 <= done <= steps):
            why = m.get("damaged") or f"{label}: its manifest's steps_done {done!r} is not a step of this round"
            set_aside(storage, key, why)
            log.warning("%s; set aside: the round starts again from its base", why)
            go = False
        else:
            go = True
    if not reader.ranks.lead_says(go):
        return None
    try:
        return checked(storage, key, label, bound, reader)
    except CheckpointError:  # set aside, said: the round starts again from its base
        return None
