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

from core.checkpoint import TensorFile, read_manifest
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


class HostBuffers:
    """CPU tensors kept from round to round for copies to and from `device`, page-locked when it
    is a GPU (a copy from pageable memory faults every page in, then the driver stages it:
    docs/benchmarks.md has the figures). A persistent worker copies every round, its weights out,
    its optimizer state out and the next base in; per-round jobs use them once.

    A buffer is handed out again by the next call for the same name: whoever holds the tensors
    of one call must be done with them before the next (the trainer's rounds are sequential;
    the background state write is waited for before the state is copied again).

    `live`: copy_of hands out a CPU source's own tensors where they already have the wanted dtype:
    the holder promises that nothing changes them while it uses them (worker/publish.py)."""

    def __init__(self, device: torch.device, live: bool = False) -> None:
        self.pin = device.type == "cuda"
        self.live = live
        self._bufs: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The buffer for `name` (a checkpoint.Alloc): the last one if it still fits, else a new one."""
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != dtype or tuple(buf.shape) != tuple(shape):
            buf = self._bufs[name] = torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        return buf

    def copy_of(self, tensors: dict[str, torch.Tensor], dtype_of=lambda t: t.dtype) -> dict[str, torch.Tensor]:
        """Host copies of `tensors` (on any device), each converted to dtype_of(tensor)."""
        if self.live:
            return {k: t.detach() if t.device.type == "cpu" and t.dtype == dtype_of(t) else t.detach().to("cpu", dtype_of(t))
                    for k, t in tensors.items()}
        out = {k: self(k, tuple(t.shape), dtype_of(t)).copy_(t.detach(), non_blocking=self.pin) for k, t in tensors.items()}
        if self.pin:
            torch.cuda.synchronize()  # non-blocking copies off the GPU: the bytes are there only now
        return out


def _fp32(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.is_floating_point() else t.dtype


def weights_of(model: torch.nn.Module, host: HostBuffers | None = None) -> dict[str, torch.Tensor]:
    """fp32 CPU copies of the parameters and buffers, keyed by state_dict name (tied ones once);
    into `host`'s buffers when given (valid until its next use)."""
    aliases = tied_aliases(model)
    own = {k: v for k, v in model.state_dict().items() if k not in aliases}
    if host is not None:
        return host.copy_of(own, _fp32)
    return {k: v.detach().to("cpu", _fp32(v), copy=True) for k, v in own.items()}


def load_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], label: str) -> None:
    """Copy `tensors` into `model`, naming every missing, unexpected or mis-shaped tensor at once.
    A tied alias is not needed (its tensor is loaded under the first name) and ignored if given."""
    own, tensors = check_fit(model, tensors, label)
    with torch.no_grad():
        for k, v in own.items():
            t = tensors[k]
            v.copy_(t, non_blocking=t.is_pinned() and t.dtype == v.dtype)
    if any(v.is_cuda for v in own.values()):
        # a pinned source may be refilled (the next round's base) once this returns
        torch.cuda.current_stream().synchronize()


def check_fit(model: torch.nn.Module, tensors: dict[str, torch.Tensor], label: str
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the model's tensors, `tensors`), both without tied aliases, once every name and shape
    matches; else a CheckpointError naming each mismatch."""
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
    return own, tensors


def load_model(url: str, **overrides: Any) -> torch.nn.Module:
    """Rebuild the model (built-in or Hugging Face) from a checkpoint written by islands (any fsspec URL)."""
    root, name = posixpath.split(url.rstrip("/"))
    storage = Storage(root or ".", follow_links=True)  # a path the user names
    # A manifest, when the file still sits beside it, lets the bytes be checked; a file copied
    # elsewhere on its own is still a valid safetensors file.
    with TensorFile(storage, name, read_manifest(storage, name), label=url) as ck:
        tensors = ck.load_all(verify=ck.manifest is not None)
        meta = ck.metadata
    if MODEL_META not in meta and "islands.task" in meta:
        raise CheckpointError(f"{url} is a model of task {meta['islands.task']!r}, which its task builds: name the run "
                              "(`orchestrate eval CHECKPOINT --run RUN`), or build it with the task's model() and use "
                              "load_weights()")
    if MODEL_META not in meta:
        raise CheckpointError(f"{url} carries no model description ({MODEL_META} metadata); "
                              "build the model yourself and use load_weights(), or, to evaluate it, name the run "
                              "whose model it is: `orchestrate eval CHECKPOINT --run RUN`")
    arch = {**json.loads(meta[MODEL_META]), **overrides}
    model = build_model(ModelConfig(**arch))
    load_weights(model, tensors, url)
    return model
