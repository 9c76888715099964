"""A worker as a whole node: the ranks of one job joined by torch.distributed.

A worker job runs one task per device of its node (executor.tasks_per_node); submitit starts them
and its JobEnvironment names each one's rank (join() says how they meet). They train one model:
with DistributedDataParallel every rank holds the whole model and its AdamW state (with FSDP2,
worker/sharded.py, a shard of them), takes its slice of the worker's batch, and the gradients are
averaged, so the worker's batch, data and maths are those of a one-process worker. Rank 0 alone
writes to storage (contribution, state file, heartbeat, in-flight checkpoint), and what it writes
is whole, so a requeued job resumes on any number of ranks. A one-task job never starts
torch.distributed.

Collectives carry a timeout (COLLECTIVE_TIMEOUT_S): a rank that dies fails the job instead of
leaving the others waiting. Decisions (rank 0's word, a preemption flag) travel over gloo on the
CPU, a second group beside NCCL on GPUs, so that asking never waits for the GPU.
"""
from __future__ import annotations

import datetime
import hashlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from core.errors import IslandsError

log = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT_S = 600  # above a round's longest step or storage read; a dead peer fails sooner on gloo
JOIN_TIMEOUT_S = 120  # every task of a job starts within seconds of the others


@dataclass(frozen=True)
class Ranks:
    """This process's place in its worker job."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    control: Any = field(default=None, compare=False)  # the gloo group for decisions (None: the default group)

    @property
    def lead(self) -> bool:
        """Rank 0: the one that writes to storage."""
        return self.rank == 0

    def slice(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a worker batch (the batch size is a multiple of the world size)."""
        n = x.shape[0] // self.world
        return x[self.rank * n:(self.rank + 1) * n]

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean over ranks (the worker's loss from each rank's slice loss)."""
        if self.world == 1:
            return t
        t = t.clone()
        dist.all_reduce(t)
        return t / self.world

    def lead_says(self, value: Any) -> Any:
        """Rank 0's `value` on every rank: one decision for the job (which round, whether to stop)."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, by rank, on every rank (small objects: a problem, a manifest)."""
        if self.world == 1:
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.control)
        return out

    def first(self, value: Any) -> Any:
        """The first rank's `value` that is not None, on every rank (one rank's problem fails them all)."""
        return next((v for v in self.gather(value) if v is not None), None)

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any (one small all-reduce on the CPU)."""
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return bool(t.item())


SOLO = Ranks()
_JOINED: Ranks | None = None


def job_tasks() -> int:
    """How many tasks this job has (1 outside a submitit job)."""
    if "SUBMITIT_LOCAL_NTASKS" in os.environ or "SLURM_NTASKS" in os.environ:
        import submitit
        try:
            return submitit.JobEnvironment().num_tasks
        except RuntimeError:  # not a submitit job after all (an sbatch script running python by hand)
            return 1
    return 1


def join(device_type: str) -> Ranks:
    """Join this job's process group (once per process; a persistent worker keeps it between rounds).

    Ranks and job id come from submitit's JobEnvironment. The rendezvous is on 127.0.0.1 (a worker
    is one node, whose name may not resolve) at a port derived from the job id and its requeue count,
    below Linux's ephemeral range (32768+) so that no outgoing connection holds it: submitit's
    TorchDistributedEnvironment takes the first node's name and any port in 20000-60000. A rank
    that never arrives fails the others after JOIN_TIMEOUT_S."""
    global _JOINED
    if _JOINED is not None:
        return _JOINED
    if job_tasks() == 1:
        _JOINED = SOLO
        return SOLO
    import submitit
    env = submitit.JobEnvironment()
    if device_type == "cuda":  # the job sees the node's GPUs: rank i takes the i-th
        _check_gpus(env.job_id, env.num_tasks)
        torch.cuda.set_device(env.local_rank)
    tag = f"{env.job_id}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    port = 20000 + int(hashlib.sha256(tag.encode()).hexdigest(), 16) % 12000
    store = dist.TCPStore("127.0.0.1", port, env.num_tasks, is_master=env.global_rank == 0,
                          timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=store, rank=env.global_rank,
                            world_size=env.num_tasks, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    # decisions over gloo on the CPU: with NCCL, each would be a GPU sync
    control = dist.new_group(backend="gloo") if device_type == "cuda" else None
    _JOINED = Ranks(env.global_rank, env.num_tasks, env.local_rank, control)
    log.info("rank %d of %d joined (%s, 127.0.0.1:%d)", env.global_rank, env.num_tasks, dist.get_backend(), port)
    return _JOINED


def _check_gpus(job_id: str, tasks: int) -> None:
    """One GPU per rank (NCCL refuses two ranks on one GPU), checked by every rank: each fails at
    once, none waits for a peer that never comes."""
    gpus = torch.cuda.device_count()
    if tasks > gpus:
        raise IslandsError(f"worker job {job_id} runs {tasks} ranks on this node but it sees {gpus} GPU(s) "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); one rank per "
                           f"GPU: set executor.tasks_per_node to at most executor.gpus_per_node (0 takes "
                           f"gpus_per_node), or inner.device=cpu")


def data_parallel(model: torch.nn.Module, ranks: Ranks) -> torch.nn.Module:
    """What the training step calls: the model itself, or DDP over it (same parameters)."""
    if ranks.world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel
    ids = [ranks.local_rank] if next(model.parameters()).is_cuda else None
    # no buffer sync each forward: every rank loads the same base, and buffers are not trained
    return DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False)


class Preemption:
    """A preemption signal that a worker's ranks act on between two steps, all at the same one.

    submitit's handler (SIGUSR2, what Slurm sends before a time limit) checkpoints on rank 0 alone,
    wherever the signal found it: in the middle of an optimizer step, some weights are updated and
    some not, and the saved checkpoint resumes to other weights than the run would have had; and
    gathering a sharded model needs every rank at the same point. So while a round trains
    (`deferred`), the handler only notes the signal; after each step the ranks ask one another
    (Ranks.any, in InnerTrainer._asked_to_stop: one signalled rank is enough), save the in-flight checkpoint, and then hand the
    signal to submitit (hand_over). Outside training it goes to submitit at once."""

    def __init__(self, ranks: Ranks, signum: int, submitit_handler: Callable[[int, Any], None]) -> None:
        self.ranks, self.signum, self.submitit_handler = ranks, signum, submitit_handler
        self.deferred = False
        self.signalled = False
        signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.deferred:
            self.signalled = True
            log.warning("rank %d: preemption signal; the in-flight checkpoint follows this step", self.ranks.rank)
        else:
            self.submitit_handler(signum, frame)

    def hand_over(self) -> NoReturn:
        """The in-flight checkpoint is saved: submitit requeues the job from rank 0 and exits; the
        other ranks end here (a requeue ends every task of the job anyway)."""
        self.deferred = False
        self.submitit_handler(self.signum, None)  # rank 0: checkpoint() (saved already), requeue, exit
        log.info("rank %d: stopping for the requeue", self.ranks.rank)
        sys.exit(0)


_PREEMPTION: Preemption | None = None


def preemption(ranks: Ranks) -> Preemption | None:
    """This process's Preemption (one handler per process; a persistent worker's trainers share it);
    None outside a submitit job (no handler to hand the signal to) or off the main thread."""
    global _PREEMPTION
    if _PREEMPTION is None:
        import submitit
        signum = submitit.JobEnvironment._usr_sig()  # USR2, or the job's SUBMITIT_PREEMPT_SIGNAL
        handler = signal.getsignal(signum)
        if threading.current_thread() is not threading.main_thread() or not callable(handler):
            return None
        _PREEMPTION = Preemption(ranks, signum, handler)
    return _PREEMPTION
