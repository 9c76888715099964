"""A run's models: the round-0 global weights, the held-out evaluation, the final export (torch)."""
from __future__ import annotations

import logging
import os
import posixpath
import socket
import stat
import time
from pathlib import Path

import torch

from core.checkpoint import load_checkpoint, read_manifest
from core.checkpoint_writer import write_checkpoint
from core.config import Config, to_yaml
from core.errors import RunError
from core.layout import RunLayout, manifest_key
from core.replay import Schedule
from core.storage import Storage
from core.records import RunInfo
from worker.tasks import task_for
from worker.weights import load_weights, weights_of

log = logging.getLogger(__name__)
L = RunLayout()


def create_run(storage: Storage, cfg: Config, schedule: Schedule | None = None) -> None:
    """Write the resolved config and the round-0 global weights (and a replay's schedule) into a new
    run directory."""
    if (root := storage.local_path("")) is not None:
        above = Path(root)
        while not above.exists() and above != above.parent:
            above = above.parent
        if not above.is_dir():
            raise RunError(f"--run-dir {storage.display()}: {above} is a file, not a folder, so no run directory can be "
                           "made under it; choose a run directory in a folder")
    if storage.exists(L.CONFIG):
        raise RunError(f"{storage.display()} already holds a run; `orchestrate resume {storage.display()}` "
                       "continues it, or choose another --run-dir")
    torch.manual_seed(cfg.seed)
    task = task_for(cfg)
    model = task.build_model()
    if cfg.model.init_from:
        root, _, name = cfg.model.init_from.rstrip("/").rpartition("/")
        tensors, _, _ = load_checkpoint(Storage(root or ".", follow_links=True), name, label=f"model.init_from {cfg.model.init_from}")
        load_weights(model, tensors, f"model.init_from {cfg.model.init_from}")
    write_checkpoint(storage, L.global_weights(0), weights_of(model), metadata=task.metadata(),
                     manifest={"round": 0, "init_from": cfg.model.init_from})
    RunInfo(created_at=time.time(), host=socket.gethostname(), params=sum(p.numel() for p in model.parameters())).save(storage)
    if schedule is not None:
        schedule.save(storage)
    storage.write_bytes(L.CONFIG, to_yaml(cfg).encode())  # last: a run exists once its config does


class Evaluator:
    """The task's eval metrics (loss, and e.g. accuracy) of global checkpoints on its held-out data
    (the same batches every round)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.task = task_for(cfg)
        self.metadata = self.task.metadata()
        self._batches: list | None = None

    def batches(self) -> list:
        if self._batches is None:
            self._batches = self.task.eval_batches(self.cfg.data.eval_batches, self.cfg.inner.batch_size)
        return self._batches

    def metrics(self, storage: Storage, key: str) -> dict[str, float]:
        """{"loss": ..., and whatever else the task reports}, rounded to 5 places."""
        model = self.task.build_model(pretrained=False)
        tensors, _, _ = load_checkpoint(storage, key, label=f"global weights {storage.display(key)}")
        load_weights(model, tensors, storage.display(key))
        return {k: round(v, 5) for k, v in self.task.evaluate(model, self.batches()).items()}


def export_final(storage: Storage, cfg: Config) -> None:
    """The last global checkpoint, copied to final/model.safetensors (loads with worker.weights.load_model);
    with model.hf also written as a Hugging Face directory, final/hf (loads with from_pretrained)."""
    _reclaim(storage, posixpath.dirname(L.FINAL))
    last = L.global_weights(cfg.rounds)
    last_m = read_manifest(storage, last)
    final_m = read_manifest(storage, L.FINAL)
    if last_m is None or final_m is None or final_m.get("digest") != last_m.get("digest"):  # not exported yet
        storage.copy(last, L.FINAL)
        storage.write_json(manifest_key(L.FINAL), {**(last_m or {}), "file": L.FINAL.rsplit("/", 1)[-1]})
    if (cfg.model.hf is not None or cfg.task != "lm") and not storage.exists(L.final_hf_file("config.json")):  # last
        model = task_for(cfg).build_model(pretrained=False)
        hf_model = getattr(model, "hf", model)  # model.hf: the causal LM inside islands' wrapper
        if not callable(getattr(hf_model, "save_pretrained", None)):
            return  # a task model that is not a Hugging Face one: final/model.safetensors is its export
        from worker.hf import save_pretrained_dir
        tensors, _, _ = load_checkpoint(storage, L.FINAL, label=f"final model {storage.display(L.FINAL)}")
        load_weights(model, tensors, storage.display(L.FINAL))
        save_pretrained_dir(hf_model, cfg.model.hf, storage, L.FINAL_HF)
        log.info("final model exported as a Hugging Face directory: %s", storage.display(L.FINAL_HF))


def _reclaim(storage: Storage, folder: str) -> None:
    """`folder` (final/) is the run's own: a link or a file planted at its name, or at a name in it,
    is removed (the link itself: where it leads is never touched) and said, so the deliverable is
    written in the run, never through the link and never given up on."""
    if storage.local_path(folder) is None:
        return  # an object store has no links
    mode = _lmode(storage, folder)
    names = storage.list(folder) if mode is not None and stat.S_ISDIR(mode) else []  # a real folder only
    for key in [folder, *(posixpath.join(folder, n) for n in names)]:
        mode = _lmode(storage, key)
        if mode is not None and (stat.S_ISLNK(mode) or (key == folder and not stat.S_ISDIR(mode))):
            log.warning("%s is %s where the run's final model goes: removed (where a link led is untouched), and the "
                        "final model written in the run", storage.display(key), "a link" if stat.S_ISLNK(mode) else "a file")
            storage.remove(key)


def _lmode(storage: Storage, key: str) -> int | None:
    """The mode of what is at `key` of a local run, a link itself; None when nothing is."""
    try:
        return os.lstat(storage.local_path(key)).st_mode  # type: ignore[arg-type]
    except FileNotFoundError:
        return None


def initial_eval(storage: Storage, evaluator: Evaluator) -> float:
    info = RunInfo.load(storage)
    if info.initial_eval_loss is None:
        metrics = evaluator.metrics(storage, L.global_weights(0))
        info.initial_eval_loss, info.initial_eval_metrics = metrics.pop("loss"), metrics
        info.save(storage)
    return info.initial_eval_loss

