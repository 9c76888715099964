"""The DiLoCo outer step, done by a real torch.optim optimizer (as torchft's local_sgd does).

The outer gradient of a tensor is `global - merged` (merged = the workers' weighted mean). It is
written into `.grad` of a float32 copy of the global tensor, and one `step()` of the configured
optimizer turns it into the next global tensor. The merge runs in a fresh process every round, so
the optimizer's state (momentum buffers, Adam moments and step) is saved as safetensors keyed
`<tensor>::<state>` and loaded back before the next step. One throwaway optimizer per tensor keeps
memory to one tensor's worth: these optimizers are element-wise, so per-tensor steps are exact.
"""
from __future__ import annotations

import torch

from core.config import OuterConfig

STATE_SEP = "::"


def make_optimizer(params: list[torch.Tensor], cfg: OuterConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "nesterov":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=True)
    if cfg.optimizer == "sgdm":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    raise ValueError(f"unknown outer optimizer {cfg.optimizer!r}; valid: nesterov, sgd, sgdm, adam")


def outer_step(
    global_t: torch.Tensor, merged: torch.Tensor, state: dict[str, torch.Tensor], cfg: OuterConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """One outer step of one tensor: (new global in the global's dtype, new state, outer gradient)."""
    param = global_t.detach().to(torch.float32).clone()
    grad = param - merged.to(torch.float32)
    param.grad = grad
    opt = make_optimizer([param], cfg)
    if state:
        opt.state[param] = {k: v.clone() for k, v in state.items()}
    opt.step()
    new_state = {k: v.detach().clone() for k, v in opt.state[param].items() if isinstance(v, torch.Tensor)}
    return param.detach().to(global_t.dtype), new_state, grad


def state_key(tensor: str, slot: str) -> str:
    return f"{tensor}{STATE_SEP}{slot}"
