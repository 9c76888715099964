"""`orchestrate eval CHECKPOINT...`: held-out loss of checkpoints, and of their output-space ensemble.

A checkpoint is a safetensors file written by islands (any fsspec URL; the model is rebuilt from
its metadata) or a run directory, meaning its final model (or, while the run is going, its latest
global model). The held-out batches are the ones the merge service evaluates on, taken from the
config of the run the first checkpoint belongs to (or `--run`), so a run's final model scores
exactly its last round's eval loss.

The ensemble (lo-fi's "ensemble" row) averages the models' next-byte *probabilities*, not their
weights: loss = -mean log(1/K sum_k softmax(logits_k)[target]). Every loss, single or ensemble, is
computed by the same function, so the ensemble of one model is that model's loss exactly.
"""
from __future__ import annotations

import dataclasses
import math
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from core.checkpoint import TensorFile, read_manifest
from core.config import Config
from core.errors import CheckpointError, RunError
from core.layout import SAFETENSORS, RunLayout, manifest_key
from core.storage import Storage
from orchestrator.runstate import load_run
from worker.data import dataset_for, eval_batches
from worker.tasks import Ensemble, task_for
from worker.weights import MODEL_META, load_model, load_weights

L = RunLayout()


@dataclass(frozen=True)
class Target:
    label: str  # what the user typed, plus which checkpoint of a run was taken
    url: str  # the checkpoint file, or a Hugging Face model folder
    run: str | None  # the run directory it belongs to, if any
    hf: bool = False  # url is a Hugging Face folder (a run's final/hf): loaded with from_pretrained


def _latest_global(storage: Storage) -> str | None:
    names = set(storage.list("global"))
    rounds = [r for n in names if (r := L.parse_round(n, "round")) is not None
              and manifest_key(L.global_weights(r)).rsplit("/", 1)[-1] in names]
    return L.global_weights(max(rounds)) if rounds else None


def _run_of(url: str, levels: int = 4) -> str | None:
    """The run directory holding a checkpoint file (RUN/final/x, RUN/global/x, RUN/rounds/r/contrib/x)."""
    here = posixpath.dirname(url.rstrip("/"))
    for _ in range(levels):
        if here and Storage(here).exists(L.CONFIG):
            return here
        parent = posixpath.dirname(here)
        if parent == here or parent.endswith(":/") or not parent:
            return None
        here = parent
    return None


def resolve(arg: str) -> Target:
    """A run directory (its final model, else its latest global model) or a checkpoint file."""
    storage = Storage(arg)
    if storage.exists(L.CONFIG):
        key = L.FINAL if storage.exists(manifest_key(L.FINAL)) else _latest_global(storage)
        if key is None:
            raise RunError(f"run {storage.display()} has no global model yet")
        label = arg if key == L.FINAL else f"{arg} ({key})"
        return Target(label, posixpath.join(storage.url, key), storage.url)
    if storage.exists("config.json") and storage.exists("model.safetensors"):  # final/hf, or a copy of it
        if storage.local_path("") is None:
            raise RunError(f"{arg}: a Hugging Face folder is read from this machine's disk; copy it here, or give "
                           "the run directory")
        return Target(arg, storage.url, _run_of(storage.url.rstrip("/") + "/model.safetensors"), hf=True)
    root, name = posixpath.split(storage.url)
    if not Storage(root or ".").exists(name):
        raise RunError(f"{arg}: no such file or directory; give a run directory or the path of a .safetensors "
                       "checkpoint")
    if name.endswith(SAFETENSORS):
        return Target(arg, storage.url, _run_of(storage.url))
    raise RunError(f"{arg} is neither a run directory (no {L.CONFIG}) nor a checkpoint file ({SAFETENSORS}) nor a "
                   "Hugging Face folder (config.json and model.safetensors); give one of those")


def load(target: Target, run: str | None = None) -> torch.nn.Module:
    """The model of a checkpoint: rebuilt from its metadata (global and final models carry it), or
    from the config of its run, else of `run` (`--run`): workers' contributions, and a manual merge
    of them written anywhere, carry none. A Hugging Face folder: from_pretrained, as the run's model.hf."""
    if target.hf:
        return _load_hf(target, run)
    root, name = posixpath.split(target.url)
    storage = Storage(root or ".", follow_links=True)  # a path the user names
    config_of = target.run or run
    with TensorFile(storage, name, read_manifest(storage, name), label=target.label) as ck:
        if MODEL_META in ck.metadata or config_of is None:
            tensors = None
        else:
            tensors = ck.load_all(verify=ck.manifest is not None)
    if tensors is None:
        return load_model(target.url)
    model = task_for(load_run(Storage(config_of))).build_model(pretrained=False)
    load_weights(model, tensors, target.label)
    return model


