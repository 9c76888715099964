"""A worker's own state on storage: which snapshot of its AdamW state (and error-feedback buffer) a
job starts from, each checked before it is used.

A state file or in-flight checkpoint is untrusted like any file in the run (a half-synced client, a
co-tenant, a bug): past the checkpoint format's own checks (core.checkpoint), every tensor must be
floating point and finite, AdamW's second moments and step counts non-negative, and the
error-feedback buffer within what rounds of training can leave (core.codec.max_update), since it is
sent with the next contribution. A file that fails is named, set aside under the worker's
`rejected/` folder with a `.reason.json`, and the job falls back to the previous snapshot, or to
fresh AdamW state, saying so: it never fails job after job on the same file.

A sharded worker's snapshot is a set of rank files (core/shards.py): each rank reads and checks the
rows it holds, the ranks agree on one verdict (one rank's problem is every rank's), and rank 0 sets
the whole set aside.
"""
from __future__ import annotations

import contextlib
import logging
import math
import posixpath
import time
from dataclasses import dataclass, field

import torch

from core.checkpoint import read_manifest
from core.codec import check_bound
from core.errors import CheckpointError, StorageError
from core.layout import SAFETENSORS, RunLayout
from core.shards import Want, checkpoint_files, read_checkpoint
from core.storage import Storage
from worker.ranks import SOLO, Ranks

log = logging.getLogger(__name__)
L = RunLayout()
SEP = "::"  # optimizer state keys are `param<SEP>slot`
FEEDBACK = "error_feedback/"  # round.codec topk: the error-feedback buffer's keys are `FEEDBACK<param>`


ADAMW_SLOTS = ("exp_avg", "exp_avg_sq", "step")
MARGIN = 1.05  # float rounding of honest moments (equality holds at an AdamW's first step)


@dataclass(frozen=True)
class Expect:
    """What a worker's state file or in-flight checkpoint may hold, taken from the live model and
    optimizer (expect_of): a file is checked against it before any tensor reaches either."""

    worker: int
    held: dict[str, tuple[tuple[int, ...], torch.dtype]]
    """Every tensor of the model: the shape this rank holds (its rows, sharded) and its dtype."""
    whole: dict[str, tuple[int, ...]]
    """Every tensor's whole shape: the error-feedback buffer is kept whole."""
    trained: frozenset[str]
    """The optimizer's parameters: the only names AdamW state may be for."""
    betas: tuple[float, float]
    eps: float
    grad_clip: float = 0.0
    """inner.grad_clip: a gradient entry is at most this, so exp_avg_sq at most its square (0: unbounded)."""


