"""The outer step over files (OuterStep): what the live round, `orchestrate merge --method outer`
and the rebuild of a lost outer state all write through. The maths is core/outer.py's, which a
worker replaying a round runs too; here the new global weights and outer state stream to storage
tensor by tensor (or slice by slice), nothing visible before the commit.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from core.checkpoint import FLOATS, TORCH_DTYPES
from core.checkpoint_writer import OutputFile, StreamWriter
from core.config import OuterConfig
from core.errors import CheckpointError
from core.failpoints import failpoint
from core.outer import outer_step_from_grad, state_key, state_slots
from merge.inputs import finite, overflowed


class StepOverflow(CheckpointError):
    """The outer step's result is not finite although its inputs are: the round is refused whole."""


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
