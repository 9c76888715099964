"""Re-basing a late contribution onto the global weights of the round that folds it in.

A worker's contribution W to round q was trained from its base B (global_q): its pseudo-gradient is
delta = B - W. A later round r merges relative to G_r: the merge computes the outer gradient as
G_r - weighted_mean(inputs), so the late contribution enters as the virtual input V = G_r + (W - B),
whose own term G_r - V is exactly delta. Which contributions are late, and what they weigh, is the
service's business (orchestrator.late).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from core.checkpoint import FLOATS, TensorFile, open_checkpoint
from core.checkpoint_writer import write_checkpoint
from core.errors import CheckpointError
from core.storage import Storage
from merge.inputs import compare_specs, finite, nonfinite
from merge.reading import read_tensors


def rebase(storage: Storage, global_key: str, source_key: str, base_key: str, out_key: str,
           manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write V = G + (W - B) tensor by tensor (fp32 maths, stored in G's dtypes); non-float tensors
    are G's. Raises CheckpointError if the three do not match or a value is not finite."""
    with contextlib.ExitStack() as opened:
        g = opened.enter_context(open_checkpoint(storage, global_key, f"global weights {storage.display(global_key)}"))
        w = opened.enter_context(open_checkpoint(storage, source_key, f"late contribution {storage.display(source_key)}"))
        b = opened.enter_context(open_checkpoint(storage, base_key, f"its base {storage.display(base_key)}"))
        problems = compare_specs(g.specs, w.specs, "the global weights") + compare_specs(g.specs, b.specs, "the global weights")
        if problems:
            raise CheckpointError(f"{w.label}: {problems[0]}")
        specs = [(n, s.dtype, s.shape, s.nbytes) for n, s in g.specs.items()]
        return write_checkpoint(storage, out_key, specs=specs, stream=lambda: _rebased(g, w, b),
                                metadata=g.metadata, manifest=manifest)


def _rebased(g: TensorFile, w: TensorFile, b: TensorFile) -> Iterator[tuple[str, torch.Tensor]]:
    # the late contribution is read by a reader thread: if its reads stall, it is refused after
    # merge.reading.STALL_S instead of holding the merge service
    with contextlib.closing(read_tensors(w, w.label, list(g.specs))) as late:
        for (name, spec), (_, wt) in zip(g.specs.items(), late):
            gt = g.get(name)
            if spec.dtype not in FLOATS:
                yield name, gt
                continue
            v = gt.float() + (wt.float() - b.get(name).float())
            if not finite(v):  # a NaN in the contribution, or an overflow of the re-basing
                raise CheckpointError(nonfinite(w.label, name))
            yield name, v.to(gt.dtype)
    for ck in (g, w, b):  # every byte has been read: check all three against their manifests
        ck.verify()
