"""Overlapped rounds (round.overlap): a persistent worker trains on while its round is merged.

After publishing round r's contribution at weights `p`, the worker starts round r+1's inner steps
from its own weights and AdamW state (it never runs more than one round ahead). When the merge
service assigns it round r+1 with base `g` (= global_{r+1}), it adopts that base at its next step
boundary:

- `rebase`: theta <- g + (theta - p). The steps taken since publishing (theta - p) are kept and land
  in round r+1's contribution, whose base is g: counted once, never in round r's (published at p)
  nor lost.
- `mix` (Streaming DiLoCo's blend, alpha = round.overlap_mix): theta <- (1 - alpha) g + alpha theta.

The adoption step goes into the contribution's manifest (`overlap.adopted_at_step`).
"""
from __future__ import annotations

import torch


def adopt(theta: dict[str, torch.Tensor], published: dict[str, torch.Tensor], base: dict[str, torch.Tensor],
          mode: str, alpha: float = 0.5) -> dict[str, torch.Tensor]:
    """The worker's new weights once it adopts `base`: float tensors combined per `mode`, others
    (integer buffers) taken from the base."""
    out = {}
    for name, t in theta.items():
        g = base[name]
        if not t.is_floating_point():
            out[name] = g.clone()
        elif mode == "rebase":
            out[name] = g.float() + (t.float() - published[name].float())
        elif mode == "mix":
            out[name] = torch.lerp(g.float(), t.float(), alpha)  # (1 - alpha) g + alpha theta
        else:
            raise ValueError(f"round.overlap {mode!r} is not rebase or mix")
    return out
