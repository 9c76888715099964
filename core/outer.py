"""THE outer step of DiLoCo, in memory: what the merge service's round (merge.rounds.outer_step),
`orchestrate merge --method outer` and a worker replaying a committed round (worker/replica.py) all
run, so that the same inputs in the same order give the same bits wherever it runs.

A round's inputs are folded into a running sum S = sum_i w_i x_i (`fold`, `fold_sparse`: x_i a
contribution's weights or its delta against the round's base), in the order the round records;
`outer_grad` turns S into the outer gradient (`global - mean` for weights, the mean itself for
deltas), written into `.grad` of a float32 copy of the global tensor, and one `step()` of a real
torch.optim optimizer (as torchft's local_sgd does) gives the next global tensor. The optimizer's
state (momentum buffers, Adam moments and step) is saved as safetensors keyed `<tensor>::<slot>`
(merge/outer.py writes it) and loaded back before the next step. One throwaway optimizer per tensor
keeps memory to one tensor's worth: these optimizers are element-wise, so per-tensor steps are
exact (and per-slice ones: the merge engine steps slices of a tensor).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from core.checkpoint import FLOATS
from core.config import OuterConfig
from core.errors import CheckpointError

STATE_SEP = "::"


def outer_at(outer: OuterConfig, r: int) -> OuterConfig:
    """The outer optimizer of round r: outer.lr, risen to linearly over outer.warmup_rounds."""
    if r >= outer.warmup_rounds:
        return outer
    return dataclasses.replace(outer, lr=outer.lr * (r + 1) / outer.warmup_rounds)


def fold(s: torch.Tensor, x: torch.Tensor, weight: float, start: int = 0, stop: int | None = None) -> None:
    """S[start:stop] += w x, flat. The product is rounded before the add, not fused into it, so that
    a sum of two is the same in either order."""
    s.view(-1)[start:stop].add_(x.reshape(-1).to(torch.float32).mul(float(weight)))


def fold_sparse(s: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, weight: float) -> None:
    """S at the flat `positions` (distinct: core.topk.sparse checks them) += w values."""
    s.view(-1).index_add_(0, positions, values.mul(float(weight)))


def outer_grad(s: torch.Tensor, total: float, base: torch.Tensor, space: str | None) -> torch.Tensor:
    """The outer gradient from S over inputs whose weights add up to `total`, computed in S: the
    mean of the deltas (`space` delta), or `base - mean` of weights."""
    grad = s.div_(total)
    if space != "delta":
        torch.sub(base.to(torch.float32), grad, out=grad)
    return grad


def make_optimizer(params: list[torch.Tensor], cfg: OuterConfig) -> torch.optim.Optimizer:
    """The outer optimizer over `params`. The SGD family runs fused (one pass, no temporaries; the
    default implementation's numbers to the last bit, tests/test_merge.py; docs/benchmarks.md)."""
    if cfg.optimizer == "nesterov":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=True, fused=True)
    if cfg.optimizer == "sgdm":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, fused=True)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, fused=True)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    raise ValueError(f"unknown outer optimizer {cfg.optimizer!r}; valid: nesterov, sgd, sgdm, adam")


def outer_step(
    global_t: torch.Tensor, merged: torch.Tensor, state: dict[str, torch.Tensor], cfg: OuterConfig,
    in_place: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """One outer step of one tensor: (new global in the global's dtype, new state, outer gradient).
    `in_place`: see outer_step_from_grad; the gradient is also computed into `merged`."""
    if in_place and global_t.dtype == torch.float32 and merged.dtype == torch.float32:
        return outer_step_from_grad(global_t, torch.sub(global_t, merged, out=merged), state, cfg, in_place=True)
    param = global_t.detach().to(torch.float32)
    return outer_step_from_grad(global_t, param - merged.to(torch.float32), state, cfg, in_place=in_place)


def outer_step_from_grad(
    global_t: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], cfg: OuterConfig,
    in_place: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The same step given the outer gradient itself (delta contributions carry it: core/codec.py).

    By default neither input nor `state` is written to (they may be views of read buffers or of a
    model held in memory): the step works on copies of the global tensor and of the state, which
    it returns. `in_place`: the caller owns them and lets the step overwrite them (the round merge
    over models it holds in memory: merge.rounds): a float32 global tensor becomes the new
    one, and the state's tensors the new state, without a copy of either.
    """
    own = in_place and global_t.dtype == torch.float32
    param = global_t.detach() if own else global_t.detach().to(torch.float32, copy=True)
    grad = grad.to(torch.float32)  # torch.optim reads .grad, never writes it
    param.grad = grad
    opt = make_optimizer([param], cfg)
    if state:  # torch.optim updates its state tensors in place
        opt.state[param] = dict(state) if in_place else {k: v.clone() for k, v in state.items()}
    opt.step()
    param.grad = None
    new_state = {k: v.detach() for k, v in opt.state[param].items() if isinstance(v, torch.Tensor)}
    return param.detach().to(global_t.dtype), new_state, grad


def state_key(tensor: str, slot: str) -> str:
    return f"{tensor}{STATE_SEP}{slot}"


# -- the state file: `<tensor>::<slot>` float32 entries ---------------------------------------
def state_slots(cfg: OuterConfig) -> list[tuple[str, bool]]:
    """The optimizer's state slots in torch.optim's order, each (name, True if shaped like the param)."""
    _, st, _ = outer_step(torch.zeros(2), torch.ones(2), {}, cfg)
    return [(slot, tuple(t.shape) == (2,)) for slot, t in st.items()]


def state_in_specs(specs: Mapping[str, tuple[str, tuple[int, ...]]], order: Sequence[tuple[str, str, tuple[int, ...]]],
                   slots: list[tuple[str, bool]], label: str) -> dict[str, list[tuple[str, bool]]]:
    """Which slots a state file holds for each tensor, given its entries {key: (dtype, shape)},
    after checking that it fits the model (`order`) and the optimizer (`slots`)."""
    shapes = {n: s for n, d, s in order if d in FLOATS}
    have: dict[str, list[str]] = {}
    problems = []
    want = dict(slots)
    for key, (dtype, shape) in specs.items():
        name, sep, slot = key.rpartition(STATE_SEP)
        if not sep or name not in shapes:
            problems.append(f"entry {key} names no floating-point tensor of the model")
        elif slot not in want:
            problems.append(f"entry {key} is not a state slot of this optimizer (it has {list(want) or 'none'})")
        elif dtype != "F32" or tuple(shape) != (shapes[name] if want[slot] else ()):
            problems.append(f"entry {key} is {dtype}{list(shape)}, expected F32"
                            f"{list(shapes[name]) if want[slot] else []}")
        else:
            have.setdefault(name, []).append(slot)
    for name, got in have.items():
        if set(got) != set(want):
            problems.append(f"tensor {name} has state slots {sorted(got)}, the optimizer needs {sorted(want)}")
    if problems:
        raise CheckpointError(f"{label}: does not fit this model and optimizer: " + "; ".join(problems[:5])
                              + "; pass the state file written by the same merge and optimizer, or none to start "
                              "from zero state")
    return {name: [(s, f) for s, f in slots] for name in have}
