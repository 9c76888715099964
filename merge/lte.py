"""The LoRA-the-Explorer merge: fold every worker's LoRA heads into the global base.

For every layer W with heads (`<layer>.lora_A`: r x in, `<layer>.lora_B`: out x r) in the
contributions, and the contributions' weights w_n (equal by default: each worker consumed the same
tokens, so this is the paper's s / N):

    W <- W + s * sum_n (w_n / sum w) B_n A_n          (Huh et al., Algorithm 1)

computed in float32 as one matmul [s c_1 B_1 | ... | s c_N B_N] @ [A_1; ...; A_N]. Every other
tensor a contribution carries (norms, embeddings, biases: what the workers trained in full) is
their weighted mean; tensors no contribution carries (buffers) are copied from the base. No outer
optimizer: the update is applied as is.

Contributions are small (heads are r x (in + out) per layer), so they are read whole and checked
first: manifest and digest, names (the set the service expects, or the first one's), shapes against
the base and the rank, floating point, finite. A bad one is rejected with the reason, the rest are
merged; fewer than `min_inputs` left raises QuorumError, as merge.rounds.merge_round does. The base
streams tensor by tensor into the new global checkpoint (written atomically, manifest last, by
core.checkpoint_writer.write_checkpoint); its digest is checked before anything is published.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from core.checkpoint import TensorFile, TensorSpec, open_checkpoint
from core.checkpoint_writer import write_checkpoint
from core.errors import CheckpointError
from core.storage import Storage
from merge.inputs import NONFINITE, finite, overflowed, refusal
from merge.reading import read_tensors
from merge.round_spec import Contribution, LteRule, MergeResult, QuorumError, RoundSpec

log = logging.getLogger(__name__)

LORA_A, LORA_B = ".lora_A", ".lora_B"
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def headed_layers(names: Sequence[str] | Mapping[str, Any]) -> list[str]:
    """Layers with a head among tensor names: `x.lora_A` -> `x`."""
    return sorted(n[: -len(LORA_A)] for n in names if n.endswith(LORA_A))


def lte_update(w: torch.Tensor, heads: Sequence[tuple[torch.Tensor, torch.Tensor]], coeffs: Sequence[float],
               scale: float) -> torch.Tensor:
    """w + scale * sum_n coeffs[n] * B_n @ A_n in float32; heads are (A_n, B_n)."""
    b = torch.cat([h[1].to(torch.float32) * (scale * c) for h, c in zip(heads, coeffs)], dim=1)
    a = torch.cat([h[0].to(torch.float32) for h in heads], dim=0)
    return torch.addmm(w.to(torch.float32), b, a)


def weighted_mean(tensors: Sequence[torch.Tensor], coeffs: Sequence[float]) -> torch.Tensor:
    acc = torch.mul(tensors[0].to(torch.float32), float(coeffs[0]))
    for t, c in zip(tensors[1:], coeffs[1:]):
        acc.add_(t.to(torch.float32), alpha=float(c))
    return acc


def check_contribution(tensors: Mapping[str, torch.Tensor], base: Mapping[str, TensorSpec], rank: int | None,
                       expected: Mapping[str, tuple[int, ...]] | None, ref_name: str = "the expected ones") -> str | None:
    """Why a contribution cannot be merged into `base` (names, shapes, rank, dtype, finite), or None.
    `expected`: the names and shapes it must have (those of `ref_name`)."""
    layers = headed_layers(tensors)
    if not layers:
        return "carries no LoRA head (no *.lora_A tensor): not an LTE contribution"
    for layer in layers:
        a, b, w = tensors[layer + LORA_A], tensors.get(layer + LORA_B), base.get(layer + ".weight")
        if b is None:
            return f"head {layer} has {layer}{LORA_A} but no {layer}{LORA_B}"
        if w is None or len(w.shape) != 2:
            return f"head {layer} has no 2-D weight {layer}.weight in the global weights to merge into"
        m, n = w.shape
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, n) or tuple(b.shape) != (m, r):
            return (f"head {layer}: A {list(a.shape)} and B {list(b.shape)} do not fit its weight {[m, n]} "
                    f"(A must be r x {n}, B {m} x r)")
        if rank is not None and r != rank:
            return f"head {layer} has rank {r}, the run's lte.rank is {rank}"
    heads = {layer + s for layer in layers for s in (LORA_A, LORA_B)}
    for name, t in tensors.items():
        if name in heads:
            pass
        elif name.endswith(LORA_B):
            return f"{name} has no matching {name[: -len(LORA_B)]}{LORA_A}"
        elif name not in base:
            return f"tensor {name} is not in the global weights"
        elif tuple(t.shape) != tuple(base[name].shape):
            return f"tensor {name} has shape {list(t.shape)}, the global weights have {list(base[name].shape)}"
        elif name.endswith(".weight") and name[: -len(".weight")] in layers:
            return f"tensor {name} is a headed layer's frozen weight: a contribution carries its head, not the weight"
        if t.dtype not in _FLOATS:
            return f"tensor {name} is {t.dtype}, not floating point"
        if not finite(t):
            return NONFINITE.format(name=name)
    if expected is not None:
        missing = sorted(set(expected) - set(tensors))
        extra = sorted(set(tensors) - set(expected))
        if missing or extra:
            return (f"tensor names differ from {ref_name}: missing {missing[:5]}, "
                    f"unexpected {extra[:5]} ({len(missing)} missing, {len(extra)} unexpected in all)")
        for n, shape in expected.items():
            if tuple(tensors[n].shape) != tuple(shape):
                return f"tensor {n} has shape {list(tensors[n].shape)}, {ref_name} have {list(shape)}"
    return None


def merge_lte_round(storage: Storage, spec: RoundSpec, contributions: Sequence[Contribution]) -> MergeResult:
    """Merge the LTE `contributions` into spec.base by spec.lte; write spec.out.

    Rejected contributions are reported in the result (QuorumError if fewer than spec.min_inputs
    valid ones remain). `outer_grad_norm` is the norm of the whole update (new - old global).
    """
    t0, rule = time.perf_counter(), spec.lte
    assert rule is not None
    base_label = f"global weights {storage.display(spec.base)}"
    with open_checkpoint(storage, spec.base, label=base_label) as base:
        base_specs, base_manifest = dict(base.specs), base.manifest
    live, rejected, bytes_read = _valid(storage, contributions, base_specs, rule)
    if len(live) < spec.min_inputs:
        raise QuorumError(f"only {len(live)} valid contribution(s) for {spec.out}, the quorum is {spec.min_inputs}; "
                          f"rejected: {rejected or 'none'}", rejected)
    total = sum(c.weight for c, _ in live)
    coeffs = [c.weight / total for c, _ in live]
    contribs = [t for _, t in live]
    layers = set(headed_layers(contribs[0]))
    update_sq = 0.0

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal update_sq
        with TensorFile(storage, spec.base, base_manifest, base_label) as ck:
            for name in ck.specs:  # file order: hashed on the way
                w = ck.get(name)
                layer = name[: -len(".weight")] if name.endswith(".weight") else None
                if layer in layers:
                    new = lte_update(w, [(t[layer + LORA_A], t[layer + LORA_B]) for t in contribs], coeffs, rule.scale)
                elif name in contribs[0]:
                    new = weighted_mean([t[name] for t in contribs], coeffs)
                else:
                    yield name, w
                    continue
                if not finite(new):
                    raise CheckpointError(overflowed(name, f"LTE merge (scale s = {rule.scale:g})",
                                                     "lower lte.alpha or lte.lr"))
                update_sq += float((new - w.to(torch.float32)).double().square().sum())
                yield name, new.to(w.dtype)
            ck.verify()  # every byte of the base streamed past: check it before the output is published

    specs = [(n, s.dtype, s.shape, s.nbytes) for n, s in base_specs.items()]
    info = {**spec.manifest, "algorithm": "lte", "lte_scale": rule.scale, "merged": [c.worker for c, _ in live]}
    out = write_checkpoint(storage, spec.out, specs=specs, stream=stream, metadata=spec.metadata, manifest=info)
    return MergeResult(merged=[c.worker for c, _ in live], rejected=rejected, bytes_read=bytes_read,
                       seconds=time.perf_counter() - t0, outer_grad_norm=math.sqrt(update_sq), manifest=out)


def _valid(storage: Storage, contributions: Sequence[Contribution], base: Mapping[str, TensorSpec], rule: LteRule
           ) -> tuple[list[tuple[Contribution, dict[str, torch.Tensor]]], dict[int, str], int]:
    """(the valid contributions with their tensors, the refused ones with why, bytes read)."""
    live: list[tuple[Contribution, dict[str, torch.Tensor]]] = []
    rejected: dict[int, str] = {}
    bytes_read = 0
    for c in contributions:
        label = f"worker {c.worker} ({storage.display(c.key)})"
        try:
            c.check_weight(label)
            with open_checkpoint(storage, c.key, label) as f:
                tensors = dict(read_tensors(f, c.worker))  # a reader thread: a stalled read fails it
                f.verify()
                bytes_read += f.size
            ref, ref_name = rule.expected, "those of an LTE contribution for this model and lte.rank"
            if ref is None and live:  # no model to say which: the first valid contribution does
                ref, ref_name = {n: tuple(t.shape) for n, t in live[0][1].items()}, f"worker {live[0][0].worker}'s"
            why = check_contribution(tensors, base, rule.rank, ref, ref_name)
            if why is not None:
                raise CheckpointError(f"{label}: {why}")
        except Exception as exc:  # noqa: BLE001 - whatever one contribution does, it is one rejection
            rejected[c.worker] = refusal(label, exc)
            log.warning("lte merge: rejected worker %d: %s", c.worker, rejected[c.worker])
            continue
        live.append((c, tensors))
    return live, rejected, bytes_read
