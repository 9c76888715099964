"""Between models and checkpoints: build a model, save its weights, load them back.

The model is the built-in GPT (worker/model.py) or, with model.hf, a Hugging Face causal LM
(worker/hf.py); both take (idx, targets) and return (logits, loss). The model's description travels
inside every global checkpoint (safetensors metadata key `islands.model`), so a checkpoint alone is
enough to rebuild the model:

    from worker.weights import load_model
    model = load_model("runs/diloco-.../final/model.safetensors")   # any fsspec URL

Tied weights (a Hugging Face lm_head sharing the embedding's tensor) are stored once, under the
name that comes first in the state_dict: safetensors refuses shared tensors, and a merge that
walks names would otherwise average one tensor twice.
"""
from __future__ import annotations

import json
import posixpath
from typing import Any

import torch

from core.checkpoint import LazyCheckpoint, read_manifest
from core.config import ModelConfig
from core.errors import CheckpointError
from core.storage import Storage
from worker.model import GPT

MODEL_META = "islands.model"
ARCH_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "dropout")


def build_model(cfg: ModelConfig, *, pretrained: bool = True) -> torch.nn.Module:
    """The model `cfg` describes: the built-in GPT (initialised from torch's seed), or the Hugging
    Face model at cfg.hf with its own weights (pretrained=False: its architecture only, initialised
    as transformers does: what a worker builds, since the round's base overwrites every weight)."""
    if cfg.hf is not None:
        from worker import hf  # transformers is imported only for a Hugging Face model
        return hf.build(cfg, pretrained=pretrained)
    return GPT(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size,
               dropout=cfg.dropout)


def model_metadata(cfg: ModelConfig) -> dict[str, str]:
    arch = {k: getattr(cfg, k) for k in ARCH_KEYS}
    if cfg.hf is not None:  # only then: the built-in model's metadata stays byte for byte as it was
        arch["hf"] = cfg.hf
    return {MODEL_META: json.dumps(arch, sort_keys=True)}


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: name} for state_dict entries that are the same tensor as an earlier entry `name`."""
    first: dict[int, str] = {}
    aliases = {}
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) in first:
            aliases[k] = first[id(v)]
        else:
            first[id(v)] = k
    return aliases


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """fp32 CPU copies of the parameters and buffers, keyed by state_dict name (tied ones once)."""
    aliases = tied_aliases(model)
    return {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype, copy=True)
            for k, v in model.state_dict().items() if k not in aliases}


def load_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], label: str) -> None:
    """Copy `tensors` into `model`, naming every missing, unexpected or mis-shaped tensor at once.
    A tied alias is not needed (its tensor is loaded under the first name) and ignored if given."""
    aliases = tied_aliases(model)
    own = {k: v for k, v in model.state_dict().items() if k not in aliases}
    tensors = {k: v for k, v in tensors.items() if k not in aliases}
    problems = [f"missing tensor {k}" for k in own if k not in tensors]
    problems += [f"unexpected tensor {k}" for k in tensors if k not in own]
    problems += [f"tensor {k} has shape {list(tensors[k].shape)}, the model wants {list(v.shape)}"
                 for k, v in own.items() if k in tensors and tensors[k].shape != v.shape]
    if problems:
        raise CheckpointError(f"{label} does not fit the model: " + "; ".join(problems[:8])
                              + ("" if len(problems) <= 8 else f"; and {len(problems) - 8} more")
                              + ". Check model.* in the config against the checkpoint.")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(tensors[k].to(v.dtype))


def load_model(url: str, **overrides: Any) -> torch.nn.Module:
    """Rebuild the model (built-in or Hugging Face) from a checkpoint written by islands (any fsspec URL)."""
    root, name = posixpath.split(url.rstrip("/"))
    storage = Storage(root or ".")
    # A manifest, when the file still sits beside it, lets the bytes be checked; a file copied
    # elsewhere on its own is still a valid safetensors file.
    with LazyCheckpoint(storage, name, read_manifest(storage, name), label=url) as ck:
        tensors = ck.load_all(verify=ck.manifest is not None)
        meta = ck.metadata
    if MODEL_META not in meta:
        raise CheckpointError(f"{url} carries no model description ({MODEL_META} metadata); "
                              "build the model yourself and use load_weights()")
    arch = {**json.loads(meta[MODEL_META]), **overrides}
    model = build_model(ModelConfig(**arch))
    load_weights(model, tensors, url)
    return model
