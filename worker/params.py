"""What a worker trains, loads and publishes: the whole model, or (LTE) its LoRA heads over a frozen base.

The trainer (worker/train.py) is the same loop for every algorithm; where LTE differs it asks one of
these two objects, picked by `params_for`:

                      FullModel (diloco, lofi, fedavg)      LoraHeads (lte, worker/lora.py)
  model               as built                              a LoRA head on every eligible Linear
  optimizer           AdamW over every parameter            AdamW over heads + non-LoRA parameters
  base checkpoint     all weights (unless resuming          the frozen base, always
                      from an in-flight checkpoint)
  state file          AdamW state                           AdamW state + own A and B; after a
                                                            merge B <- 0 (lte.reset_* ablations)
  publishes           all weights (or a coded delta)        heads + non-LoRA parameters
  kept in memory      yes (a persistent worker)             no: rebuilt from storage every round

With `inner.parallel: fsdp` (or `auto` finding the model too big for one GPU) the whole model is
sharded across the job's ranks: ShardedModel (worker/sharded.py), FullModel's contract through
PyTorch's distributed state-dict helpers.
"""
from __future__ import annotations

from typing import Any

import torch

from core import codec
from core.checkpoint import load_checkpoint
from core.checkpoint_writer import write_checkpoint
from core.config import Config
from core.errors import CheckpointError
from core.storage import Storage
from worker import lora
from worker.ranks import Ranks
from worker.state import FEEDBACK, SEP, Reader
from worker.tasks import Runner, task_for
from worker.weights import HostBuffers, load_weights, weights_of



def take_feedback(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove the error-feedback buffer from a state file's or in-flight checkpoint's tensors; return it."""
    return {k[len(FEEDBACK):]: tensors.pop(k) for k in [k for k in tensors if k.startswith(FEEDBACK)]}


def feedback_tensors(feedback: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    return {FEEDBACK + k: t for k, t in (feedback or {}).items()}


def make_optimizer(model: torch.nn.Module, cfg: Config) -> tuple[torch.optim.AdamW, list[str]]:
    """AdamW with weight decay on matrices that are not embeddings (by module type, so it holds for
    Hugging Face models, and for an lm_head tied to its embedding); returns it with the parameter
    names in state order."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters(recurse=False)}
    params = sorted(model.named_parameters())
    decay = [(n, p) for n, p in params if p.dim() >= 2 and id(p) not in embeddings]
    rest = [(n, p) for n, p in params if (n, p) not in decay]
    groups = [{"params": [p for _, p in decay], "weight_decay": cfg.inner.weight_decay},
              {"params": [p for _, p in rest], "weight_decay": 0.0}]
    fused = all(p.is_cuda for _, p in params)  # one kernel per step instead of a launch per tensor group
    opt = torch.optim.AdamW(groups, lr=cfg.inner.lr, betas=(cfg.inner.beta1, cfg.inner.beta2), fused=fused or None)
    return opt, [n for n, _ in decay] + [n for n, _ in rest]


def optimizer_tensors(opt: torch.optim.Optimizer, names: list[str], host: HostBuffers | None = None) -> dict[str, torch.Tensor]:
    """CPU copies of the optimizer's state, keyed `param<SEP>slot`; into `host`'s buffers when given."""
    state = {f"{names[idx]}{SEP}{slot}": torch.as_tensor(t)
             for idx, slots in opt.state_dict()["state"].items() for slot, t in slots.items()}
    if host is not None:
        return host.copy_of(state)
    return {k: t.detach().to("cpu", copy=True) for k, t in state.items()}  # one copy, GPU or CPU


def load_optimizer_tensors(opt: torch.optim.Optimizer, names: list[str], tensors: dict[str, torch.Tensor], label: str) -> None:
    index = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, _, slot = key.rpartition(SEP)
        if name not in index:
            raise CheckpointError(f"{label}: optimizer state for unknown parameter {name}; the model changed "
                                  "since it was written: start a new run")
        state.setdefault(index[name], {})[slot] = t
    sd = opt.state_dict()
    sd["state"] = state
    opt.load_state_dict(sd)


class Params:
    """What every kind shares: each rank holds whole tensors, reads what it needs and can save alone."""

    carries_over = True  # a persistent worker keeps model and AdamW state in memory between rounds
    collective = False  # True: gathering weights or AdamW state needs every rank (sharded), so
    # rank 0 cannot save an in-flight checkpoint alone from the preemption handler

    def __init__(self, cfg: Config, worker: int, task: Runner) -> None:
        self.cfg, self.worker, self.task = cfg, worker, task

    def build(self, device: torch.device) -> torch.nn.Module:
        """The model on `device`, initialised but not loaded: the round's base overwrites every weight."""
        with device:
            model = self.task.build_model(pretrained=False)
        self.prepare(model)
        return model

    def prepare(self, model: torch.nn.Module) -> None:
        pass

    def reader(self, ranks: Ranks) -> Reader:
        """What this rank reads of a state file or in-flight checkpoint: all of it, whole (each of
        a DDP worker's ranks holds the whole model), the ranks agreeing on one verdict."""
        return Reader(ranks)

    def save(self, storage: Storage, key: str, tensors: dict[str, torch.Tensor], manifest: dict[str, Any]) -> None:
        """A state file or in-flight checkpoint (rank 0 writes it)."""
        write_checkpoint(storage, key, tensors, manifest=manifest)

    def optimizer_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer, names: list[str],
                        host: HostBuffers | None = None) -> dict[str, torch.Tensor]:
        return optimizer_tensors(opt, names, host)

    def load_optimizer(self, model: torch.nn.Module, opt: torch.optim.Optimizer, names: list[str],
                       tensors: dict[str, torch.Tensor], label: str) -> None:
        load_optimizer_tensors(opt, names, tensors, label)

    def state_extra(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {}

    def describe(self, manifest: dict[str, Any]) -> None:
        pass


class FullModel(Params):
    """Every parameter is trained and published."""

    def optimizer(self, model: torch.nn.Module) -> tuple[torch.optim.AdamW, list[str]]:
        return make_optimizer(model, self.cfg)

    def load_base(self, storage: Storage, key: str, model: torch.nn.Module, resuming: bool,
                  alloc: HostBuffers | None = None) -> dict[str, torch.Tensor] | None:
        """The base's weights into the model, and returned (a delta is coded from them); nothing when
        an in-flight checkpoint will overwrite them all. The base may be this worker's own coded
        contribution (late_policy continue), hence codec.load_weights."""
        if resuming:
            return None
        tensors = codec.load_weights(storage, key, f"base weights for worker {self.worker}", alloc=alloc)
        load_weights(model, tensors, storage.display(key))
        return tensors

    def load_trained(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor], label: str) -> None:
        load_weights(model, tensors, label)

    def restore_state(self, model: torch.nn.Module, state: dict[str, torch.Tensor], label: str,
                      round: int) -> dict[str, torch.Tensor]:
        """The AdamW part of a state file (here: all of it)."""
        return state

    def published(self, model: torch.nn.Module, host: HostBuffers | None) -> dict[str, torch.Tensor]:
        return weights_of(model, host)


