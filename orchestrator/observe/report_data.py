"""What `orchestrate report` plots, read from a run directory (finished or in progress).

Reading (`collect`, `outer_grad_stats`) is kept apart from the pure functions that turn metrics
lines into series (`timeline`, `time_budget`, `cosine_matrix`...), which are tested with
hand-made numbers. Outer gradients are streamed tensor by tensor: worker k's outer gradient in
round r is global_r - contribution_k, and only their K x K Gram matrix is accumulated, so memory
stays about one model whatever K is (the DiLoCo paper's Figures 10-11: norm and cosine similarity).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.checkpoint import open_checkpoint, read_manifest
from core.codec import outer_gradient
from core.config import Config
from core.errors import CheckpointError
from core.layout import RunLayout, manifest_key
from core.storage import Storage
from orchestrator.observe.metrics import SCHEMA, read_metrics, step_lines
from core.records import RoundJobs, RunInfo
from orchestrator.runstate import arrived_workers, load_run, read_heartbeat, run_status

L = RunLayout()


@dataclass
class RunData:
    """A run as the report sees it: metrics lines of committed rounds + the round in flight."""
    run: str
    cfg: Config
    state: str
    info: dict[str, Any]
    lines: list[dict[str, Any]]
    current: dict[str, Any] | None  # round, jobs, manifests, progress of the round in progress
    now: float
    outer: dict[int, dict[str, Any]] = field(default_factory=dict)  # outer-gradient stats per round

    def kind(self, kind: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line["kind"] == kind]

    def steps_with_current(self) -> list[dict[str, Any]]:
        """Step lines of committed rounds, plus the round in progress: published contributions'
        losses and, for workers still training, their last heartbeat."""
        if not self.current:
            return self.kind("step")
        r, h = self.current["round"], self.cfg.inner.steps
        extra = step_lines(r, self.current["manifests"], h)
        for w, p in self.current["progress"].items():
            if w not in self.current["manifests"] and p and p.get("round") == r and p.get("loss") is not None and p.get("step"):
                extra.append({"kind": "step", "schema": SCHEMA, "round": r, "worker": w, "step": r * h + p["step"],
                              "loss": p["loss"]})
        return self.kind("step") + extra


def collect(storage: Storage, now: float | None = None) -> RunData:
    """Everything but the outer-gradient statistics (see outer_stats_cached)."""
    cfg = load_run(storage)  # raises "... is not a run directory" for anything else
    status = run_status(storage, cfg)
    lines = read_metrics(storage, cfg)
    r = sum(1 for line in lines if line["kind"] == "round")
    current = None
    if r < cfg.rounds and status["state"] in ("running", "stopped"):
        jobs = RoundJobs.load(storage, r).to_json()
        manifests = {w: m for w in arrived_workers(storage, r) if (m := read_manifest(storage, L.contribution(r, w)))}
        progress = {int(w): read_heartbeat(storage, int(w)) for w in jobs["workers"]}
        current = {"round": r, "jobs": jobs, "manifests": manifests, "progress": progress}
    return RunData(storage.display(), cfg, status["state"], dataclasses.asdict(RunInfo.load(storage)), lines, current,
                   time.time() if now is None else now)


# -- outer gradients: streamed Gram matrix ------------------------------------------------------
def gram_update(gram: torch.Tensor, grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Add one tensor's contribution to the K x K matrix of dot products <g_i, g_j> (float64)."""
    flat = torch.stack([g.reshape(-1).double() for g in grads])
    return gram + flat @ flat.T


def cosine_matrix(gram: torch.Tensor) -> torch.Tensor:
    norms = gram.diagonal().clamp_min(0).sqrt()
    denom = torch.outer(norms, norms)
    return torch.where(denom > 0, gram / denom.clamp_min(1e-300), torch.zeros_like(gram))


def stats_from_gram(workers: Sequence[int], gram: torch.Tensor, weights: Sequence[float]) -> dict[str, Any]:
    """Per-worker norms, pairwise cosines and the norm of the weighted mean outer gradient
    (||sum_k w_k g_k||^2 = w^T G w, w normalised: what the merge fed to the outer optimizer)."""
    w = torch.tensor(weights, dtype=torch.float64)
    w = w / w.sum()
    cos = cosine_matrix(gram)
    pairs = [float(cos[i, j]) for i in range(len(workers)) for j in range(i + 1, len(workers))]
    return {"workers": list(workers), "norms": [math.sqrt(max(float(v), 0.0)) for v in gram.diagonal()],
            "cosine": cos.tolist(), "pairwise": pairs,
            "mean_grad_norm": math.sqrt(max(float(w @ gram @ w), 0.0))}


def outer_grad_stats(storage: Storage, r: int, workers: Sequence[int], weights: Sequence[float]) -> dict[str, Any]:
    """Outer-gradient statistics of round r, reading global_r and each contribution once, lazily."""
    with open_checkpoint(storage, L.global_weights(r)) as base:
        inputs = [open_checkpoint(storage, L.contribution(r, w)) for w in workers]
        try:
            gram = torch.zeros(len(workers), len(workers), dtype=torch.float64)
            for name in base.specs:
                g = base.get(name)
                gram = gram_update(gram, [outer_gradient(ck, name, g) for ck in inputs])  # delta contributions too
            for ck in inputs:
                ck.verify()
            base.verify()
        finally:
            for ck in inputs:
                ck.close()
    return stats_from_gram(workers, gram, weights)


