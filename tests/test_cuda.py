"""The worker on CUDA: what only a GPU node can run, skipped cleanly without one (CI has none).

Run on a GPU machine with `python -m pytest -q tests/test_cuda.py`. One GPU runs all but the
two-rank NCCL rounds, which need two. The tests without a GPU mark run everywhere: they mock the
machine's GPU count (CI has no GPU) and check what a job is given against it.
"""
from __future__ import annotations

import os

import pytest
import submitit
import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

import worker.train as train
from core.checkpoint import load_checkpoint, read_manifest
from core.config import config_from_dict
from core.errors import IslandsError, RunError
from core.layout import RunLayout
from core.storage import Storage
from core.assignment import Assignment
from orchestrator import executor
from orchestrator.executor import Executor
from orchestrator.run_models import create_run
from orchestrator.slurm import local_gpus
from worker import ranks as worker_ranks
from worker.sharded import shard, weights_on_meta
from worker.weights import build_model

L = RunLayout()
MODEL = {"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 64}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(tmp_path, corpus_cache, name: str, device: str, parallel: str = "ddp") -> Storage:
    c = config_from_dict({"workers": 2, "rounds": 2, "model": MODEL, "data": {"cache_dir": corpus_cache},
                          "inner": {"steps": 8, "batch_size": 8, "warmup_steps": 1, "device": device, "parallel": parallel},
                          "run_dir": str(tmp_path / name)})
    storage = Storage(c.run_dir)
    create_run(storage, c)
    return storage


def _task(storage: Storage) -> Assignment:
    return Assignment(storage.url, 0, 0, L.global_weights(0), threads=2)


def test_a_rank_without_a_gpu_is_refused(monkeypatch):
    """A job of more ranks than the node's GPUs: one clear error naming the settings (the GPU count is
    mocked here: no GPU on this machine; test_more_ranks_than_gpus_are_refused runs it for real)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    worker_ranks._check_gpus("4242", 1)
    with pytest.raises(IslandsError, match=r"worker job 4242 runs 2 ranks on this node but it sees 1 GPU.*"
                                           r"executor.tasks_per_node"):
        worker_ranks._check_gpus("4242", 2)


def test_local_workers_take_their_own_gpus():
    assert [local_gpus(w, 1, 4) for w in range(6)] == [(0,), (1,), (2,), (3,), (0,), (1,)]
    assert [local_gpus(w, 2, 4) for w in range(3)] == [(0, 1), (2, 3), (0, 1)]
    assert local_gpus(3, 1, 1) == (0,) and local_gpus(1, 2, 3) == (0, 1)  # a third GPU left idle, not split


def test_a_local_worker_job_sees_its_gpus_and_none_beyond(tmp_path, monkeypatch, caplog):
    """submitit hides every GPU from a local job it gives none; the executor gives each worker job its
    own (a four-GPU machine, mocked: this machine has none; the job's environment is real)."""
    def see_gpus(task: Assignment) -> str:  # defined here: pickled by value into the job
        return os.environ["CUDA_VISIBLE_DEVICES"]

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(executor, "WorkerJob", lambda: see_gpus)
    cfg = config_from_dict({"workers": 3, "executor": {"kind": "local", "gpus_per_node": 1}})
    ex = Executor(cfg, tmp_path / "jobs")
    ids = ex.submit([Assignment("file:///run", 0, w, L.global_weights(0)) for w in range(3)])
    assert [ex._jobs[i].result() for i in ids] == ["0", "1", "2"]
    none = Executor(config_from_dict({"executor": {"kind": "local"}}), tmp_path / "jobs")
    assert [none._jobs[i].result() for i in none.submit([Assignment("file:///run", 0, 0, L.global_weights(0))])] == [""]
    assert "executor.gpus_per_node=0: local workers see none" in caplog.text
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RunError, match=r"executor.gpus_per_node=1 but this machine has 0 GPU\(s\)"):
        Executor(cfg, tmp_path / "jobs").submit([Assignment("file:///run", 0, 0, L.global_weights(0))])


def test_the_rounds_log_line_names_the_device(tmp_path, corpus_cache, caplog):
    caplog.set_level("INFO", logger="worker.train")
    train.run_worker(_task(_run(tmp_path, corpus_cache, "cpu", "cpu")))
    assert "worker 0 round 0 on cpu: 8 steps" in caplog.text


@gpu
def test_a_worker_round_on_cuda_trains_what_the_cpu_trains(tmp_path, corpus_cache):
    """bf16 autocast and fused AdamW on the GPU against fp32 on the CPU: the same losses to bf16's
    precision, and fp32 weights published."""
    cpu, cuda = _run(tmp_path, corpus_cache, "cpu", "cpu"), _run(tmp_path, corpus_cache, "cuda", "cuda")
    train.run_worker(_task(cpu))
    train.run_worker(_task(cuda))
    m_cpu, m_gpu = read_manifest(cpu, L.contribution(0, 0)), read_manifest(cuda, L.contribution(0, 0))
    assert m_gpu["losses"] == pytest.approx(m_cpu["losses"], rel=2e-2)
    assert m_gpu["losses"][-1] < m_gpu["losses"][0]
    weights, _, _ = load_checkpoint(cuda, L.contribution(0, 0))
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" and t.isfinite().all() for t in weights.values())


@gpu
def test_the_sharded_build_on_cuda_steps_as_the_whole_model(tmp_path):
    """FSDP2 over NCCL (one rank): built on meta, sharded, given CUDA memory with to_empty, buffers
    copied back; loaded with the whole model's weights, one step gives the same loss and gradients."""
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        cfg = config_from_dict({"model": MODEL}).model
        torch.manual_seed(0)
        whole = build_model(cfg).cuda()
        with weights_on_meta():
            sharded = build_model(cfg, pretrained=False)
        buffers = {k: b.clone() for k, b in sharded.named_buffers()}
        shard(sharded)
        sharded.to_empty(device="cuda")
        with torch.no_grad():
            for name, b in sharded.named_buffers():
                b.copy_(buffers[name])
            for name, p in sharded.named_parameters():
                p.copy_(distribute_tensor(dict(whole.named_parameters())[name].detach(),
                                                      p.device_mesh, p.placements))
        x = torch.randint(0, 256, (4, 64), device="cuda")
        losses = []
        for model in (whole, sharded):
            _, loss = model(x, x)
            loss.backward()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)
        for name, p in sharded.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), dict(whole.named_parameters())[name].grad, rtol=1e-4, atol=1e-6)
    finally:
        dist.destroy_process_group()