class LoraHeads(Params):
    """LoRA-the-Explorer: this worker's heads and the small non-LoRA parameters are trained and
    published; the headed layers' weights stay frozen at the round's base."""

    carries_over = False  # heads are reset after every merge: the state file is the one source

    def prepare(self, model: torch.nn.Module) -> None:
        lora.attach_heads(model, self.cfg.lte, seed=lora.head_seed(self.cfg.seed, self.worker))

    def optimizer(self, model: torch.nn.Module) -> tuple[torch.optim.AdamW, list[str]]:
        return lora.make_optimizer(model, self.cfg)

    def load_base(self, storage: Storage, key: str, model: torch.nn.Module, resuming: bool,
                  alloc: HostBuffers | None = None) -> None:
        tensors, _, _ = load_checkpoint(storage, key, label=f"base weights for worker {self.worker}")
        lora.load_base(model, tensors, storage.display(key))

    def load_trained(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor], label: str) -> None:
        lora.load_tensors(model, tensors, label)

    def restore_state(self, model: torch.nn.Module, state: dict[str, torch.Tensor], label: str,
                      round: int) -> dict[str, torch.Tensor]:
        """Own A (and B) from the state file into the model, then B <- 0 after the merge; returns the
        AdamW state to keep (without the heads' slots if lte.reset_opt)."""
        lte = self.cfg.lte
        lora.load_tensors(model, {k: v for k, v in state.items() if SEP not in k}, label)
        lora.reset_heads(model, lte, seed=lora.head_seed(self.cfg.seed, self.worker, round))
        return {k: v for k, v in state.items()
                if SEP in k and not (lte.reset_opt and lora.is_head_param(k.rpartition(SEP)[0]))}

    def state_extra(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return lora.head_tensors(model)

    def describe(self, manifest: dict[str, Any]) -> None:
        manifest["lte"] = {"rank": self.cfg.lte.rank, "scale": self.cfg.lte.alpha / self.cfg.lte.rank}

    def published(self, model: torch.nn.Module, host: HostBuffers | None) -> dict[str, torch.Tensor]:
        return lora.contribution_tensors(model)


TRAIN_BYTES_PER_PARAM = 16  # fp32 weight, gradient and AdamW's two slots


def sharded(cfg: Config, device: torch.device) -> bool:
    """inner.parallel, with `auto` deciding: shard when the weights, gradients and AdamW state
    would take more than half of one GPU (the rest is for activations). On CPUs never: the ranks
    share the node's memory, so sharding saves none of it."""
    if cfg.inner.parallel != "auto":
        return cfg.inner.parallel == "fsdp"
    if device.type != "cuda":
        return False
    with torch.device("meta"):  # the parameter count without memory or weights
        n = sum(p.numel() for p in task_for(cfg).build_model(pretrained=False).parameters())
    return not fits_half(n, torch.cuda.get_device_properties(device).total_memory)


def fits_half(params: int, device_bytes: int) -> bool:
    return TRAIN_BYTES_PER_PARAM * params <= device_bytes / 2
