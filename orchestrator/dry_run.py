"""`orchestrate submit --dry-run`: what a run would be, before an allocation is spent, with nothing
submitted and nothing written (no run directory, no data cache, no job folder).

It says the resolved config where it differs from the defaults, how the worker jobs would be
submitted (on Slurm: the job array and the sbatch script submitit would write, orchestrator.executor
.sbatch_text), the model's size W from its architecture (built on the meta device: no memory, no
weights read), the bytes each worker-round would write and read (the contribution as its codec
stores it, core.codec.stored_specs; its base), and what the run directory would hold at its end
under its retention settings (orchestrator/retention.py). The sizes are the files' tensors, without
their few-kB headers and manifests.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from core import codec
from core.checkpoint import DTYPES, ITEMSIZE
from core.config import Config, config_from_dict, to_dict
from core.outer import state_slots
from core.progress import human


def changed(cfg: Config) -> list[str]:
    """`key: value` of every config key whose value is not the default's, in the config's order."""
    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
        return out
    mine, default = flat(to_dict(cfg)), flat(to_dict(config_from_dict({})))
    return [f"{k}: {v}" for k, v in mine.items() if default.get(k, object()) != v]


def model_specs(cfg: Config) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (safetensors dtype, shape)} of the weights a round's global holds."""
    from worker.tasks import task_for
    with torch.device("meta"):
        model = task_for(cfg).build_model(pretrained=False)
    return {k: (DTYPES[t.dtype], tuple(t.shape)) for k, t in model.state_dict().items()}


def _bytes(specs: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    return sum(ITEMSIZE[d] * math.prod(s) for d, s in specs.values())


def sizes(cfg: Config, specs: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, int]:
    """What a round moves and the run keeps, in bytes: W (the global), c (one contribution), the
    outer state, a worker's state snapshot, and the run directory at its end."""
    w = _bytes(specs)
    rc, k, rounds = cfg.round, cfg.workers, cfg.rounds
    c = _bytes(codec.stored_specs(specs, codec.encoding_for(rc, "0" * 32, 0))) if rc.contribution == "delta" else w
    outer = w * sum(1 for _, shaped in state_slots(cfg.outer) if shaped)
    snapshot = 2 * w + (w if codec.uses_feedback(rc) else 0)  # AdamW's two moments, and the feedback buffer
    kept = rounds if rc.keep_last <= 0 else min(rounds, rc.keep_last)
    last = set(range(max(0, rounds - kept), rounds + 1)) | {0}  # kept anyway: the last rounds', the base
    every = len(set(range(0, rounds + 1, rc.keep_every)) - last) if rc.keep_every and rc.keep_last > 0 else 0
    globals_kept = rounds + 1 if rc.keep_last <= 0 else min(rounds + 1, kept + 2 + every)  # + the base, round 0's
    run_dir = (globals_kept * w + min(rounds, kept + 1) * outer + kept * k * c  # globals, outer states, contributions
               + k * snapshot + w)  # each worker's newest snapshot, the final model
    return {"W": w, "contribution": c, "outer_state": outer, "snapshot": snapshot, "run_dir": run_dir}


def _kept(keep_last: int) -> str:
    return "every round's" if keep_last <= 0 else "the last round's" if keep_last == 1 else f"the last {keep_last} rounds'"


def plan(cfg: Config, folder: str) -> list[str]:
    """The dry run's lines."""
    from orchestrator.executor import sbatch_text
    from orchestrator.slurm import worker_tasks
    lines = [f"dry run: nothing is submitted or written; the run directory would be {cfg.run_dir}",
             "config, where it differs from the defaults:"]
    lines += [f"  {line}" for line in changed(cfg)] or ["  (the defaults)"]
    persistent = cfg.round.worker_mode == "persistent"
    jobs = (f"{cfg.workers} persistent worker jobs, submitted once and kept for all {cfg.rounds} rounds" if persistent
            else f"{cfg.workers} worker jobs per round, {cfg.workers * cfg.rounds} in all")
    where = {"local": "processes on this machine", "inline": "threads of this process",
             "slurm": f"one Slurm job array of {cfg.workers} tasks ({worker_tasks(cfg)} task(s) each)"}[cfg.executor.kind]
    lines.append(f"worker jobs: {jobs}, as {where}")
    if cfg.executor.kind == "slurm":
        lines += ["the sbatch script of a round's array:", *(f"  {line}" for line in
                                                             sbatch_text(cfg, folder, cfg.workers).splitlines())]
    specs = model_specs(cfg)
    s = sizes(cfg, specs)
    w = s["W"]
    lines.append(f"model: {human(sum(math.prod(shape) for _, shape in specs.values()))} parameters, W = {human(w)}B "
                 "of weights")
    lines.append(f"per worker-round: writes its contribution, {human(s['contribution'])}B ({s['contribution'] / w:.2f} W, "
                 f"round.codec {cfg.round.codec}), and reads its base, {human(w)}B (1 W; less with round.replica)")
    lines.append(f"run directory at the end: about {human(s['run_dir'])}B ({s['run_dir'] / w:.1f} W: the kept globals "
                 f"and outer states, {_kept(cfg.round.keep_last)} contributions, each worker's newest state snapshot, "
                 "the final model)")
    return lines
