"""A worker whose weights, gradients and AdamW state are sharded across its ranks (FSDP2).

For a model that does not fit one device with its AdamW state (16 bytes a parameter in fp32):
`inner.parallel: fsdp`. Every transformer block (each module of an nn.ModuleList) and then the
whole model go through PyTorch's `fully_shard`; each rank keeps 1/R of every parameter (rows of dim
0, as torch.chunk splits them), its gradient and its AdamW slots, and takes its slice of the
worker's batch as with DDP.

No rank ever holds the whole model with the whole state in host memory:
- the state snapshot and the in-flight checkpoint are one file per rank, written in parallel from
  each rank's own shards (core/shards.py); a job of another rank count reads back its own rows
  of every tensor, and a one-process worker reads them all (worker/state.py);
- the base is read by rank 0 tensor by tensor and broadcast, each rank keeping its rows;
- the contribution is gathered tensor by tensor (`gathered`), rank 0 coding and writing each one as
  it comes (worker/publish.py).
The error-feedback buffer of a topk run stays whole, on rank 0, which codes the contribution.

The in-flight checkpoint of a preempted round is written by every rank after the same step
(worker/ranks.py Preemption): submitit's handler runs on rank 0 alone.
"""
from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from core import codec
from core.checkpoint import open_checkpoint
from core.config import Config
from core.errors import CheckpointError, IslandsError
from core.shards import chunk, commit_shards, remove_checkpoint, write_shard
from core.storage import Storage
from worker.params import FEEDBACK, SEP, FullModel, LoraHeads, Params, sharded
from worker.ranks import Ranks
from worker.state import Reader
from worker.tasks import Runner
from worker.weights import HostBuffers, check_fit, tied_aliases

M_MMAP_THRESHOLD = -3  # glibc's malloc.h


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