def _cache_key(line: Mapping[str, Any]) -> str:
    """A committed round is committed once: its commit time and merged workers name its inputs
    (no checkpoint is read to know whether the cache is still good)."""
    ident = [line["round"], line.get("committed_at"), sorted(line["merged"]), line.get("weights")]
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _pruned(storage: Storage, r: int, worker: int) -> bool:
    """Were round r's tensors deleted by retention (the manifest of its global, or of `worker`'s
    contribution, is there, its data not)? Round 0's global, the run's base, is always kept."""
    try:
        return any(storage.exists(manifest_key(k)) and not storage.exists(k)
                   for k in (L.global_weights(r), L.contribution(r, worker)))
    except Exception:  # noqa: BLE001 - a storage that cannot say: the statistics say why themselves
        return False


def outer_stats_cached(storage: Storage, rounds: Sequence[Mapping[str, Any]], cache: Path) -> dict[int, dict[str, Any]]:
    """Stats of every committed round with a merge, cached in `cache` (keyed by round and commit).
    A round whose checkpoints are gone gets {"error": why} instead; one whose tensors retention
    deleted (round.keep_last: their manifests stay) has none."""
    cached = json.loads(cache.read_text()) if cache.exists() else {}
    out: dict[int, dict[str, Any]] = {}
    for line in rounds:
        r, workers = line["round"], sorted(line["merged"])
        if not workers:
            continue
        key = _cache_key(line)
        hit = cached.get(str(r))
        if hit and hit.get("key") == key and "error" not in hit:
            out[r] = hit
            continue
        weights = [float(((line.get("weights") or {}).get(str(w), 1.0))) for w in workers]
        if _pruned(storage, r, workers[0]):
            continue
        try:
            out[r] = {"key": key, **outer_grad_stats(storage, r, workers, weights)}
        except CheckpointError as exc:
            out[r] = {"key": key, "error": str(exc)}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({str(r): v for r, v in out.items()}, indent=1))
    return out


# -- pure: series for the plots -----------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    row: str  # "worker 3" or "merge service"
    kind: str  # queued | training ahead | running | merging | evaluating | in flight | no contribution
    start: float
    end: float
    round: int


def _worker_segments(line: Mapping[str, Any], end_if_lost: float | None, first_round: bool = True) -> list[Segment]:
    """A worker's round: queued (the scheduler's queue wait, the one `status --json` says), starting
    (from the job's start to its first step: a process starting, loading its base; the whole wait for
    a persistent job's later rounds, which queue no more), running. `first_round`: the job was
    submitted for this round (a persistent job's queue wait is its first round's)."""
    row, r, sub = f"worker {line['worker']}", line["round"], line.get("submitted_at")
    if sub is None:
        return []
    # the scheduler's own timings are a job's; a persistent job's span many rounds: its round is its own clock
    if line.get("queue_wait_s") is not None and not line.get("persistent"):
        start = sub + line["queue_wait_s"]
        end = start + line["run_s"] if line.get("run_s") is not None else line.get("written_at") or start
    elif line.get("written_at") is not None and line.get("seconds") is not None:  # the worker's own clock
        end = line["written_at"]
        ahead = min(line.get("ahead_s") or 0.0, line["seconds"])
        if ahead > 0:  # round.overlap: it trained this round before the round was submitted
            start = end - line["seconds"] + ahead
            return [Segment(row, "training ahead", start - ahead, start, r), Segment(row, "running", start, end, r)]
        start = max(sub, end - line["seconds"])
    else:
        return [Segment(row, "no contribution", sub, end_if_lost, r)] if end_if_lost and end_if_lost > sub else []
    wait = line.get("queue_wait_s") if first_round else 0.0
    began = start if wait is None else min(start, sub + wait)  # the scheduler did not say: all of it queued
    return [s for s in (Segment(row, "queued", sub, began, r), Segment(row, "starting", began, start, r),
                        Segment(row, "running", start, end, r)) if s.end > s.start]


def timeline(rounds: Sequence[Mapping[str, Any]], workers: Sequence[Mapping[str, Any]],
             current: Mapping[str, Any] | None, now: float) -> list[Segment]:
    """Every job's queued / running span per worker, and the merge service's merging / evaluating."""
    ends = {line["round"]: line.get("merge_started_at") for line in rounds}
    first: dict[Any, int] = {}  # job id -> the round it was submitted for
    for w in workers:
        if w.get("job_id") is not None:
            first[w["job_id"]] = min(first.get(w["job_id"], w["round"]), w["round"])
    segs = [s for w in workers
            for s in _worker_segments(w, ends.get(w["round"]), first.get(w.get("job_id"), w["round"]) == w["round"])]
    for line in rounds:
        r, m0, m1, ev = line["round"], line.get("merge_started_at"), line.get("committed_at"), line.get("evaluated_at")
        if m0 is not None and m1 is not None:
            segs.append(Segment("merge service", "merging", m0, max(m1, m0), r))
            if ev is not None and ev > m1:
                segs.append(Segment("merge service", "evaluating", m1, ev, r))
    return segs + _current_segments(current, now)