@gpu
def test_more_ranks_than_gpus_are_refused(tmp_path, corpus_cache):
    """A real job of one rank more than the node's GPUs: every rank fails at once with the clear
    error (not NCCL's, and no rank waits JOIN_TIMEOUT_S for one that failed)."""
    storage = _run(tmp_path, corpus_cache, "run", "cuda")
    ex = submitit.LocalExecutor(folder=tmp_path / "jobs" / "%j")
    ex.update_parameters(tasks_per_node=torch.cuda.device_count() + 1, gpus_per_node=torch.cuda.device_count(),
                         timeout_min=5)
    job = ex.submit(train.run_worker, _task(storage))
    with pytest.raises(submitit.core.utils.FailedJobError, match="one rank per GPU"):
        job.results()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_two_rank_nccl_round_equals_a_one_rank_round(tmp_path, corpus_cache, parallel):
    """Two ranks over NCCL, one GPU each, train what one rank trains (bf16 precision)."""
    one, two = _run(tmp_path, corpus_cache, "one", "cuda", parallel), _run(tmp_path, corpus_cache, "two", "cuda", parallel)
    train.run_worker(_task(one))
    ex = submitit.LocalExecutor(folder=tmp_path / "jobs" / "%j")
    ex.update_parameters(tasks_per_node=2, gpus_per_node=2, timeout_min=5)
    ex.submit(train.run_worker, _task(two)).results()
    m1, m2 = read_manifest(one, L.contribution(0, 0)), read_manifest(two, L.contribution(0, 0))
    assert m2["ranks"] == 2 and m2["tokens"] == m1["tokens"]
    assert m2["losses"] == pytest.approx(m1["losses"], rel=2e-2)