def return_freed_memory() -> None:
    """Large blocks (1 MB and up) from their own mappings, given back to the system when freed.

    glibc's default raises its mmap threshold to up to 32 MB the first time such a block is freed,
    after which blocks of that size come from the heap and stay with the process once freed: the
    per-tensor gathers, broadcasts and reads of a sharded worker (and on CPUs its activations) each
    leave their high-water mark, in each of a node's R ranks. A fixed threshold gives them back.
    Only for a sharded worker, which exists to save memory: on CPUs, where activations are
    allocated this way too, steps are slower (docs/benchmarks.md, Memory per rank); on GPUs the
    training allocations are CUDA's. Not glibc (musl, macOS): its allocator's own policy stands."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedModel(FullModel):
    """FullModel's contract, with the model sharded across the job's ranks."""

    collective = True

    def __init__(self, cfg: Config, worker: int, task: Runner, ranks: Ranks) -> None:
        super().__init__(cfg, worker, task)
        self.ranks = ranks
        return_freed_memory()
        self._sharded: dict[str, int] = {}  # each sharded tensor of the model (by name): its rows (dim 0)

    def build(self, device: torch.device) -> torch.nn.Module:
        """Built on the meta device, sharded, and only then given memory on `device`: each rank holds
        its shard alone, never the whole model (R whole copies in a node's host memory, otherwise)."""
        with weights_on_meta():
            model = self.task.build_model(pretrained=False)
        buffers = dict(model.named_buffers())  # to_empty gives the module new tensors; these stay
        shard(model)
        model.to_empty(device=device)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        self._sharded = {k: v.shape[0] for k, v in self.own(model).items() if isinstance(v, DTensor) and v.dim()}
        return model

    def own(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's state-dict tensors (DTensors where sharded), tied aliases once, by name."""
        aliases = tied_aliases(model)
        return {k: v for k, v in sorted(model.state_dict().items()) if k not in aliases}

    def _rows(self, name: str) -> tuple[int, int] | None:
        """This rank's rows of tensor (or AdamW slot `param::slot`) `name`; None: held whole."""
        total = self._sharded.get(name.rpartition(SEP)[0] if SEP in name else name)
        return None if total is None else chunk(total, self.ranks.rank, self.ranks.world)

    def reader(self, ranks: Ranks) -> Reader:
        """Each rank reads its rows of every sharded tensor; rank 0 alone the error-feedback buffer."""
        def want(name: str, shape: tuple[int, ...]) -> bool | tuple[int, int]:
            if name.startswith(FEEDBACK):
                return ranks.lead  # the buffer is rank 0's, whole
            rows = self._rows(name) if shape else None
            return True if rows is None else rows
        return Reader(ranks, want)

    def save(self, storage: Storage, key: str, tensors: dict[str, torch.Tensor], manifest: dict[str, Any]) -> None:
        """Every rank writes its file of the set at `key` (a collective); rank 0 commits it once all are whole."""
        ranks, problem = self.ranks, None
        if ranks.lead:
            try:
                remove_checkpoint(storage, key)  # an older set here is unpublished before its files change
            except IslandsError as exc:
                problem = str(exc)
        if (problem := ranks.lead_says(problem)) is not None:
            raise IslandsError(problem)
        entry: Any = None
        try:
            rows = {k: (*r, self._sharded[k.rpartition(SEP)[0] if SEP in k else k]) for k, t in tensors.items()
                    if t.dim() and (r := self._rows(k)) is not None}
            entry = write_shard(storage, key, ranks.rank, ranks.world, tensors, rows, manifest)
        except (IslandsError, OSError) as exc:
            entry = f"rank {ranks.rank}: {exc}"
        entries = ranks.gather(entry)
        if problems := [e for e in entries if isinstance(e, str)]:
            raise IslandsError(f"{storage.display(key)} not written: " + "; ".join(problems))
        if ranks.lead:
            try:
                commit_shards(storage, key, entries, manifest)
            except IslandsError as exc:
                problem = str(exc)
        if (problem := ranks.lead_says(problem)) is not None:
            raise IslandsError(problem)

    def load_base(self, storage: Storage, key: str, model: torch.nn.Module, resuming: bool,
                  alloc: HostBuffers | None = None) -> None:
        """The base, tensor by tensor: rank 0 reads each (in file order, so that the digest is
        checked in the same pass) and broadcasts it; every rank keeps its rows."""
        if resuming:
            return None
        ranks, own, label = self.ranks, self.own(model), f"base weights for worker {self.worker}"
        ck, whole, order, problem = None, None, None, None
        if ranks.lead:
            try:
                ck = open_checkpoint(storage, key, label)
                if codec.encoding_of(ck.metadata, label) is not None:  # its own coded contribution: decoded whole
                    ck.close()
                    ck, whole = None, codec.load_weights(storage, key, label)
                specs = whole if whole is not None else {s.name: torch.empty(s.shape, dtype=s.torch_dtype, device="meta")
                                                         for s in sorted(ck.specs.values(), key=lambda s: s.start)}
                check_fit(model, specs, storage.display(key))
                order = [n for n in specs if n in own]  # file order
            except CheckpointError as exc:
                problem = str(exc)
        try:
            if (problem := ranks.lead_says(problem)) is not None:
                raise CheckpointError(problem)
            with torch.no_grad():
                for name in ranks.lead_says(order):
                    v = own[name]
                    local = _local(v)
                    full = torch.empty(v.shape, dtype=v.dtype, device=local.device)
                    if ranks.lead and problem is None:
                        try:
                            full.copy_(whole[name] if whole is not None else ck.get(name))
                        except CheckpointError as exc:  # the others still wait for this tensor: said below
                            problem = str(exc)
                    dist.broadcast(full, src=0)
                    rows = self._rows(name)
                    local.copy_(full if rows is None else full[rows[0]:rows[1]])
            if ck is not None and problem is None:
                try:
                    ck.verify()
                except CheckpointError as exc:
                    problem = str(exc)
            if (problem := ranks.lead_says(problem)) is not None:
                raise CheckpointError(problem)
        finally:
            if ck is not None:
                ck.close()
        return None

    def gathered(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole weights, one tensor at a time (fp32, CPU), in name order: a collective, so every
        rank must run it to its end."""
        for name, v in self.own(model).items():
            full = v.full_tensor() if isinstance(v, DTensor) else v
            yield name, full.detach().to("cpu", torch.float32 if full.is_floating_point() else full.dtype)

    def shapes(self, model: torch.nn.Module) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """(dtype as published, whole shape) of every tensor `gathered` yields, in its order."""
        return {k: (torch.float32 if v.is_floating_point() else v.dtype, tuple(v.shape)) for k, v in self.own(model).items()}

    def published(self, model: torch.nn.Module, host: HostBuffers | None) -> dict[str, torch.Tensor]:
        """This rank's rows of the weights (the in-flight checkpoint's part of them)."""
        return {k: _local(v).detach().to("cpu", copy=True) for k, v in self.own(model).items()}

    def load_trained(self, model: torch.nn.Module, tensors: dict[str, torch.Tensor], label: str) -> None:
        """This rank's rows of the weights (from an in-flight checkpoint) into its shards."""
        own = {k: _local(v) for k, v in self.own(model).items()}
        problems = [f"missing tensor {k}" for k in own if k not in tensors]
        problems += [f"unexpected tensor {k}" for k in tensors if k not in own]
        problems += [f"tensor {k} has rows {list(tensors[k].shape)}, rank {self.ranks.rank}'s shard {list(v.shape)}"
                     for k, v in own.items() if k in tensors and tensors[k].shape != v.shape]
        if (problem := self.ranks.first("; ".join(problems[:8]) or None)) is not None:
            raise CheckpointError(f"{label} does not fit the model: {problem}")
        with torch.no_grad():
            for k, v in own.items():
                v.copy_(tensors[k])

    def optimizer_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer, names: list[str],
                        host: HostBuffers | None = None) -> dict[str, torch.Tensor]:
        """This rank's rows of the AdamW state (whole step counts), keyed `param<SEP>slot`."""
        return {f"{names[idx]}{SEP}{slot}": _local(torch.as_tensor(t)).detach().to("cpu", copy=True)
                for idx, slots in opt.state_dict()["state"].items() for slot, t in slots.items()}

    def load_optimizer(self, model: torch.nn.Module, opt: torch.optim.Optimizer, names: list[str],
                       tensors: dict[str, torch.Tensor], label: str) -> None:
        """This rank's rows of the AdamW state into its shards (as DTensors like the parameters)."""
        params, index = dict(model.named_parameters()), {n: i for i, n in enumerate(names)}
        state: dict[int, dict[str, torch.Tensor]] = {}
        problems = []
        for key, t in tensors.items():
            name, _, slot = key.rpartition(SEP)
            p = params.get(name)
            if p is None or name not in index:
                problems.append(f"optimizer state for unknown parameter {name}; the model changed since it was "
                                "written: start a new run")
                continue
            if isinstance(p, DTensor) and t.dim():
                if t.shape != p.to_local().shape:
                    problems.append(f"{key} has rows {list(t.shape)}, rank {self.ranks.rank}'s shard {list(p.to_local().shape)}")
                    continue
                t = DTensor.from_local(t.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                       run_check=False)
            state.setdefault(index[name], {})[slot] = t
        if (problem := self.ranks.first("; ".join(problems[:4]) or None)) is not None:
            raise CheckpointError(f"{label}: {problem}")
        sd = opt.state_dict()
        sd["state"] = state
        opt.load_state_dict(sd)


def params_for(cfg: Config, worker: int, ranks: Ranks, device: torch.device, task: Runner) -> Params:
    """What a worker trains and publishes: the whole model, LTE's heads, or the model sharded across ranks."""
    if cfg.algorithm == "lte":
        return LoraHeads(cfg, worker, task)
    if ranks.world > 1 and sharded(cfg, device):
        return ShardedModel(cfg, worker, task, ranks)
    return FullModel(cfg, worker, task)