def expect_of(worker: int, model: torch.nn.Module, opt: torch.optim.Optimizer, names: list[str],
              grad_clip: float) -> Expect:
    def held(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's rows
    sd = model.state_dict()
    b1, b2 = opt.defaults["betas"]
    return Expect(worker, {k: (tuple(held(t).shape), t.dtype) for k, t in sd.items()},
                  {k: tuple(t.shape) for k, t in sd.items()}, frozenset(names), (float(b1), float(b2)),
                  float(opt.defaults["eps"]), grad_clip)


@dataclass(frozen=True)
class Reader:
    """What this rank reads of a state file or in-flight checkpoint, and which ranks agree on it."""

    ranks: Ranks = SOLO
    want: Want | None = field(default=None, compare=False)
    """Which tensors, whole or which rows (core.shards.Want); None: all of them, whole."""
    expect: Expect | None = field(default=None, compare=False)
    """What the tensors must fit (names, shapes, dtypes, AdamW's slots); None: the file's own checks only."""


def fit_problems(tensors: dict[str, torch.Tensor], expect: Expect) -> list[str]:
    """How a state file's tensors do not fit the model and its AdamW (empty: they fit): every
    tensor a model's or its error feedback, every parameter's state exactly AdamW's three slots,
    moments shaped like the parameter, the step count one whole number >= 1."""
    problems, slots = [], {}
    for key, t in tensors.items():
        if key.startswith(FEEDBACK):
            name, want = key[len(FEEDBACK):], expect.whole.get(key[len(FEEDBACK):])
        elif SEP in key:
            name, _, slot = key.rpartition(SEP)
            if name not in expect.trained or name not in expect.held:
                problems.append(f"tensor {key} is AdamW state for {name}, which the model does not train")
                continue
            if slot not in ADAMW_SLOTS:
                problems.append(f"tensor {key} is not one of AdamW's slots ({', '.join(ADAMW_SLOTS)})")
                continue
            slots.setdefault(name, set()).add(slot)
            if slot == "step":
                if t.dim() or not float(t).is_integer() or float(t) < 1:
                    problems.append(f"tensor {key} (AdamW's step count) is {list(t.shape)}-shaped or not a whole "
                                    "number >= 1")
                continue
            want = expect.held[name][0]
            if t.dtype != expect.held[name][1]:
                problems.append(f"tensor {key} is {t.dtype}, its parameter {expect.held[name][1]}")
        else:
            name, want = key, expect.held.get(key, (None,))[0]
        if want is None:
            problems.append(f"tensor {key} names {name}, which the model does not have")
        elif tuple(t.shape) != want:
            problems.append(f"tensor {key} has shape {list(t.shape)}, the model's {name} {list(want)}")
    problems += [f"{name} has AdamW state without {', '.join(s for s in ADAMW_SLOTS if s not in got)}"
                 for name, got in slots.items() if len(got) < len(ADAMW_SLOTS)]
    return problems


def moment_problem(tensors: dict[str, torch.Tensor], name: str, expect: Expect, v_max: float) -> str | None:
    """Why `name`'s AdamW moments cannot come from training, if they cannot (`v_max`: its
    exp_avg_sq's largest entry). Honest moments obey |exp_avg| <= C(t) sqrt(exp_avg_sq) entry by
    entry (Cauchy-Schwarz over the steps, as in core.codec.max_update), which bounds every step
    AdamW takes from them; checked as exp_avg^2 <= c^2 (exp_avg_sq + eps^2), which implies
    |exp_avg| <= c (sqrt(exp_avg_sq) + eps) and holds where exp_avg_sq underflowed; one pass. With
    gradient clipping exp_avg_sq is at most the clip's square."""
    m, v, t = (tensors[f"{name}{SEP}{s}"] for s in ADAMW_SLOTS)
    (b1, b2), steps = expect.betas, int(float(t))
    q = b1 * b1 / b2
    series = steps if abs(1 - q) < 1e-12 else (1 - q ** min(steps, 10**6)) / (1 - q)
    c = MARGIN * (1 - b1) / math.sqrt(1 - b2) * math.sqrt(series)
    if expect.grad_clip > 0 and v_max > MARGIN * expect.grad_clip ** 2:
        return (f"its exp_avg_sq reaches {v_max:.3g}, more than inner.grad_clip {expect.grad_clip:g} squared: no "
                "clipped gradient leaves that")
    # v - m^2 / c^2 >= -eps^2 everywhere (an m of 3e38 squares to inf: refused too)
    if m.numel() and float(torch.addcmul(v.float(), m.float(), m.float(), value=-1 / (c * c)).min()) < -expect.eps ** 2:
        return (f"its exp_avg exceeds {c:.3g} x sqrt(exp_avg_sq) + eps: AdamW would step farther than any "
                "training could take it")
    return None


def check_state(tensors: dict[str, torch.Tensor], label: str, feedback_bound: float,
                expect: Expect | None = None) -> None:
    """CheckpointError naming `label` and the tensor when a state file's tensors cannot be a worker's.
    Each tensor is read once for its extremes (NaN and Inf show there), its moments once more."""
    peaks = {}
    for key, t in tensors.items():
        if not t.is_floating_point():
            raise CheckpointError(f"{label}: tensor {key} is {t.dtype}, not floating point: a worker writes its "
                                  "AdamW state and error feedback in floating point; the file is damaged or forged")
        if not t.numel():
            continue
        lo, hi = (float(x) for x in torch.aminmax(t.detach().reshape(-1)))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise CheckpointError(f"{label}: tensor {key} has NaN or Inf values: the file is damaged, or the "
                                  "training that wrote it diverged")
        slot = key.rpartition(SEP)[2] if SEP in key else ""
        if slot in ("exp_avg_sq", "step", "max_exp_avg_sq") and lo < 0:
            raise CheckpointError(f"{label}: tensor {key} (AdamW's {slot}) has negative values: the file is damaged "
                                  "or forged")
        if key.startswith(FEEDBACK):
            check_bound(label, key, t, feedback_bound, what="(the error-feedback buffer) holds an entry of magnitude")
        peaks[key] = hi
    if expect is None:
        return
    if problems := fit_problems(tensors, expect):
        raise CheckpointError(f"{label} does not fit the model and its AdamW: " + "; ".join(problems[:6])
                              + ("" if len(problems) <= 6 else f"; and {len(problems) - 6} more")
                              + ": the file is damaged, forged, or from another model")
    for name in sorted({k.rpartition(SEP)[0] for k in tensors if SEP in k and not k.startswith(FEEDBACK)}):
        why = moment_problem(tensors, name, expect, peaks.get(f"{name}{SEP}exp_avg_sq", 0.0))
        if why is not None:
            raise CheckpointError(f"{label}: AdamW state for {name}: {why}; the file is damaged or forged")


def set_aside(storage: Storage, key: str, why: str) -> str | None:
    """Move a refused state file or set of rank files (manifest first: unpublished before the data)
    to the worker's `rejected/` folder with a `.reason.json`; where it went, or None when it could
    not be moved (it is then left in place, and never read again by this job)."""
    folder, name = posixpath.split(key)
    stem = name.removesuffix(SAFETENSORS)
    tag = f"{stem}_{int(time.time() * 1000)}"
    dest = posixpath.join(folder, "rejected", tag + SAFETENSORS)
    try:
        for k in checkpoint_files(storage, key):
            with contextlib.suppress(FileNotFoundError):
                storage.move(k, posixpath.join(folder, "rejected", tag + posixpath.basename(k)[len(stem):]))
        storage.write_json(posixpath.join(folder, "rejected", tag + ".reason.json"), {"file": key, "reason": why,
                                                                                     "at": time.time()})
        return dest
    except (StorageError, OSError) as exc:
        log.warning("%s could not be set aside (%s); it is left in place", storage.display(key), exc)
        return None


def checked(storage: Storage, key: str, label: str, feedback_bound: float, reader: Reader = Reader(),
            round_: int | None = None) -> dict[str, torch.Tensor] | None:
    """What `reader` reads of the state file or in-flight checkpoint at `key` (of `round_` when
    given), checked (check_state); None when it has no manifest. One that fails on any rank is set
    aside, naming why, and its CheckpointError raised on every rank."""
    ranks, problem, tensors, present = reader.ranks, None, None, False
    try:
        manifest = read_manifest(storage, key, label)
        present = manifest is not None
        if present:
            _check_owner(manifest, label, reader.expect, round_)
            tensors = read_checkpoint(storage, key, label, reader.want, prefer=ranks.rank, manifest=manifest)
            check_state(tensors, label, feedback_bound, reader.expect)
    except CheckpointError as exc:
        problem = str(exc)
    if (problem := ranks.first(problem)) is not None:
        where = set_aside(storage, key, problem) if ranks.lead else None
        log.warning("%s; set aside%s", problem, f" to {storage.display(where)}" if where else "")
        raise CheckpointError(problem)
    return tensors if not ranks.any(not present) else None


def _check_owner(manifest: dict, label: str, expect: Expect | None, round_: int | None) -> None:
    """The manifest is this worker's, of this round: another worker's file copied in is refused."""
    if expect is not None and (w := manifest.get("worker")) != expect.worker:
        raise CheckpointError(f"{label}: its manifest names worker {w!r}, not worker {expect.worker}: another "
                              "worker's file was copied here, or it is forged")
    if round_ is not None and (r := manifest.get("round")) != round_:
        raise CheckpointError(f"{label}: its manifest names round {r!r}, not round {round_} as its name does: the "
                              "file was copied or renamed, or it is forged")


def usable_state(storage: Storage, worker: int, before_round: int, feedback_bound: float = math.inf,
                 reader: Reader = Reader(), refused: list[int] | None = None
                 ) -> tuple[str, dict[str, torch.Tensor]] | None:
    """This worker's newest optimizer-state snapshot before `before_round` that passes check_state,
    with its tensors; a damaged one is set aside (naming it and why, its round appended to
    `refused`) and the one before is tried. None: no usable snapshot, the job starts from fresh
    AdamW state (and says so when one was refused)."""
    ranks, refused = reader.ranks, [] if refused is None else refused
    rounds = ranks.lead_says(sorted({r for n in storage.list(L.worker_dir(worker)) if (r := L.parse_state(n)) is not None})
                             if ranks.lead else None)
    for r in sorted((r for r in rounds if r < before_round), reverse=True):
        key = L.worker_state(worker, r)
        try:
            tensors = checked(storage, key, f"worker {worker} optimizer state {storage.display(key)}", feedback_bound,
                              reader, r)
        except CheckpointError:
            refused.append(r)
            continue
        if tensors is None:
            continue
        if refused:
            log.warning("worker %d: starting from its optimizer state of round %d, an older snapshot", worker, r)
        return key, tensors
    if refused:
        log.warning("worker %d: no usable optimizer-state snapshot is left: fresh AdamW state (and error feedback)",
                    worker)
    return None


def inflight_tensors(storage: Storage, key: str, label: str, base_digest: str, steps: int, bound: float,
                     reader: Reader = Reader()) -> dict[str, torch.Tensor] | None:
    """What `reader` reads of the in-flight checkpoint when this round resumes from it (trained from
    this base, its figures a worker's, its tensors checked: check_state), else None; a damaged one
    is set aside. Rank 0 reads the manifest and decides for every rank."""
    go = None
    if reader.ranks.lead:
        try:
            m = read_manifest(storage, key, label)
        except CheckpointError as exc:
            m = {"damaged": str(exc)}
        done = None if m is None else m.get("steps_done")
        if m is None or m.get("base_digest") != base_digest and "damaged" not in m:
            go = False
        elif "damaged" in m or not (type(done) is int and 0 <= done <= steps):
            why = m.get("damaged") or f"{label}: its manifest's steps_done {done!r} is not a step of this round"
            set_aside(storage, key, why)
            log.warning("%s; set aside: the round starts again from its base", why)
            go = False
        else:
            go = True
    if not reader.ranks.lead_says(go):
        return None
    try:
        return checked(storage, key, label, bound, reader)
    except CheckpointError:  # set aside, said: the round starts again from its base
        return None
