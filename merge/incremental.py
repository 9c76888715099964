"""A round's linear merge as an fp32 running sum, folded one contribution at a time.

The merge of a DiLoCo / FedAvg / lo-fi round is linear: the outer gradient is the weighted mean of
the workers' deltas, base - mean(weights). So each contribution can be folded into a running sum
S = sum_i w_i x_i the moment it lands, and the merge after the last worker lands reads about one
checkpoint (the last contribution, then base and optimizer state for the outer step) instead of K.

- Space: x_i are weights, or, when the contributions are deltas against this round's base
  (round.contribution: delta, core/codec.py), the deltas themselves: their mean is then the outer
  gradient directly (method `outer-delta`). A contribution is read by merge.fold_reader and coded
  inputs are decoded tensor by tensor. An input in the other space (a late worker's delta against
  its own older base) is decoded whole first.
- Order: S is summed in the order contributions were folded (`order`); floating-point sums depend
  on it. The non-incremental merge (merge.rounds.merge_summed without an accumulator: a resumed
  service, a replay, `round.stream_merge: false`) is this same code fed the list in its order, so
  the same inputs in the same order give the same bytes.
- Only validated contributions count: names, shapes and dtypes are checked before anything is
  added; values are checked finite and the digest checked as they stream; a contribution that
  fails after part of it was added makes S be rebuilt from the accepted ones (rare; exact).
- Memory: S is one fp32 copy of the model, plus a few tensors in flight. Nothing of S is
  persisted: after a crash it is rebuilt from the contributions on storage.
"""
from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from core import codec
from core.checkpoint import DTYPES, TensorSpec, open_checkpoint, read_manifest
from core.config import OuterConfig
from core.errors import CheckpointError, ContributionRejected
from core.storage import Storage
from merge.engine import compare_specs, merging, model_specs, run_merge
from merge.rounds import Contribution, MergeResult, QuorumError, round_outputs
from merge.fold_reader import FOLD_SLOTS, read_contribution
from merge.lanes import Slot, finite
from merge.memory import GatedFile, MemoryFile, load_model
from merge.reader import FLOATS, ITEMSIZE, InputError, Model, open_file_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Folded:
    worker: int
    key: str
    weight: float
    digest: str
    """Of the file as summed: a contribution replaced since is summed again."""
    nbytes: int


