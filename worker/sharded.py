"""A worker whose weights, gradients and AdamW state are sharded across its ranks (FSDP2).

For a model that does not fit one device with its AdamW state (16 bytes a parameter in fp32):
`inner.parallel: fsdp`. Every transformer block (each module of an nn.ModuleList) and then the
whole model go through PyTorch's `fully_shard`; each rank keeps 1/R of every parameter, its
gradient and its AdamW slots, and takes its slice of the worker's batch as with DDP.

What crosses storage does not change: full weights and the whole AdamW state, keyed by parameter
name, as a one-process worker writes them. PyTorch's distributed state-dict helpers
(torch.distributed.checkpoint.state_dict) gather them onto rank 0's CPU to publish, and scatter
them from rank 0 to load, so a job resumes on any number of ranks. Only rank 0 reads the base
and the state file (the others would hold R copies in host memory); it checks them first and says
so to every rank, so that a bad file fails the job instead of leaving the others waiting.

The in-flight checkpoint of a preempted round is gathered the same way, by every rank after the
same step (worker/ranks.py Preemption): submitit's handler runs on rank 0 alone.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard

from core import codec
from core.checkpoint import load_checkpoint
from core.config import Config
from core.errors import CheckpointError
from core.storage import Storage
from worker.params import SEP, FullModel, LoraHeads, Params, sharded
from worker.ranks import Ranks
from worker.tasks import Runner
from worker.weights import HostBuffers, check_fit, tied_aliases

GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's CPU
SCATTER = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


@contextlib.contextmanager
def weights_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no initialisation:
    their init runs on meta) while their buffers are made for real on the CPU (a causal mask, RoPE
    frequencies: not in the state dict, so no checkpoint restores them). Accelerate's
    init_empty_weights(include_buffers=False) does the same; this avoids the dependency."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:  # one already there stays itself: a tied weight stays tied
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def shard(model: torch.nn.Module) -> None:
    """fully_shard every block (a module of any nn.ModuleList), then the model (what is left:
    embeddings, final norm, a tied head)."""
    blocks = [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m]
    for block in blocks:
        fully_shard(block)
    fully_shard(model)


class ShardedModel(FullModel):
    """FullModel's contract, with the model sharded across the job's ranks."""

    collective = True

    def __init__(self, cfg: Config, worker: int, runner: Runner, ranks: Ranks) -> None:
        super().__init__(cfg, worker, runner)
        self.ranks = ranks

    def build(self, device: torch.device) -> torch.nn.Module:
        """Built on the meta device, sharded, and only then given memory on `device`: each rank holds
        its shard alone, never the whole model (R whole copies in a node's host memory, otherwise)."""
        with weights_on_meta():
            model = self.runner.build_model(pretrained=False)
        buffers = dict(model.named_buffers())  # to_empty gives the module new tensors; these stay
        shard(model)
        model.to_empty(device=device)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        return model

    def read(self, storage: Storage, key: str, label: str) -> dict[str, torch.Tensor]:
        return load_checkpoint(storage, key, label=label)[0] if self.ranks.lead else {}

    def load_base(self, storage: Storage, key: str, model: torch.nn.Module, resuming: bool,
                  alloc: HostBuffers | None = None) -> dict[str, torch.Tensor] | None:
        tensors = None
        if self.ranks.lead:
            tensors = codec.load_weights(storage, key, f"base weights for worker {self.worker}")
        self.load_trained(model, tensors, storage.display(key))
        return tensors

    def load_trained(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor] | None, label: str) -> None:
        """Rank 0's `tensors` (full weights) into every rank's shards."""
        aliases = tied_aliases(model)
        problem = None
        if self.ranks.lead:
            try:
                check_fit(model, tensors, label)
            except CheckpointError as exc:
                problem = str(exc)
        if (problem := self.ranks.lead_says(problem)) is not None:
            raise CheckpointError(problem)
        full = {**tensors, **{a: tensors[n] for a, n in aliases.items()}} if self.ranks.lead else {}
        set_model_state_dict(model, full, options=SCATTER)

    def published(self, model: torch.nn.Module, host: HostBuffers | None) -> dict[str, torch.Tensor]:
        """The whole weights on rank 0 (fp32, CPU); {} on the others. A collective."""
        full = get_model_state_dict(model, options=GATHER)
        aliases = tied_aliases(model)
        return {k: v.float() for k, v in full.items() if k not in aliases}

    def optimizer_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer, names: list[str],
                        host: HostBuffers | None = None) -> dict[str, torch.Tensor]:
        """The whole AdamW state keyed `param<SEP>slot` on rank 0; {} on the others. A collective."""
        state = get_optimizer_state_dict(model, opt, options=GATHER).get("state", {})  # {} off rank 0
        return {f"{name}{SEP}{slot}": torch.as_tensor(t) for name, slots in state.items() for slot, t in slots.items()}

    def load_optimizer(self, model: torch.nn.Module, opt: torch.optim.Optimizer, names: list[str],
                       tensors: dict[str, torch.Tensor], label: str) -> None:
        """Rank 0's `tensors` (the whole state, `param<SEP>slot`) into every rank's shards."""
        unknown = sorted({k.rpartition(SEP)[0] for k in tensors} - set(names)) if self.ranks.lead else []
        if (unknown := self.ranks.lead_says(unknown)):
            raise CheckpointError(f"{label}: optimizer state for unknown parameter(s) {unknown[:4]}; the model changed "
                                  "since it was written: start a new run")
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            name, _, slot = key.rpartition(SEP)
            state.setdefault(name, {})[slot] = t
        groups = get_optimizer_state_dict(model, opt)["param_groups"]  # this optimizer's, by name
        set_optimizer_state_dict(model, opt, {"state": state, "param_groups": groups} if self.ranks.lead else {},
                                 options=SCATTER)


def params_for(cfg: Config, worker: int, ranks: Ranks, device: torch.device, runner: Runner) -> Params:
    """What a worker trains and publishes: the whole model, LTE's heads, or the model sharded across ranks."""
    if cfg.algorithm == "lte":
        return LoraHeads(cfg, worker, runner)
    if ranks.world > 1 and sharded(cfg, device):
        return ShardedModel(cfg, worker, runner, ranks)
    return FullModel(cfg, worker, runner)
