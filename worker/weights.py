"""Between the built-in model and checkpoints: build it, save it, load it back.

The model's architecture travels inside every global checkpoint (safetensors metadata key
`islands.model`), so a checkpoint alone is enough to rebuild the model:

    from worker.weights import load_model
    model = load_model("runs/diloco-.../final/model.safetensors")   # any fsspec URL
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


def build_model(cfg: ModelConfig) -> GPT:
    return GPT(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size,
               dropout=cfg.dropout)


def model_metadata(cfg: ModelConfig) -> dict[str, str]:
    return {MODEL_META: json.dumps({k: getattr(cfg, k) for k in ARCH_KEYS}, sort_keys=True)}


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """fp32 CPU copies of the parameters and buffers, keyed by state_dict name."""
    return {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).clone()
            for k, v in model.state_dict().items()}


def load_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], label: str) -> None:
    """Copy `tensors` into `model`, naming every missing, unexpected or mis-shaped tensor at once."""
    own = model.state_dict()
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


def load_model(url: str, **overrides: Any) -> GPT:
    """Rebuild the built-in model from a checkpoint written by islands (any fsspec URL)."""
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
