"""What a run trains and how it is scored: the task interface (docs/tasks.md).

A task is a class named in the config, `task: package.module:Class`, built in every process with
the run's Config (`Class(cfg)`). islands calls these, and nothing else:

    model()                the model, freshly initialised (islands loads the round's weights over it)
    examples(split)        a sequence (len() and [i]) of examples; split is "train" or "eval"
    collate(examples)      a batch: a tensor, or a tuple, list or dict of tensors (islands moves it
                           to the device and gives each rank of a job its rows)
    loss(model, batch)     a scalar tensor to minimise; call `model(...)` inside (it may be wrapped
                           in DDP, or carry LoRA heads: the task never knows)
    metrics(model, batch)  optional: {name: float} on one eval batch, averaged over the eval set
                           (the loss is always measured: a task need not report it)

Everything else is islands': the worker's share of the examples and its batches (a pure function
of (seed, worker, step), as for token data), AdamW and the outer step, LoRA heads (lte), ranks,
checkpoints, requeue, overlap, replay, merge, eval, report.

The shape is LightningModule's (a class whose methods the framework calls) without its loop hooks,
since islands owns the loop; torchtitan's TrainSpec and timm's/Hugging Face's factories also name
builders rather than hand over a loop. A class named by import path, as submitit runs a function by
reference. The built-in tasks live here too: `lm` (worker/tasks/lm.py: the built-in GPT or a Hugging
Face causal LM on a prepared token dataset) and `digits` (worker/tasks/digits.py: a ViT on images,
written exactly as a user's task is). The loop, LTE, the ranks and the eval see only a `Runner`.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from core.config import Config
from core.trust import stranger
from core.errors import IslandsError
from core.records import text
from worker.data import Deal, step_generator

BUILTIN = {"lm": "worker.tasks.lm:LanguageModel", "digits": "worker.tasks.digits:Digits"}  # core.config_parse.BUILTIN_TASKS
REQUIRED = ("model", "examples", "collate", "loss")


class TaskError(IslandsError):
    """A task that cannot be imported, misses a method, or gives what islands cannot train on."""


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`fn` applied to every tensor of a batch (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(b, fn) for b in batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    return batch


class Runner:
    """What islands calls on a task. Two kinds: token data read in place (worker/tasks/lm.py) and
    indexable examples (Examples, below)."""

    name: str

    def build_model(self, pretrained: bool = True) -> torch.nn.Module:
        raise NotImplementedError

    def sampler(self, worker: int, num_workers: int, batch_size: int) -> Any:
        """An object whose batch(step) is this worker's batch at `step`, with tokens_per_batch."""
        raise NotImplementedError

    def eval_batches(self, n: int, batch_size: int) -> list[Any]:
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module, batches: Sequence[Any]) -> dict[str, float]:
        """Mean of each metric over `batches`, in eval mode without gradients ("loss" first)."""
        if not batches:
            raise ValueError("evaluate got no eval batches (data.eval_batches >= 1)")
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        sums: dict[str, float] = {}
        try:
            with torch.no_grad():
                for batch in batches:
                    for k, v in self.batch_metrics(model, map_tensors(batch, lambda t: t.to(device))).items():
                        sums[k] = sums.get(k, 0.0) + v
        finally:
            model.train(was_training)
        return {k: v / len(batches) for k, v in sums.items()}

    def batch_metrics(self, model: torch.nn.Module, batch: Any) -> dict[str, float]:
        return {"loss": float(self.loss(model, batch))}

    def metadata(self) -> dict[str, str]:
        """What a checkpoint of this task's model carries to be rebuilt from it (safetensors metadata)."""
        return {"islands.task": self.name}

    def check(self) -> None:
        """Try the task once on the CPU before a run is made (`orchestrate submit`); TaskError if it fails."""

    def describe_data(self) -> str:
        """One line for the start of a run: which data each worker reads."""
        raise NotImplementedError


class ExampleSampler:
    """A worker's batches from indexable examples: its share is every K-th index of a seeded affine
    permutation (disjoint, covering, balanced to one example); batch(step) draws from the share with a
    generator seeded by (seed, worker, step), so a requeued or replayed worker sees the same batches."""

    def __init__(self, train: Sequence[Any], collate: Callable[[list[Any]], Any], seed: int, worker: int,
                 num_workers: int, batch_size: int) -> None:
        n = len(train)
        if n < num_workers:
            raise TaskError(f"{n} train examples cannot be shared by {num_workers} workers; use fewer workers or "
                            "more examples")
        self.train, self.collate, self.seed, self.worker, self.batch_size = train, collate, seed, worker, batch_size
        self.deal = Deal.share(n, seed, worker % num_workers, num_workers)  # as the token data deals its segments
        self.tokens_per_batch = batch_size  # examples: what weighs a contribution

    def indices(self, step: int) -> list[int]:
        picks = torch.randint(0, self.deal.count, (self.batch_size,), generator=step_generator(self.seed, self.worker, step))
        return [self.deal.item(p) for p in picks.tolist()]

    def batch(self, step: int) -> Any:
        return self.collate([self.train[i] for i in self.indices(step)])