def _load_hf(target: Target, run: str | None) -> torch.nn.Module:
    """A run's final/hf (or a copy of it) as the run's own model.hf is loaded: its config says the
    block size, the folder gives the weights."""
    config_of = target.run or run
    if config_of is None:
        raise RunError(f"{target.label}: a Hugging Face folder outside a run; give the run it came from with --run RUN")
    cfg = load_run(Storage(config_of))
    if cfg.task != "lm" or cfg.model.hf is None:
        raise RunError(f"{target.label}: evaluating a Hugging Face folder needs a task lm run with model.hf (this "
                       f"run's task is {cfg.task}); evaluate the run directory or its final/model.safetensors")
    from worker import hf
    return hf.build(dataclasses.replace(cfg.model, hf=Storage(target.url).local_path("")), pretrained=True)


# -- the maths: one function for single models and the ensemble ---------------------------------
def nll(log_probs: Sequence[torch.Tensor], targets: torch.Tensor) -> float:
    """Mean negative log-likelihood of `targets` under the average of the given distributions
    (log-probabilities of shape (B, T, V)); one distribution is just that model's loss."""
    stacked = torch.stack([lp.double() for lp in log_probs])
    mixed = torch.logsumexp(stacked, dim=0) - math.log(len(log_probs))
    return float(-mixed.gather(-1, targets.unsqueeze(-1)).mean())


def ensemble_losses(models: Sequence[torch.nn.Module], batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
                    ) -> tuple[list[float], float]:
    """Each model's mean loss over the batches and the ensemble's (mean of per-batch means,
    as the service's eval, worker.tasks.Runner.evaluate, computes it)."""
    singles = [0.0] * len(models)
    mixed = 0.0
    for m in models:
        m.eval()
    with torch.no_grad():
        for x, y in batches:
            lps = [F.log_softmax(m(x)[0].float(), dim=-1) for m in models]
            for i, lp in enumerate(lps):
                singles[i] += nll([lp], y)
            mixed += nll(lps, y)
    return [s / len(batches) for s in singles], mixed / len(batches)


def row(label: str, loss: float, per: str = "byte") -> dict[str, Any]:
    """One model's figures; `per`: what the loss is per (a byte, or a tokenizer's token)."""
    return {"checkpoint": label, "loss": round(loss, 5), "perplexity": round(math.exp(loss), 4),
            f"bits_per_{per}": round(loss / math.log(2), 5)}


# -- I/O ----------------------------------------------------------------------------------------
def data_config(targets: Sequence[Target], run: str | None) -> tuple[Config, str]:
    """The config whose held-out split and seed define the eval data, and where it came from."""
    where = run or next((t.run for t in targets if t.run), None)
    if where is None:
        return Config(), "defaults (no run directory found: the standard library corpus, seed 0)"
    return load_run(Storage(where)), f"{Storage(where).display()}/{L.CONFIG}"


def evaluate_checkpoints(args: Sequence[str], batches: int | None = None, run: str | None = None,
                         cache_dir: str | None = None) -> dict[str, Any]:
    """Losses of every checkpoint and, for two or more, of their ensemble (what `--json` prints)."""
    if not args:
        raise RunError("give at least one checkpoint or run directory to evaluate")
    targets = [resolve(a) for a in args]
    cfg, source = data_config(targets, run)
    if cfg.task != "lm":
        return _task_metrics(targets, cfg, source, batches or cfg.data.eval_batches, run)
    models = [load(t, run) for t in targets]
    if len({m.vocab_size for m in models}) > 1:
        raise CheckpointError("the checkpoints have different vocabularies: "
                              + ", ".join(f"{t.label}: {m.vocab_size}" for t, m in zip(targets, models)))
    block = min([cfg.model.block_size] + [m.block_size for m in models])
    n = batches or cfg.data.eval_batches
    data = eval_batches(dataset_for(cfg, cache_dir), block, cfg.inner.batch_size, n, cfg.seed)
    singles, mixed = ensemble_losses(models, data)
    per = cfg.loss_per or "byte"
    return {"data": {"config": source, "batches": n, "batch_size": cfg.inner.batch_size, "block_size": block,
                     "tokens": n * cfg.inner.batch_size * block, "loss_per": per},
            "models": [row(t.label, v, per) for t, v in zip(targets, singles)],
            "ensemble": row(f"ensemble of {len(models)} (mean of probabilities)", mixed, per) if len(models) > 1 else None}


def _task_metrics(targets: Sequence[Target], cfg: Config, source: str, n: int, run: str | None) -> dict[str, Any]:
    """A task's own metrics (loss, and e.g. accuracy) for each model and their ensemble, on its eval batches."""
    runner = task_for(cfg)
    models = [load(t, run) for t in targets]
    data = runner.eval_batches(n, cfg.inner.batch_size)
    rows = [{"checkpoint": t.label, **_rounded(runner.evaluate(m, data))} for t, m in zip(targets, models)]
    ensemble = None
    if len(models) > 1:
        ensemble = {"checkpoint": f"ensemble of {len(models)} (mean of probabilities)",
                    **_rounded(runner.evaluate(Ensemble(models), data))}
    return {"data": {"config": source, "task": cfg.task, "batches": len(data), "batch_size": cfg.inner.batch_size},
            "models": rows, "ensemble": ensemble}


def _rounded(metrics: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 5) for k, v in metrics.items()}
