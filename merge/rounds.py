"""One round's merge for the merge service: the round's contributions and the global weights in,
the next global weights and outer optimizer state out, bad contributions rejected.

The merge of a DiLoCo / FedAvg / lo-fi round is linear: the outer gradient is base - the workers'
weighted mean. So each contribution is folded into a running sum S = sum_i w_i x_i the moment it
lands (RunningSum.add, while the others still train), and the merge after the last one lands
reads that one contribution, then takes one outer step per tensor from S (`outer_step`, below).
Contributions are read by merge/reading.py; this module adds what it reads, checked.

- Space: x_i are weights, or, when the contributions are deltas against this round's base
  (round.contribution: delta, core/codec.py), the deltas themselves, whose mean is the outer
  gradient. A contribution in the other space (a late worker's delta against an older base) is
  decoded whole first.
- Order: S is summed in the order contributions were folded (`order`); floating-point sums depend
  on it. A merge without a running sum (a resumed service, a replay, `round.stream_merge: false`)
  is this same code fed the list in its order, so the same inputs in that order give the same bytes.
- Only validated contributions count: the weight, the header (core.checkpoint) and the names,
  shapes and dtypes are checked before anything is added; values are checked finite and the
  digest is checked as they stream. Anything that goes wrong while one contribution is read or
  folded (whatever the exception) rejects it with the reason, and S is rebuilt from the accepted
  ones if part of it was added (rare; exact).
- Memory: S is one fp32 copy of the model; the global weights and outer state are held too when
  preloaded (the service reads them while the workers train), so the step reads nothing then.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from core import codec, outer
from core.checkpoint import DTYPES, FLOATS, ITEMSIZE, TensorFile, TensorSpec, load_checkpoint, open_checkpoint, \
    read_manifest
from core.checkpoint_writer import OutputFile
from core.errors import CheckpointError
from core.failpoints import failpoint
from core.outer import outer_grad, state_in_specs, state_key, state_slots
from core.storage import Storage
from merge.inputs import InputError, finite, nonfinite, refusal
from merge.lte import merge_lte_round
from merge.outer import OuterStep, StepOverflow, state_out_specs
from merge.reading import ContributionReader, Stalled, decoded, in_space, merging, stored_in
from merge.robust import Values
from merge.robust import aggregate as robust_aggregate
from merge.round_spec import Contribution, MergeResult, QuorumError, RoundSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Folded:
    """A contribution in the running sum."""
    worker: int
    key: str
    weight: float
    digest: str
    """Of the file as summed: a contribution replaced since is summed again."""
    nbytes: int
    bound: float
    peak: float
    """The largest magnitude of its outer gradient's entries: the input to blame when a step overflows."""