def _current_segments(current: Mapping[str, Any] | None, now: float) -> list[Segment]:
    if not current:
        return []
    r, jobs, out = current["round"], current["jobs"], []
    for w, entry in jobs.get("workers", {}).items():
        m = current["manifests"].get(int(w))
        line = {"worker": int(w), "round": r, "submitted_at": entry.get("submitted_at", jobs.get("submitted_at")),
                "written_at": (m or {}).get("written_at"), "seconds": (m or {}).get("seconds")}
        done = _worker_segments(line, None)
        out += done or ([Segment(f"worker {w}", "in flight", line["submitted_at"], now, r)]
                        if line["submitted_at"] is not None and now > line["submitted_at"] else [])
    return out


def worker_utilization(workers: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """Per persistent worker over the run: busy / (busy + idle) seconds, busy being its rounds'
    seconds (training ahead included) and idle its waits for a global (records.utilization, per worker)."""
    busy: dict[int, float] = {}
    idle: dict[int, float] = {}
    for line in workers:
        if line.get("seconds") is not None and line.get("waited_s") is not None:
            w = line["worker"]
            busy[w], idle[w] = busy.get(w, 0.0) + line["seconds"], idle.get(w, 0.0) + line["waited_s"]
    return {w: busy[w] / (busy[w] + idle[w]) for w in busy if busy[w] + idle[w] > 0}


def time_budget(segments: Sequence[Segment], rounds: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per round: its time (RoundRecord.round_s) and, summed over workers, seconds queued, starting
    and running, plus the service's merge and eval seconds: where the time went (None: nothing of that kind)."""
    out = []
    for line in rounds:
        r = line["round"]
        mine = [s for s in segments if s.round == r]
        total = {k: round(sum(s.end - s.start for s in mine if s.kind == k), 2) if any(s.kind == k for s in mine)
                 else None for k in ("queued", "starting", "running", "merging", "evaluating", "no contribution")}
        out.append({"round": r, "wall_s": line.get("round_seconds"), **total})
    return out


def contribution_size(workers: Sequence[Mapping[str, Any]]) -> tuple[float, int | None] | None:
    """(mean bytes of a merged contribution, its weights' fp32 bytes or None) over the last round
    with merged contributions; None if there is none."""
    merged = [w for w in workers if w.get("merged") and isinstance(w.get("bytes"), int) and w["bytes"] > 0]
    if not merged:
        return None
    last = [w for w in merged if w["round"] == max(x["round"] for x in merged)]
    fp32 = next((w["fp32_bytes"] for w in last if isinstance(w.get("fp32_bytes"), int)), None)
    return sum(w["bytes"] for w in last) / len(last), fp32


def worker_io(workers: Sequence[Mapping[str, Any]]) -> tuple[float, float, int | None, int, int] | None:
    """(mean bytes read, mean bytes written per worker-round, fp32 bytes of the weights or None,
    bases replayed, workers) over the last round whose merged workers say; None if none does."""
    said = [w for w in workers if w.get("merged") and type(w.get("io_read")) is int and type(w.get("io_written")) is int]
    if not said:
        return None
    last = [w for w in said if w["round"] == max(x["round"] for x in said)]
    fp32 = next((w["fp32_bytes"] for w in last if isinstance(w.get("fp32_bytes"), int)), None)
    return (sum(w["io_read"] for w in last) / len(last), sum(w["io_written"] for w in last) / len(last), fp32,
            sum(w.get("replica") is True for w in last), len(last))


def bytes_series(rounds: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Bytes written per round by kind (None counted as 0), and bytes the merge read."""
    keys = ("bytes_contributions", "bytes_global", "bytes_outer_state", "bytes_worker_states", "bytes_read")
    return {k: [float(line.get(k) or 0) for line in rounds] for k in keys}


def worker_losses(steps: Sequence[Mapping[str, Any]]) -> dict[int, tuple[list[int], list[float]]]:
    """Each worker's training loss curve: (global inner steps, losses), in step order."""
    out: dict[int, tuple[list[int], list[float]]] = {}
    for line in sorted(steps, key=lambda s: (s["worker"], s["step"])):
        xs, ys = out.setdefault(line["worker"], ([], []))
        if line["loss"] is not None:
            xs.append(line["step"])
            ys.append(line["loss"])
    return out


def eval_curve(lines: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[int], list[float]]:
    """(rounds done, inner steps, eval loss) of the global model, the initial model first."""
    pts = [(0 if ln["kind"] == "run" else ln["round"] + 1, ln["step"], ln["eval_loss"]) for ln in lines
           if ln["kind"] in ("run", "round") and ln.get("eval_loss") is not None]
    pts.sort()
    return [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]