class Examples(Runner):
    """A task of indexable examples (the interface above), checked as it is used."""

    def __init__(self, task: Any, name: str, cfg: Config) -> None:
        self.task, self.name, self.cfg = task, name, cfg

    def build_model(self, pretrained: bool = True) -> torch.nn.Module:
        model = self.task.model()
        if not isinstance(model, torch.nn.Module):
            raise TaskError(f"task {self.name}: model() returned {type(model).__name__}, not a torch.nn.Module")
        return model

    def check(self) -> None:
        _check_examples(self, self.cfg)

    def describe_data(self) -> str:
        n, k = len(self.task.examples("train")), self.cfg.workers
        return (f"data: task {self.name}, {n:,} train examples; iid: each of the {k} workers draws from its own "
                f"1/{k} of them (dealt at random by seed {self.cfg.seed})")

    def sampler(self, worker: int, num_workers: int, batch_size: int) -> ExampleSampler:
        if self.cfg.data.sharding != "iid":
            raise TaskError(f"task {self.name}: data.sharding {self.cfg.data.sharding} needs groups, which a task of "
                            "examples does not have; use data.sharding iid")
        try:
            return ExampleSampler(self.task.examples("train"), self.task.collate, self.cfg.seed, worker, num_workers,
                                  batch_size)
        except TaskError as exc:
            raise TaskError(f"task {self.name}: {exc}") from None

    def eval_batches(self, n: int, batch_size: int) -> list[Any]:
        """n batches of evenly spaced eval examples (every one of them when there are fewer)."""
        held = self.task.examples("eval")
        if len(held) == 0:
            raise TaskError(f"task {self.name}: examples('eval') is empty; hold some examples out for the eval")
        take = min(len(held), n * batch_size)
        idx = [round(i * (len(held) - 1) / max(1, take - 1)) for i in range(take)]
        return [self.task.collate([held[i] for i in idx[b:b + batch_size]]) for b in range(0, take, batch_size)]

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        loss = self.task.loss(model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TaskError(f"task {self.name}: loss() returned {shape}, not a scalar tensor; reduce it (e.g. .mean())")
        return loss.reshape(())

    def batch_metrics(self, model: torch.nn.Module, batch: Any) -> dict[str, float]:
        out = {"loss": float(self.loss(model, batch))}
        if hasattr(self.task, "metrics"):
            got = self.task.metrics(model, batch)
            if not isinstance(got, dict) or not all(isinstance(k, str) and isinstance(v, (int, float, torch.Tensor))
                                                    for k, v in got.items()):
                raise TaskError(f"task {self.name}: metrics() must return {{name: number}}, got {str(got)[:80]}")
            bad = [k for k in got if not METRIC_NAME.fullmatch(k)]
            if bad:  # names reach terminals, reports and TensorBoard: no escape codes, no paths
                raise TaskError(f"task {self.name}: metric name {bad[0][:40]!r} is not a short name (letters, digits, "
                                "'_', '-', '.', '/', at most 64): rename it")
            out.update({k: float(v) for k, v in got.items() if k != "loss"})
        return out


class Ensemble(torch.nn.Module):
    """Models as one (lo-fi's ensemble row): its output is the log of the members' mean probability,
    softmax over the last dimension of each one's logits (its output, or the output's `.logits`). A
    loss that reads logits then scores the ensemble (cross-entropy of log mean probabilities is the
    ensemble's negative log-likelihood), and their argmax is its prediction."""

    def __init__(self, models: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        self.members = torch.nn.ModuleList(models)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        outs = [m(*args, **kwargs) for m in self.members]
        logits = [getattr(o, "logits", o) for o in outs]
        if not all(isinstance(t, torch.Tensor) for t in logits):
            raise TaskError("an ensemble needs models that return logits (a tensor, or an output with .logits); "
                            f"this one returns {type(outs[0]).__name__}")
        logp = torch.stack([torch.log_softmax(t.float(), dim=-1) for t in logits])
        mixed = torch.logsumexp(logp, dim=0) - math.log(len(logits))
        if hasattr(outs[0], "logits"):
            outs[0].logits = mixed
            return outs[0]
        return mixed


METRIC_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]{0,63}")
"""What a task's metric may be called."""


def _trusted(path: str, name: str) -> None:
    """TaskError when the task_path folder (or the module in it) is someone else's or writable by
    others: whoever can write it runs code as you in every worker and in the service."""
    for p in [Path(path), *Path(path).glob(name.split(".")[0] + "*")][:8]:
        try:
            who = stranger(os.stat(p))
        except OSError:
            continue
        if who is not None:
            fix = "copy the task into a folder of your own" if who.startswith("belongs") else f"chmod go-w {p}"
            raise TaskError(f"task_path {p} {who}: its code runs as you in every worker; {fix}")


def _import(name: str, path: str | None) -> type:
    spec = BUILTIN.get(name, name)
    module_name, _, attr = spec.partition(":")
    if path is not None:
        _trusted(path, module_name)
        if path not in sys.path:
            sys.path.insert(0, path)
        top = sys.modules.get(module_name.split(".")[0])
        if top is not None and not Path(getattr(top, "__file__", None) or "/").resolve().is_relative_to(Path(path).resolve()):
            for loaded in [m for m in sys.modules if m == top.__name__ or m.startswith(top.__name__ + ".")]:
                del sys.modules[loaded]  # a module of that name from elsewhere, imported before in this process
    # The module sees a command line of its own (no arguments), not islands': one that parses
    # sys.argv when imported (argparse at module level) would read `submit --workers 8`. What it
    # prints while importing is said once it is known whether the import worked.
    argv, said = sys.argv, io.StringIO()
    sys.argv = [module_name]
    try:
        with contextlib.redirect_stderr(said):
            module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # noqa: BLE001  whatever a user's module raises (or exits) while importing
        where = f" (task_path {path})" if path else " (installed in this environment, or set task_path)"
        what = f"it called exit({exc.code!r})" if isinstance(exc, SystemExit) else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, SystemExit) and (err := text(said.getvalue().strip(), 600)):
            what += (f", saying {err!r}; a module that reads the command line when imported belongs under "
                     "`if __name__ == \"__main__\":`")
        raise TaskError(f"task {name}: cannot import {module_name}{where}: {what}") from None
    finally:
        sys.argv = argv
    sys.stderr.write(said.getvalue())
    cls = getattr(module, attr, None)
    if cls is None:
        raise TaskError(f"task {name}: {module_name} has no {attr!r}")
    if isinstance(cls, type) and issubclass(cls, Runner):  # a runner itself (lm: token data read in place)
        return cls
    missing = [m for m in REQUIRED if not callable(getattr(cls, m, None))]
    if missing:
        raise TaskError(f"task {name}: {attr} has no {', '.join(missing)} method(s); a task defines "
                        f"{', '.join(REQUIRED)} (and optionally metrics): docs/tasks.md")
    return cls


