"""The streaming merge of one round: K contributions + the global weights -> the next global.

Tensor by tensor, in file order: read the same-named tensor from every contribution, check it is
finite, merge it (a registered method; `average` for DiLoCo and lo-fi), apply the outer step, and
write the result straight into the output file. Headers are validated before any maths (names,
shapes, dtypes against the global weights), and every input's sha256 is checked as its bytes
stream past. A bad contribution is rejected with a reason and the merge starts again without it;
the output is published only when the whole merge succeeded, so nothing half-merged is ever seen.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from core.checkpoint import LazyCheckpoint, open_checkpoint, write_checkpoint
from core.config import OuterConfig
from core.errors import CheckpointError, ContributionRejected, RunError
from core.storage import Storage
from merge.methods import get_method
from merge.outer import outer_step, split_state, state_key

log = logging.getLogger(__name__)


class QuorumError(RunError):
    """Too few valid contributions remain; `rejected` says which were refused and why."""

    def __init__(self, message: str, rejected: dict[int, str]) -> None:
        super().__init__(message)
        self.rejected = rejected


@dataclass(frozen=True)
class Contribution:
    worker: int
    key: str
    weight: float


@dataclass
class MergeResult:
    merged: list[int]
    rejected: dict[int, str]
    bytes_read: int
    seconds: float
    outer_grad_norm: float
    manifest: dict[str, Any] = field(default_factory=dict)


def check_header(base: LazyCheckpoint, ck: LazyCheckpoint) -> str | None:
    """Why `ck` cannot be merged into `base` (names, shapes, dtypes), or None if it can."""
    missing = [n for n in base.specs if n not in ck.specs]
    extra = [n for n in ck.specs if n not in base.specs]
    if missing or extra:
        return f"tensor names differ from the global weights: missing {missing[:5]}, unexpected {extra[:5]}"
    for name, spec in base.specs.items():
        other = ck.specs[name]
        if other.shape != spec.shape or other.dtype != spec.dtype:
            return f"tensor {name} is {other.dtype}{list(other.shape)}, the global weights have {spec.dtype}{list(spec.shape)}"
    return None


def merge_round(
    storage: Storage,
    base_key: str,
    contributions: Sequence[Contribution],
    out_key: str,
    outer: OuterConfig,
    *,
    state_in_key: str | None,
    state_out_key: str | None,
    min_inputs: int = 1,
    method: str = "average",
    metadata: Mapping[str, str] | None = None,
    manifest: Mapping[str, Any] | None = None,
) -> MergeResult:
    """Merge `contributions` into the weights at `base_key`; write `out_key` (and the outer state).

    Rejected contributions are reported in the result, not raised; RunError if fewer than
    `min_inputs` valid ones remain.
    """
    t0 = time.perf_counter()
    rejected: dict[int, str] = {}
    live = list(contributions)
    while True:
        if len(live) < min_inputs:
            raise QuorumError(f"only {len(live)} valid contribution(s) for {out_key}, the quorum is {min_inputs}; "
                              f"rejected: {rejected or 'none'}", rejected)
        try:
            stats = _merge_once(storage, base_key, live, out_key, outer, state_in_key, state_out_key,
                                method, metadata, manifest)
        except ContributionRejected as exc:
            log.warning("merge: rejected worker %d: %s", exc.worker, exc.reason)
            rejected[exc.worker] = exc.reason
            live = [c for c in live if c.worker != exc.worker]
            continue
        return MergeResult(merged=[c.worker for c in live], rejected=rejected, bytes_read=stats["bytes_read"],
                           seconds=time.perf_counter() - t0, outer_grad_norm=stats["outer_grad_norm"],
                           manifest=stats["manifest"])


def _open_inputs(storage: Storage, live: Sequence[Contribution], base: LazyCheckpoint) -> list[LazyCheckpoint]:
    opened: list[LazyCheckpoint] = []
    try:
        for c in live:
            try:
                ck = open_checkpoint(storage, c.key, label=f"worker {c.worker} ({storage.display(c.key)})")
            except CheckpointError as exc:
                raise ContributionRejected(c.worker, str(exc)) from None
            opened.append(ck)
            problem = check_header(base, ck)
            if problem:
                raise ContributionRejected(c.worker, problem)
        return opened
    except BaseException:
        for ck in opened:
            ck.close()
        raise


def _merge_once(storage, base_key, live, out_key, outer, state_in_key, state_out_key, method, metadata, manifest):
    merge_fn = get_method(method)
    weights = [c.weight for c in live]
    with open_checkpoint(storage, base_key, label=f"global weights {storage.display(base_key)}") as base:
        inputs = _open_inputs(storage, live, base)
        try:
            state_in = _load_state(storage, state_in_key)
            new_state: dict[str, torch.Tensor] = {}
            sq = [0.0]

            def stream() -> Iterator[tuple[str, torch.Tensor]]:
                for name, spec in base.specs.items():
                    tensors = [_finite(ck, c.worker, name) for ck, c in zip(inputs, live)]
                    merged = merge_fn(tensors, weights)
                    new, st, grad = outer_step(base.get(name), merged, state_in.get(name, {}), outer)
                    sq[0] += float(grad.double().pow(2).sum())
                    for slot, t in st.items():
                        new_state[state_key(name, slot)] = t
                    yield name, new
                for ck, c in zip(inputs, live):  # every byte has streamed past: check the hashes
                    try:
                        ck.verify()
                    except CheckpointError as exc:
                        raise ContributionRejected(c.worker, str(exc)) from None
                base.verify()

            specs = [(n, s.dtype, s.shape, s.nbytes) for n, s in base.specs.items()]
            out_manifest = write_checkpoint(storage, out_key, specs=specs, stream=stream, metadata=metadata,
                                            manifest=manifest)
            if state_out_key is not None:
                write_checkpoint(storage, state_out_key, new_state, manifest={"optimizer": outer.optimizer})
            return {"bytes_read": sum(ck.size for ck in inputs), "outer_grad_norm": sq[0] ** 0.5,
                    "manifest": out_manifest}
        finally:
            for ck in inputs:
                ck.close()


def _finite(ck: LazyCheckpoint, worker: int, name: str) -> torch.Tensor:
    t = ck.get(name)
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ContributionRejected(worker, f"tensor {name} has NaN or Inf values")
    return t


def _load_state(storage: Storage, key: str | None) -> dict[str, dict[str, torch.Tensor]]:
    if key is None:  # the first outer step: the optimizer starts from zero state
        return {}
    with open_checkpoint(storage, key, label=f"outer optimizer state {storage.display(key)}") as ck:
        return split_state(ck.load_all(verify=True))
