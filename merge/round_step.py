"""The outer step of a round's merge, from the running sum (merge/rounds.py) to the next global
weights and outer optimizer state: one merge.outer.OuterStep over the tensors, each step's
pseudo-gradient `base - S / total` (the mean of the deltas, for deltas) or, with a robust
round.aggregate, `base -` the contributions' median or trimmed mean (merge/robust.py)."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from core.checkpoint import DTYPES, FLOATS, ITEMSIZE, TensorFile, open_checkpoint, read_manifest
from core.checkpoint_writer import OutputFile
from core.errors import CheckpointError
from core.failpoints import failpoint
from core.storage import Storage
from core.outer import outer_grad, state_in_specs, state_key, state_slots
from merge.outer import OuterStep, state_out_specs
from merge.robust import Values
from merge.robust import aggregate as robust_aggregate
from merge.round_spec import RoundSpec

if TYPE_CHECKING:
    from merge.rounds import RunningSum


def digest_now(storage: Storage, key: str) -> str | None:
    """The digest the manifest at `key` says now; None if there is none or it is damaged."""
    try:
        return (read_manifest(storage, key) or {}).get("digest")
    except CheckpointError:  # damaged: the fold refuses the contribution, naming why
        return None


def outer_step(acc: RunningSum, spec: RoundSpec, order: list[int]) -> tuple[dict[str, Any], float]:
    """The outer step, tensor by tensor, from acc's sum S over acc.folded (S is divided in place):
    the new global weights and state written and committed; their manifest and the squared norm of
    the outer gradient. Reads the base and state from acc.held when they are still the files."""
    s, total, outer = acc.storage, float(sum(f.weight for f in acc.folded)), spec.outer
    assert outer is not None
    layout = [(n, sp.dtype, sp.shape) for n, sp in acc.ref.items()]
    robust = None if spec.aggregate == "mean" else (spec.aggregate, spec.trim)
    manifest = {**spec.manifest, "merge_order": order, **({"aggregate": spec.aggregate} if robust else {})}
    opened: list[TensorFile] = []
    values = Values(s, acc.folded, acc.space or "weights", acc.base_digest) if robust else None
    step = OuterStep([OutputFile(s, spec.out, [(n, d, sh, math.prod(sh) * ITEMSIZE[d]) for n, d, sh in layout],
                                 spec.metadata, manifest)],
                     OutputFile(s, spec.state_out, state_out_specs(layout, outer), None,
                                {"optimizer": outer.optimizer}) if spec.state_out else None, outer)
    try:
        base, _ = _source(acc, spec.base, f"global weights {s.display(spec.base)}", opened)
        state, have = _state(acc, spec, layout, opened)
        for name, sp in acc.ref.items():
            b = base(name)
            if sp.dtype not in FLOATS:
                step.keep(name, b)
                continue
            if values is None:
                grad = outer_grad(acc.sums[name], total, b, acc.space)
            else:  # a robust aggregate is the mean itself
                grad = outer_grad(robust_aggregate(values.get(name, lambda: b), *robust), 1.0, b, acc.space)  # type: ignore[misc]
            step.step(name, b, grad, {slot: state(state_key(name, slot)) for slot, _ in have.get(name, [])},
                      owned=True)
            failpoint("merge.while_reading")  # crash tests: half the step written, temporaries on disk
        step.finish()
        for f in opened:
            f.verify()
        if values is not None:
            values.verify()
        return step.commit(), step.grad_sq
    except BaseException:
        step.abort()
        raise
    finally:
        for f in opened:
            f.close()
        if values is not None:
            values.close()


def _source(acc: RunningSum, key: str, label: str, opened: list[TensorFile]
            ) -> tuple[Callable[[str], torch.Tensor], dict[str, tuple[str, tuple[int, ...]]]]:
    """(a tensor of the checkpoint at `key` by name, its entries' dtypes and shapes): the copy
    held in memory if it is still the file on storage (same digest; it is given up, since the
    step overwrites it), else the file, added to `opened` (verified and closed by the caller)."""
    held = acc.held.pop(key, None)
    if held is not None and digest_now(acc.storage, key) == held[0]:
        return held[1].__getitem__, {k: (DTYPES[t.dtype], tuple(t.shape)) for k, t in held[1].items()}
    opened.append(open_checkpoint(acc.storage, key, label))
    return opened[-1].read, {k: (sp.dtype, sp.shape) for k, sp in opened[-1].specs.items()}


def _state(acc: RunningSum, spec: RoundSpec, layout: list[tuple[str, str, tuple[int, ...]]], opened: list[TensorFile]
           ) -> tuple[Callable[[str], torch.Tensor], dict[str, list[tuple[str, bool]]]]:
    """(the outer state's tensors by key, each model tensor's state slots): none on a first step."""
    if spec.state_in is None:
        return lambda key: torch.empty(0), {}
    label = f"outer optimizer state {acc.storage.display(spec.state_in)}"
    state, entries = _source(acc, spec.state_in, label, opened)
    return state, state_in_specs(entries, layout, state_slots(spec.outer), label)  # it fits model and optimizer