def task_for(cfg: Config) -> Runner:
    """The run's task, built for this process."""
    cls = _import(cfg.task, cfg.task_path)
    if isinstance(cls, type) and issubclass(cls, Runner):
        return cls(cfg)
    try:
        task = cls(cfg)
    except IslandsError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise TaskError(f"task {cfg.task}: {getattr(cls, '__name__', cls)!s:.80}(cfg) failed: {type(exc).__name__}: {exc}") from None
    return Examples(task, cfg.task, cfg)


def _check_examples(runner: Examples, cfg: Config) -> None:
    """Build the task once on the CPU and try it: model, a batch, its loss (a finite scalar with a
    gradient), the eval's metrics, and the same parameters on a second build (a model whose names
    change would not load the next round's weights)."""
    name = runner.name
    try:
        torch.manual_seed(cfg.seed)
        model = runner.build_model()
        again = runner.build_model()
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if shapes != {k: tuple(v.shape) for k, v in again.state_dict().items()}:
            raise TaskError(f"task {name}: model() built different parameters on a second call; every call must build "
                            "the same architecture (names and shapes), or one round's weights cannot load into the next")
        for split in ("train", "eval"):
            if len(runner.task.examples(split)) == 0:
                raise TaskError(f"task {name}: examples({split!r}) is empty")
        batch = runner.sampler(0, cfg.workers, max(1, min(2, cfg.worker_batch_size))).batch(0)
        loss = runner.loss(model, batch)
        if not math.isfinite(float(loss.detach())):
            raise TaskError(f"task {name}: loss() is {float(loss.detach())} on the first batch of freshly built weights")
        if not loss.requires_grad:
            raise TaskError(f"task {name}: loss() has no gradient (computed without the model, or under no_grad)")
        metrics = runner.evaluate(model, runner.eval_batches(1, 2))
        bad = [k for k, v in metrics.items() if not math.isfinite(v)]
        if bad:
            raise TaskError(f"task {name}: metrics {bad} are not finite on the eval")
    except IslandsError:
        raise
    except Exception as exc:  # noqa: BLE001  a bug in the user's code: named, with where it was
        raise TaskError(f"task {name}: trying it on the CPU failed: {type(exc).__name__}: {exc}") from None