class RunningSum:
    """S = sum_i w_i x_i over the contributions folded so far, against the global weights at `base_key`.

    `preload`: hold the global weights and the outer state at `state_key` in memory from now on
    (the service does, while it waits for the workers), so that the outer step reads nothing."""

    def __init__(self, storage: Storage, base_key: str, *, state_key: str | None = None, preload: bool = False) -> None:
        self.storage, self.base_key, self.state_key = storage, base_key, state_key
        with open_checkpoint(storage, base_key, f"global weights {storage.display(base_key)}") as base:
            self.ref: dict[str, TensorSpec] = dict(base.specs)
            self.base_digest: str = base.manifest["digest"]  # type: ignore[index]
            self.sums = {n: base.read(n).clone() if sp.dtype not in FLOATS else torch.zeros(sp.shape)
                         for n, sp in self.ref.items()}  # non-float tensors: every input must equal the base's
        self.held: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}
        """key -> (digest, tensors): the global weights and outer state read ahead (`preload`)."""
        if preload:
            for key, what in [(base_key, "the global weights"), *([(state_key, "the outer state")] if state_key else [])]:
                try:
                    tensors, _, m = load_checkpoint(storage, key)
                    self.held[key] = (m["digest"], tensors)
                except CheckpointError as exc:  # not held: the merge reads it, and reports it there if still bad
                    log.warning("merge: cannot hold %s in memory: %s", what, exc)
        self.space: str | None = None
        """`weights` or `delta`; None: the space of the first contribution folded."""
        self.folded: list[Folded] = []
        self.rejected: dict[int, tuple[str, str]] = {}
        """worker -> (digest@written_at of the refused file's manifest, why): a republished file is tried again."""
        self._dirty = False  # S holds a partial add, or was divided into the mean
        self._bound, self._peak = math.inf, 0.0  # the contribution being folded: its bound and largest entry
        self.reader = ContributionReader(self.ref)  # its read buffers serve every fold

    # -- folding ------------------------------------------------------------------------
    def add(self, c: Contribution) -> bool:
        """Fold `c` in; False (and the reason in `rejected`) if it cannot be merged."""
        label = f"worker {c.worker} ({self.storage.display(c.key)})"
        try:
            m: dict[str, Any] | None = read_manifest(self.storage, c.key, label)
            bad: CheckpointError | None = None
        except CheckpointError as exc:  # damaged: refused below, naming why
            m, bad = None, exc
        ident = f"{(m or {}).get('digest')}@{(m or {}).get('written_at')}"  # a republished file is tried again
        if c.worker in self.rejected and self.rejected[c.worker][0] == ident:
            return False
        if any(f.worker == c.worker for f in self.folded):
            raise ValueError(f"worker {c.worker} is folded already: a contribution counts once")
        if self._dirty:  # bring S back to the sum over `folded`
            self._rebuild(list(self.folded))
        t0 = time.perf_counter()
        try:
            with merging():
                if bad is not None or m is None:
                    raise bad or CheckpointError(f"{label}: no manifest, so the checkpoint is incomplete or absent")
                digest, nbytes = self._fold(c, label, m)
        except Exception as exc:  # noqa: BLE001 - whatever one contribution does, it is one rejection
            self.rejected[c.worker] = (ident, refusal(label, exc))
            log.warning("merge: rejected worker %d: %s", c.worker, self.rejected[c.worker][1])
            if self._dirty:  # part of it was added: rebuild S from the accepted ones, in order
                self._rebuild(list(self.folded))
            return False
        self._dirty = False
        self.rejected.pop(c.worker, None)
        self.folded.append(Folded(c.worker, c.key, c.weight, digest, nbytes, c.bound, self._peak))
        log.info("merge: folded worker %d in %.2fs", c.worker, time.perf_counter() - t0)
        return True

    def _rebuild(self, todo: Sequence[Folded]) -> None:
        for n, t in self.sums.items():
            if t.is_floating_point():
                t.zero_()
        self.folded, self._dirty = [], False
        for f in todo:
            self.add(Contribution(f.worker, f.key, f.weight, f.bound))

    def _fold(self, c: Contribution, label: str, manifest: dict[str, Any]) -> tuple[str, int]:
        c.check_weight(label)
        self._peak = 0.0
        with TensorFile(self.storage, c.key, manifest, label) as f:  # the manifest add() read
            enc = codec.encoding_of(f.metadata, label)
            if not stored_in(self.space, enc, self.base_digest):
                return self._fold_decoded(c, label, f)  # a delta against another base, or the other space
            self.space = self.space or ("weights" if enc is None else "delta")
            self._bound = c.bound if self.space == "delta" else c.bound * codec.DRIFT
            self.reader.check_layout(f, enc, label)
            try:
                with self.reader.pieces(f, enc, label, c.worker) as pieces:
                    for p in pieces:
                        if p.positions is not None:
                            self._add_sparse(c, label, p.name, p.positions, p.values)
                        else:
                            self._add(c, label, p.name, p.values, p.start, p.stop)
            except CheckpointError as exc:
                if not isinstance(exc, Stalled):  # reading the rest here would block as the reader did
                    f.verify()  # a damaged file is named as such, before what its bytes decode to
                raise
            f.verify()
            return f.manifest["digest"], f.size  # type: ignore[index]

    def _add(self, c: Contribution, label: str, name: str, x: torch.Tensor, start: int = 0, stop: int | None = None) -> None:
        """S[name][start:stop] += w x (a float tensor; core.outer.fold), or check that a non-float one
        equals the base's."""
        s = self.sums[name]
        if not s.is_floating_point():
            if not torch.equal(x.reshape(-1), s.reshape(-1)[start:stop]):
                raise CheckpointError(f"{label}: tensor {name} is {self.ref[name].dtype} (not floating point) and "
                                      "differs from the global weights': such tensors are not merged, they must be "
                                      "identical in every input")
            return
        if not finite(x):
            raise CheckpointError(nonfinite(label, name))
        self._check_bound(label, name, x, start, stop)
        self._dirty = True
        outer.fold(s, x, c.weight, start, stop)

    def _add_sparse(self, c: Contribution, label: str, name: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        """S[name] at `positions` (distinct: core.topk.sparse checks them) += w values."""
        if not finite(values):
            raise CheckpointError(nonfinite(label, name))
        self._check_bound(label, name, values)
        self._dirty = True
        outer.fold_sparse(self.sums[name], positions, values, c.weight)

    def _check_bound(self, label: str, name: str, x: torch.Tensor, start: int = 0, stop: int | None = None) -> None:
        """Refuse an outer gradient entry past the contribution's bound (core.codec.max_update): a
        finite forged value (1e30) would otherwise reach the global. Weights are compared with the
        global's, read once and held (the step then uses that copy)."""
        if not math.isfinite(self._bound):
            return
        x = x.reshape(-1)
        if self.space == "weights":
            x = x.to(torch.float32) - self._base(name).reshape(-1)[start:stop].to(torch.float32)
        self._peak = max(self._peak, codec.check_bound(label, name, x, self._bound))

    def _base(self, name: str) -> torch.Tensor:
        """A tensor of the global weights, from the copy held in memory (read now if it is not)."""
        if self.base_key not in self.held:
            tensors, _, m = load_checkpoint(self.storage, self.base_key)
            self.held[self.base_key] = (m["digest"], tensors)
        return self.held[self.base_key][1][name]

    def _fold_decoded(self, c: Contribution, label: str, f: TensorFile) -> tuple[str, int]:
        """An input in the other space: decoded whole, converted per tensor."""
        weights = decoded(self.storage, c.key, label, c.worker, self.ref)
        self.space = self.space or "weights"
        self._bound = c.bound * codec.DRIFT  # a delta against an older base carries the global's moves since
        base = load_checkpoint(self.storage, self.base_key)[0] if self.space == "delta" else weights
        for name, t in weights.items():
            self._add(c, label, name, in_space(t, base[name], self.space))
        return f.manifest["digest"], f.size  # type: ignore[index]

    # -- the merge ----------------------------------------------------------------------
    def merge(self, contributions: Sequence[Contribution], spec: RoundSpec) -> MergeResult:
        """Make S the sum over exactly `contributions` (what is folded already, in its order, then
        the rest in the given order), then one outer step into `spec.out` (and the outer state).
        spec.aggregate median or trimmed_mean (merge.robust) replaces S's mean in that step."""
        t0 = time.perf_counter()
        want = {c.worker: c for c in contributions}
        keep = []
        for f in self.folded:  # still wanted, with the same file and weight?
            c = want.get(f.worker)
            if c is None or c.key != f.key or c.weight != f.weight or digest_now(self.storage, f.key) != f.digest:
                break
            keep.append(f)
        if len(keep) != len(self.folded) or self._dirty:
            self._rebuild(keep)
        done = {f.worker for f in self.folded}
        for c in contributions:
            if c.worker not in done:
                self.add(c)
        rejected = {w: why for w, (_, why) in self.rejected.items() if w in want}
        order = [f.worker for f in self.folded]
        if len(order) < spec.min_inputs:
            raise QuorumError(f"only {len(order)} valid contribution(s) for {spec.out}, the quorum is "
                              f"{spec.min_inputs}; rejected: {rejected or 'none'}", rejected)
        try:
            with merging():
                self._dirty = True  # S becomes the mean
                out_manifest, grad_sq = outer_step(self, spec, order)
        except StepOverflow as exc:  # the round is refused whole, the input farthest out named; the run goes on
            worst = max(self.folded, key=lambda f: f.peak)
            why = f"worker {worst.worker}: its outer gradient (largest entry {worst.peak:.3g}) made the merged " \
                  f"global weights not finite: {exc}"
            raise QuorumError(f"round refused: {why}", {worst.worker: why}) from None
        except InputError as exc:  # a robust aggregate read a contribution again, and it failed: that one runs again
            raise QuorumError(f"round refused: {exc.reason}", {exc.ident: exc.reason}) from None
        return MergeResult(merged=sorted(order), rejected=rejected, bytes_read=sum(f.nbytes for f in self.folded),
                           seconds=time.perf_counter() - t0, outer_grad_norm=grad_sq ** 0.5, manifest=out_manifest,
                           order=order)


def merge_round(storage: Storage, spec: RoundSpec, contributions: Sequence[Contribution],
                accumulator: RunningSum | None = None) -> MergeResult:
    """Merge `contributions` as `spec` says: the next global weights (and outer state) written.

    Rejected contributions are reported in the result, not raised; QuorumError if fewer than
    spec.min_inputs valid ones remain. Through `accumulator` (what a streaming service folded so
    far) or a fresh RunningSum fed `contributions` in their order. An LTE spec: merge.lte's merge."""
    if spec.lte is not None:
        return merge_lte_round(storage, spec, contributions)
    acc = accumulator if accumulator is not None else RunningSum(storage, spec.base)
    return acc.merge(contributions, spec)


# -- the outer step -------------------------------------------------------------------
def digest_now(storage: Storage, key: str) -> str | None:
    """The digest the manifest at `key` says now; None if there is none or it is damaged."""
    try:
        return (read_manifest(storage, key) or {}).get("digest")
    except CheckpointError:  # damaged: the fold refuses the contribution, naming why
        return None


def outer_step(acc: RunningSum, spec: RoundSpec, order: list[int]) -> tuple[dict[str, Any], float]:
    """The outer step, tensor by tensor, from acc's sum S over acc.folded (S is divided in place):
    the new global weights and state written and committed; their manifest and the squared norm of
    the outer gradient. Reads the base and state from acc.held when they are still the files."""
    s, total, cfg = acc.storage, float(sum(f.weight for f in acc.folded)), spec.outer
    assert cfg is not None
    layout = [(n, sp.dtype, sp.shape) for n, sp in acc.ref.items()]
    robust = None if spec.aggregate == "mean" else (spec.aggregate, spec.trim)
    manifest = {**spec.manifest, "merge_order": order, **({"aggregate": spec.aggregate} if robust else {})}
    opened: list[TensorFile] = []
    values: Values | None = None
    step = OuterStep([OutputFile(s, spec.out, [(n, d, sh, math.prod(sh) * ITEMSIZE[d]) for n, d, sh in layout],
                                 spec.metadata, manifest)],
                     OutputFile(s, spec.state_out, state_out_specs(layout, cfg), None,
                                {"optimizer": cfg.optimizer}) if spec.state_out else None, cfg)
    try:
        if robust:
            floats = {n: tuple(sp.shape) for n, sp in acc.ref.items() if sp.dtype in FLOATS}
            values = Values(s, acc.folded, acc.space or "weights", acc.base_digest, floats)
        base, _ = _source(acc, spec.base, f"global weights {s.display(spec.base)}", opened)
        state, have = _state(acc, spec, layout, opened)
        for name, sp in acc.ref.items():
            b = base(name)
            if sp.dtype not in FLOATS:
                step.keep(name, b)
                continue
            if values is None:
                grad = outer_grad(acc.sums[name], total, b, acc.space)
            else:  # a robust aggregate is the mean itself
                grad = outer_grad(robust_aggregate(values.get(name, lambda: b), *robust), 1.0, b, acc.space)  # type: ignore[misc]
            step.step(name, b, grad, {slot: state(state_key(name, slot)) for slot, _ in have.get(name, [])},
                      owned=True)
            failpoint("merge.while_reading")  # crash tests: half the step written, temporaries on disk
        step.finish()
        for f in opened:
            f.verify()
        if values is not None:
            values.verify()
        return step.commit(), step.grad_sq
    except BaseException:
        step.abort()
        raise
    finally:
        for f in opened:
            f.close()
        if values is not None:
            values.close()


def _source(acc: RunningSum, key: str, label: str, opened: list[TensorFile]
            ) -> tuple[Callable[[str], torch.Tensor], dict[str, tuple[str, tuple[int, ...]]]]:
    """(a tensor of the checkpoint at `key` by name, its entries' dtypes and shapes): the copy
    held in memory if it is still the file on storage (same digest; it is given up, since the
    step overwrites it), else the file, added to `opened` (verified and closed by the caller)."""
    held = acc.held.pop(key, None)
    if held is not None and digest_now(acc.storage, key) == held[0]:
        return held[1].__getitem__, {k: (DTYPES[t.dtype], tuple(t.shape)) for k, t in held[1].items()}
    opened.append(open_checkpoint(acc.storage, key, label))
    return opened[-1].read, {k: (sp.dtype, sp.shape) for k, sp in opened[-1].specs.items()}


def _state(acc: RunningSum, spec: RoundSpec, layout: list[tuple[str, str, tuple[int, ...]]], opened: list[TensorFile]
           ) -> tuple[Callable[[str], torch.Tensor], dict[str, list[tuple[str, bool]]]]:
    """(the outer state's tensors by key, each model tensor's state slots): none on a first step."""
    if spec.state_in is None:
        return lambda key: torch.empty(0), {}
    label = f"outer optimizer state {acc.storage.display(spec.state_in)}"
    state, entries = _source(acc, spec.state_in, label, opened)
    return state, state_in_specs(entries, layout, state_slots(spec.outer), label)  # it fits model and optimizer
