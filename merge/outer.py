"""The DiLoCo outer step, done by a real torch.optim optimizer (as torchft's local_sgd does), and
over files (OuterStep): what the live round, `orchestrate merge --method outer` and the rebuild of
a lost outer state all write through.

The outer gradient of a tensor is `global - merged` (merged = the workers' weighted mean). It is
written into `.grad` of a float32 copy of the global tensor, and one `step()` of the configured
optimizer turns it into the next global tensor. The merge runs in a fresh process every round, so
the optimizer's state (momentum buffers, Adam moments and step) is saved as safetensors keyed
`<tensor>::<state>` and loaded back before the next step. One throwaway optimizer per tensor keeps
memory to one tensor's worth: these optimizers are element-wise, so per-tensor steps are exact
(and per-slice ones: the merge engine steps slices of a tensor).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from core.checkpoint import FLOATS, TORCH_DTYPES
from core.checkpoint_writer import OutputFile, StreamWriter
from core.config import OuterConfig
from core.errors import CheckpointError
from core.failpoints import failpoint
from merge.inputs import finite, overflowed

STATE_SEP = "::"


class StepOverflow(CheckpointError):
    """The outer step's result is not finite although its inputs are: the round is refused whole."""


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


def state_out_specs(order: Sequence[tuple[str, str, tuple[int, ...]]], cfg: OuterConfig) -> list[tuple[str, str, tuple[int, ...], int]]:
    """The outer-state file's entries for a model whose tensors are `order` (name, dtype, shape)."""
    out, slots = [], state_slots(cfg)  # one probe step of the optimizer, not one per tensor
    for name, dtype, shape in order:
        if dtype not in FLOATS:
            continue
        for slot, full in slots:
            s = tuple(shape) if full else ()
            out.append((state_key(name, slot), "F32", s, 4 * math.prod(s)))
    return out


class OuterStep:
    """One outer step over files: the new global weights (`weights`, one file or a model's shards)
    and the new outer state (`state`, or None) written tensor by tensor, or slice by slice in file
    order, as the step goes, by a thread each; nothing is visible before `commit()`, which
    publishes the weights, then the state. The caller reads the global and the state and computes
    the outer gradient (a running sum's mean, a merge method's, a robust aggregate's)."""

    def __init__(self, weights: list[OutputFile], state: OutputFile | None, cfg: OuterConfig) -> None:
        self.cfg, self.slots = cfg, state_slots(cfg)
        self.grad_sq = 0.0
        """The squared norm of the outer gradient so far."""
        self._dtypes = {n: TORCH_DTYPES[d] for o in weights for n, d, _, _ in o.specs}
        self._weights = StreamWriter(weights)
        self._state = StreamWriter([state]) if state is not None else None
        self._pending: dict[str, torch.Tensor] = {}  # the slots of the current tensor, when they cannot stream

    def keep(self, name: str, t: torch.Tensor) -> None:
        """A tensor (or slice) the step leaves as it is: not floating point."""
        self._weights.put(name, t.to(self._dtypes[name]))

    def step(self, name: str, base: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
             part: tuple[int, int, int] | None = None, owned: bool = False) -> None:
        """Step `base` (tensor `name`, or its elements part = (start, stop, numel)) by `grad`, from
        the optimizer `state` of those elements (empty: the first step). `owned`: `base` and `state`
        are the caller's to give, and are overwritten (a model held in memory), not copied (views
        of read buffers, which go back to their reader while the writer still holds the result)."""
        new, new_state, g = outer_step_from_grad(base, grad, state, self.cfg, in_place=owned)
        if not finite(new):  # every input was checked finite
            raise StepOverflow(overflowed(name, "outer merge", f"check the weights and the outer learning rate "
                                                                  f"({self.cfg.optimizer}, lr {self.cfg.lr:g})"))
        g = g.reshape(-1)
        self.grad_sq += float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2  # fp64: never inf for finite g
        self._weights.put(name, new.to(self._dtypes[name]))
        if self._state is not None:
            self._put_state(name, new_state, part or (0, new.numel(), new.numel()))

    def _put_state(self, name: str, state: dict[str, torch.Tensor], part: tuple[int, int, int]) -> None:
        """One full-size slot (momentum) streams as it comes; otherwise the slots of one tensor are
        gathered, then written slot after slot once its last part is in."""
        assert self._state is not None
        start, stop, numel = part
        if len(self.slots) == 1 and self.slots[0][1]:
            self._state.put(state_key(name, self.slots[0][0]), state[self.slots[0][0]].to(torch.float32).reshape(-1))
            return
        for slot, full in self.slots:
            if full:
                buf = self._pending.setdefault(slot, torch.empty(numel, dtype=torch.float32))
                buf[start:stop] = state[slot].reshape(-1)
            else:
                self._pending[slot] = state[slot].to(torch.float32).reshape(())
        if stop == numel:
            for slot, full in self.slots:
                t = self._pending.pop(slot)
                self._state.put(state_key(name, slot), t.reshape(-1) if full else t)

    def finish(self) -> None:
        """Wait until everything is written (still staged, not visible)."""
        for w in self._writers():
            w.finish()

    def commit(self) -> dict[str, Any]:
        """Publish the new global weights, then the new state; the weights' (first file's) manifest."""
        out = self._weights.commit()[0]
        failpoint("merge.after_global")  # crash tests: the new global published, its outer state not yet
        if self._state is not None:
            self._state.commit()
        return out

    def abort(self) -> None:
        for w in self._writers():
            w.abort()

    def _writers(self) -> list[StreamWriter]:
        return [self._weights, *([self._state] if self._state is not None else [])]