@dataclass
class RunningSum:
    """S = sum_i w_i x_i over the contributions folded so far, against the base at `base_key`."""

    storage: Storage
    base_key: str
    space: str | None = None
    """`weights` or `delta`; None: the space of the first contribution folded."""
    folded: list[_Folded] = field(default_factory=list)
    """What S sums, in summation order."""
    rejected: dict[int, tuple[str, str]] = field(default_factory=dict)
    """worker -> (digest@written_at of the refused file's manifest, why): a republished file is tried again."""
    state_key: str | None = None
    """The outer optimizer state the round's step reads, to hold in memory with `preload`."""
    preload: bool = False
    """Read the global weights and the outer state into memory now (the service does, while it
    waits for the workers), so that the outer step after the last fold reads nothing from storage."""
    step_in_place: bool = True
    """Run the outer step in the held copies (see `_outer_step`); False: on copies of them (what
    the step does over files; bench.stream_merge times both)."""

    def __post_init__(self) -> None:
        s, label = self.storage, f"global weights {self.storage.display(self.base_key)}"
        base = load_model(s, self.base_key, label, "base") if self.preload else \
            open_file_model(s, self.base_key, label, "base", require_manifest=True)
        try:
            self.ref = model_specs(base)
            self.base_sha = base.files[0].manifest["digest"]
            self.sum = MemoryFile("running sum", [(n, "F32" if sp.dtype in FLOATS else sp.dtype, sp.shape)
                                                  for n, sp in self.ref.items()])
            for n, sp in self.ref.items():  # non-float tensors are not summed: every input must equal the base's
                if sp.dtype not in FLOATS:
                    f = base.tensors[n][0]
                    f.read_into(f.data_start + sp.start, memoryview(self.sum.view(n).view(torch.uint8).reshape(-1).numpy()))
        finally:
            base.close()
        self._held: dict[str, Model] = {self.base_key: base} if self.preload else {}
        self._spent: list[Any] = []
        if self.preload and self.state_key is not None:
            try:
                self._held[self.state_key] = load_model(s, self.state_key, f"outer optimizer state {s.display(self.state_key)}",
                                                        "state")
            except CheckpointError as exc:  # not held: the merge reads it, and reports it there if it is still bad
                log.warning("merge: cannot hold the outer state in memory: %s", exc)
        self._dirty = False
        self._slots = [Slot() for _ in range(FOLD_SLOTS)]
        self._on_tensor: Callable[[str, int, int], None] | None = None
        """Told which elements of S are final, while the round's last contribution is folded."""

    def _input(self, key: str, label: str, ident: str) -> Model:
        """The checkpoint at `key` for the outer step: the copy held in memory if it is still the
        file on storage (same digest), else the file itself."""
        held = self._held.get(key)
        if held is not None and self._manifest(key).get("digest") == held.files[0].manifest["digest"]:
            return held
        return open_file_model(self.storage, key, label, ident, require_manifest=True)

    # -- folding ------------------------------------------------------------------------
    def add(self, c: Contribution) -> bool:
        """Fold `c` in; False (and the reason in `rejected`) if it cannot be merged."""
        ident = self._admit(c)
        if ident is None:
            return False
        t0 = time.perf_counter()
        try:
            sha, nbytes = self._fold(c)
        except ContributionRejected as exc:
            self._refuse(c, ident, exc)
            return False
        self._accept(c, ident, sha, nbytes, t0)
        return True

    def _admit(self, c: Contribution) -> str | None:
        """The identity of `c`'s file, S ready to take it; None if this very file was refused."""
        m = self._manifest(c.key)
        ident = f"{m.get('digest')}@{m.get('written_at')}"  # a republished file is tried again
        if c.worker in self.rejected and self.rejected[c.worker][0] == ident:
            return None
        if any(f.worker == c.worker for f in self.folded):
            raise ValueError(f"worker {c.worker} is folded already: a contribution counts once")
        if self._dirty:  # S was left partial or divided: bring it back to the sum over `folded`
            self._rebuild(list(self.folded))
        return ident

    def _refuse(self, c: Contribution, ident: str, exc: ContributionRejected) -> None:
        log.warning("merge: rejected worker %d: %s", exc.worker, exc.reason)
        self.rejected[c.worker] = (ident, exc.reason)
        if self._dirty:  # part of it was added: rebuild S from the accepted ones, in order
            self._rebuild(list(self.folded))

    def _accept(self, c: Contribution, ident: str, sha: str, nbytes: int, t0: float) -> None:
        self._dirty = False
        self.rejected.pop(c.worker, None)
        self.folded.append(_Folded(c.worker, c.key, c.weight, sha, nbytes))
        log.info("merge: folded worker %d in %.2fs", c.worker, time.perf_counter() - t0)

    def _manifest(self, key: str) -> dict[str, Any]:
        try:
            return read_manifest(self.storage, key) or {}
        except CheckpointError:  # damaged: _fold refuses the contribution, naming why
            return {}

    def _reset(self) -> None:
        for n, s in self.sum.specs.items():
            if s.dtype == "F32":
                self.sum.view(n).zero_()
        self.folded, self._dirty = [], False

    def _rebuild(self, todo: Sequence[_Folded]) -> None:
        self._reset()
        for f in todo:
            self.add(Contribution(f.worker, f.key, f.weight))

    def _fold(self, c: Contribution) -> tuple[str, int]:
        label = f"worker {c.worker} ({self.storage.display(c.key)})"
        try:
            m = open_file_model(self.storage, c.key, label, c.worker, require_manifest=True)
        except CheckpointError as exc:
            raise ContributionRejected(c.worker, str(exc)) from None
        try:
            f = m.files[0]
            enc = codec.encoding_of(f.metadata, label)
            if enc is not None and enc.base_digest != self.base_sha:
                return self._fold_whole(c, label, m)  # a delta against another base
            if self.space is None:
                self.space = "weights" if enc is None else "delta"
            if (enc is None) != (self.space == "weights"):
                return self._fold_whole(c, label, m)
            want = codec.stored_specs({n: (s.dtype, s.shape) for n, s in self.ref.items()}, enc) if enc else \
                {n: (s.dtype, s.shape) for n, s in self.ref.items()}
            problems = compare_specs({n: TensorSpec(n, d, s, 0, 0) for n, (d, s) in want.items()}, f.specs,
                                     "the global weights" if enc is None else f"a {enc.codec} delta of the global weights")
            if problems:
                raise ContributionRejected(c.worker, problems[0])
            self._stream(c, label, f, enc)
            return f.manifest["digest"], f.size
        except CheckpointError as exc:
            if isinstance(exc, ContributionRejected):
                raise
            raise ContributionRejected(c.worker, str(exc)) from None
        finally:
            m.close()

    def _stream(self, c: Contribution, label: str, f: Any, enc: codec.Encoding | None) -> None:
        """Add `f` as merge.fold_reader reads it: a slice of a plain tensor as it comes, a coded
        tensor once all its entries are in. The read slots are this sum's, reused by every fold
        (fresh pages cost more than reads)."""
        items = read_contribution(f, self.ref, label, c.worker, self._slots)
        with contextlib.closing(items), merging():
            for name, start, stop, got in items:
                if stop is not None:
                    self._add_slice(c, label, name, start, stop, got[name])
                else:
                    self._add_tensor(c, label, name, got, enc)

    def _add_slice(self, c: Contribution, label: str, name: str, start: int, stop: int, t: torch.Tensor) -> None:
        """Elements [start, stop) of float tensor `name`, stored plain; `t` is ours (a read buffer)."""
        self._accumulate(c, label, name, t.to(torch.float32), start, stop)
        if self._on_tensor is not None:  # the last fold of a round: these elements of S are final
            self._on_tensor(name, start, stop)

    def _add_tensor(self, c: Contribution, label: str, name: str, got: dict[str, torch.Tensor],
                    enc: codec.Encoding | None) -> None:
        self._add_one(c, label, name, got, enc)
        if self._on_tensor is not None:  # the last fold of a round: this tensor of S is final
            self._on_tensor(name, 0, math.prod(self.ref[name].shape))

    def _add_one(self, c: Contribution, label: str, name: str, got: dict[str, torch.Tensor],
                 enc: codec.Encoding | None) -> None:
        spec = self.ref[name]
        if spec.dtype not in FLOATS:
            if not torch.equal(got[name], self.sum.view(name)):
                raise ContributionRejected(c.worker, f"{label}: tensor {name} is {spec.dtype} (not floating point) and "
                                                     "differs from the global weights': such tensors are not merged, "
                                                     "they must be identical in every input")
            return
        x = codec.decode_tensor(name, spec.shape, enc, got.__getitem__) if enc else got[name].to(torch.float32)
        self._accumulate(c, label, name, x)

    def _accumulate(self, c: Contribution, label: str, name: str, x: torch.Tensor, start: int = 0,
                    stop: int | None = None) -> None:
        """S[name][start:stop] += w x, for `x` in float32 and ours (a read buffer or a decoded copy):
        it is scaled in place. The product is rounded before the add, not fused into it, so that a
        sum of two is the same in either order."""
        if not finite(x):
            raise ContributionRejected(c.worker, f"{label}: tensor {name} has NaN or Inf values: the model diverged "
                                                 "or the file is damaged; leave it out of the merge")
        self._dirty = True
        self.sum.view(name).view(-1)[start:stop].add_(x.reshape(-1).mul_(float(c.weight)))

    def _fold_whole(self, c: Contribution, label: str, m: Model) -> tuple[str, int]:
        """An input in the other space: decode it whole (codec.load_weights), convert per tensor."""
        sha = m.files[0].manifest["digest"]
        try:
            weights = codec.load_weights(self.storage, c.key, label)
        except CheckpointError as exc:
            raise ContributionRejected(c.worker, str(exc)) from None
        problems = compare_specs(self.ref, {n: TensorSpec(n, _dtype(t), tuple(t.shape), 0, 0) for n, t in weights.items()},
                                 "the global weights")
        if problems:
            raise ContributionRejected(c.worker, problems[0])
        if self.space is None:
            self.space = "weights"
        base = open_checkpoint(self.storage, self.base_key) if self.space == "delta" else None
        try:
            for name, t in weights.items():
                x = t if self.ref[name].dtype not in FLOATS else \
                    (base.get(name).to(torch.float32) - t.to(torch.float32) if base else t.to(torch.float32))
                self._add_tensor(c, label, name, {name: x}, None)
            if base is not None:
                base.verify()
        finally:
            if base is not None:
                base.close()
        return sha, m.bytes

    # -- the merge ----------------------------------------------------------------------
    def merge(self, contributions: Sequence[Contribution], out_key: str, outer: OuterConfig, *,
              state_in_key: str | None, state_out_key: str | None, min_inputs: int = 1,
              metadata: Mapping[str, str] | None = None, manifest: Mapping[str, Any] | None = None,
              defer_state: bool = False) -> MergeResult:
        """Make S the sum over exactly `contributions` (what is folded already, in its order, then
        the rest in the given order), then one outer step into `out_key` (and the outer state,
        returned unwritten as `pending_state` with `defer_state`)."""
        t0 = time.perf_counter()
        want = {c.worker: c for c in contributions}
        keep = []
        for f in self.folded:  # still wanted, with the same file and weight?
            c = want.get(f.worker)
            if c is None or c.key != f.key or c.weight != f.weight or \
                    self._manifest(f.key).get("digest") != f.digest:
                break
            keep.append(f)
        if len(keep) != len(self.folded) or self._dirty:
            self._rebuild(keep)
        done = {f.worker for f in self.folded}
        todo = [c for c in contributions if c.worker not in done]
        for c in todo[:-1]:
            self.add(c)

        def step(mean: Any, order: list[int]) -> Any:
            return self._outer_step(mean, out_key, outer, state_in_key, state_out_key, metadata,
                                    {**(manifest or {}), "merge_order": order}, defer_state)

        stats = None
        if todo and self.folded and len(self.folded) + 1 >= min_inputs:  # the last one folds beside the step
            stats = self._fold_during_step(todo[-1], step)
        elif todo:
            self.add(todo[-1])
        rejected = {w: why for w, (_, why) in self.rejected.items() if w in want}
        order = [f.worker for f in self.folded]
        if stats is None:
            if len(order) < min_inputs:
                raise QuorumError(f"only {len(order)} valid contribution(s) for {out_key}, the quorum is "
                                  f"{min_inputs}; rejected: {rejected or 'none'}", rejected)
            stats = step(self._mean(), order)
        nbytes = sum(f.nbytes for f in self.folded)
        return MergeResult(merged=sorted(order), rejected=rejected, bytes_read=nbytes,
                           seconds=time.perf_counter() - t0, outer_grad_norm=stats.grad_sq ** 0.5,
                           manifest=stats.manifests[0], order=order, pending_state=stats.pending_state)

    def _total(self, extra: float = 0.0) -> float:
        total = float(sum(f.weight for f in self.folded) + extra)
        if not total > 0:
            raise ValueError(f"weights must sum to a positive number, got {[f.weight for f in self.folded]}")
        return total

    def _divide(self, name: str, total: float, start: int = 0, stop: int | None = None) -> None:
        """Elements [start, stop) of tensor `name` of S divided by the total weight, in place (floats
        only: the rest are not sums)."""
        if self.sum.specs[name].dtype == "F32":
            self.sum.view(name).view(-1)[start:stop].div_(total)

    def _mean(self) -> MemoryFile:
        """S divided by the total weight, in place."""
        total = self._total()
        for n in self.sum.specs:
            self._divide(n, total)
        self._dirty = True  # S is now the mean: a later add() or merge() rebuilds the sum
        return self.sum

    def _fold_during_step(self, c: Contribution, step: Callable[[Any, list[int]], Any]) -> Any:
        """Fold `c`, the round's last contribution, while the outer step runs: each slice of the
        mean goes to the step the moment c's part of it is added (so the latency after the last
        worker lands is about the longer of the two, not their sum). None if `c` is refused (S is
        then rebuilt without it) or was refused before."""
        ident = self._admit(c)
        if ident is None:
            return None
        total, gate, got = self._total(c.weight), GatedFile(self.sum), {}

        def divided(name: str, start: int, stop: int) -> None:
            self._divide(name, total, start, stop)
            gate.advance(name, stop * ITEMSIZE[self.sum.specs[name].dtype])

        def fold() -> None:
            try:
                got["ok"] = self._fold(c)
            except BaseException as exc:  # reported by the step's gate, raised below
                got["error"] = exc
            finally:
                self._on_tensor = None  # before any rebuild of S, which must not divide
                gate.finish("ok" in got)

        t0 = time.perf_counter()
        self._on_tensor = divided
        thread = threading.Thread(target=fold, name=f"fold-last-{c.worker}", daemon=True)
        thread.start()
        try:
            stats = step(gate, [f.worker for f in self.folded] + [c.worker])
        except BaseException:
            thread.join()
            self._dirty = True
            if isinstance(got.get("error"), ContributionRejected):  # nothing was published: merge without it
                self._refuse(c, ident, got["error"])
                return None
            if got.get("error") is not None:
                raise got["error"] from None
            raise
        thread.join()
        self._accept(c, ident, *got["ok"], t0)
        self._dirty = True  # S is the mean now
        return stats

    def _outer_step(self, mean_file: Any, out_key, outer, state_in_key, state_out_key, metadata, manifest, defer_state):
        """The outer step from the mean into `out_key`. Over the global weights and state held in
        memory (`preload`) it runs in place: the held copies become the new global and state (no
        copy of either; the deferred state write reads them) and are no longer held: a merge
        done again reads the files."""
        s = self.storage
        base = self._input(self.base_key, f"global weights {s.display(self.base_key)}", "base")
        mean = Model("mean of the contributions", "sum", [mean_file], {n: (mean_file, sp) for n, sp in mean_file.specs.items()})
        state_in = None
        try:
            if state_in_key is not None:
                state_in = self._input(state_in_key, f"outer optimizer state {s.display(state_in_key)}", "state")
        except BaseException:
            base.close()
            raise
        in_place = self.step_in_place and base is self._held.get(self.base_key) and \
            (state_in is None or state_in is self._held.get(state_in_key))
        out, state_out = round_outputs(s, self.ref, out_key, state_out_key, outer, metadata, manifest)
        method, params = ("outer-delta", {"optimizer": outer}) if self.space == "delta" else \
            ("outer", {"optimizer": outer, "inner": "average"})
        if in_place:
            params["in_place"] = True
            self._held = {}  # overwritten from here on, whatever happens
            # ...and freed with this sum, not as this call returns: unmapping a model's pages is
            # slow (0.045 s for 242 MiB here), and the next round is waiting for this merge
            self._spent = [base, state_in]
        try:
            return run_merge([mean], [1.0], method, [out], params=params, base=base, state_in=state_in,
                             state_out=state_out, defer_state=defer_state)
        except InputError as exc:
            raise CheckpointError(exc.reason if exc.ident != "sum" else
                                  f"the weighted sum of the contributions overflowed: {exc.reason}") from None


def _dtype(t: torch.Tensor) -> str:
    return DTYPES[t.dtype]
