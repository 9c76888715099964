"""A persistent worker's replica of the round's merge: the next global weights made from the round's
compressed contributions instead of read whole.

Once round r is committed, its record (core.records) names the contributions the merge took, their
weights and the order it summed them in. A worker that still holds global_r (the base it trained
round r from) and the outer optimizer state_r reads those contributions through the checked reader
(core.checkpoint: each file's hash against its manifest, each manifest's digest against the
record's; its own it keeps from its write, when the record names its digest), folds them into a
sum and takes the outer step with the merge's own code, in the merge's order (core/outer.py), on
the CPU. The result is used only if it hashes to the published global's digest
(core.checkpoint_writer.digest_of, over the header the published file has): the same bytes as
reading it, for K - 1 contributions' bytes instead of W.

With round.replica auto it reads the global weights while that is the faster way: while its last
replay took longer than its last read (each measured from asking for the base to having it in the
model; said once). It reads them, saying why in one log line, whenever it cannot be sure:
round.replica never, a multi-rank worker, LTE or a robust aggregate (another merge), weights
contributions, a round that folded late inputs, contributions not coded against global_r, inputs
that are not fewer bytes than the global, anything missing, damaged or altered; and for the rest
of the job once a replayed global's digest differs (the arithmetic is not the merge's: reading the
global and, with momentum, the outer state again every round would cost more).

The outer state (Nesterov's momentum: one more fp32 copy of the weights in host memory) is kept
with the replica: empty at round 0, carried from one replayed round to the next, and read from
outer/state_r once after a dense read.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from core import codec
from core.assignment import Assignment
from core.checkpoint import DTYPES, TensorFile, load_checkpoint, read_manifest
from core.checkpoint_writer import digest_of
from core.config import Config, OuterConfig
from core.errors import CheckpointError, RunError, StorageError
from core.failpoints import armed
from core.layout import RunLayout
from core.outer import fold, fold_sparse, outer_at, outer_grad, outer_step_from_grad, state_in_specs, state_key, \
    state_slots
from core.records import RoundRecord, recorded_inputs
from core.storage import Storage

log = logging.getLogger(__name__)
L = RunLayout()
State = dict[str, dict[str, torch.Tensor]]
"""The outer optimizer's state: tensor name -> slot -> tensor."""


class Fallback(Exception):
    """Why this round's global weights are read whole instead: as expected (the bytes, a fold), said
    once; or `warn`: something on storage is not what the record says, said every time; or `stop`:
    the replayed bytes differed (another CPU's arithmetic, a bug), so the job stops replaying."""

    def __init__(self, why: str, warn: bool = False, stop: bool = False) -> None:
        super().__init__(why)
        self.warn, self.stop = warn or stop, stop


@dataclass
class Replica:
    """The global weights and outer state of the round this worker last started, to replay its merge."""

    cfg: Config
    off: str | None = None
    """Why this worker never replays (fixed for the job), or None."""
    round: int | None = None
    """The round whose global weights `weights` holds (None: nothing held)."""
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    digest: str = ""
    state: State | None = None
    """The outer state of `round`; None: not known (read from storage when needed)."""
    said: set[str] = field(default_factory=set)
    """Reasons logged already, so that an expected one (bytes) is said once, not every round."""
    mine: tuple[str, dict[str, torch.Tensor], dict[str, str]] | None = None
    """This worker's last contribution as it wrote it (digest, tensors, metadata): not read back."""
    seconds: dict[bool, float] = field(default_factory=dict)
    """round.replica auto: how long the last base took to have in the model, replayed (True) or read."""

    @classmethod
    def of(cls, cfg: Config, world: int, collective: bool) -> Replica:
        rc = cfg.round
        off = ("round.replica=never" if rc.replica == "never" else
               "algorithm lte merges heads, not outer gradients" if cfg.algorithm == "lte" else
               "contributions are weights, not deltas" if rc.contribution != "delta" else
               f"round.aggregate {rc.aggregate} is not the running sum's mean" if rc.aggregate != "mean" else
               "round.late_policy fold adds late inputs to rounds" if rc.late_policy == "fold" else
               f"a worker of {world} ranks" if world > 1 or collective else
               "the worker is not persistent" if rc.worker_mode != "persistent" else None)
        if off:  # said where a user may expect the replica: with deltas
            (log.info if rc.contribution == "delta" else log.debug)("replica: reading the global weights every "
                                                                    "round (%s)", off)
        return cls(cfg, off)

    def hold(self, a: Assignment, weights: dict[str, torch.Tensor] | None, digest: str) -> None:
        """Round a.round starts from `weights` (digest `digest`; None: not known in full): held
        if they are the global weights."""
        r = a.round
        if weights is None or self.off or a.base_key != L.global_weights(r):
            self.round, self.weights, self.state = None, {}, None
            return
        if self.round != r - 1 or r == 0:
            self.state = {} if r == 0 else None  # round 0's merge starts from zero state
        self.round, self.weights, self.digest = r, weights, digest

    def next_global(self, storage: Storage, a: Assignment, digest: str) -> dict[str, torch.Tensor] | None:
        """Global weights a.round (digest `digest`) replayed from round a.round - 1, in the held
        buffers; None (the reason logged) when they are to be read instead."""
        if self.off or self.round is None or self.round != a.round - 1 or a.base_key != L.global_weights(a.round):
            return None  # a first round, a requeue, a worker's own base (late_policy continue): read, as always
        if self.cfg.round.replica == "auto" and self.seconds.get(True, 0.0) > self.seconds.get(False, math.inf):
            self._say(f"worker {a.worker} round {a.round}: reading the global weights while that is the faster way "
                      f"(replaying took {self.seconds[True]:.2f}s, reading {self.seconds[False]:.2f}s)", key="slower")
            self.round, self.state = None, None  # the held outer state goes stale with this round's merge
            return None
        try:
            return self._replay(storage, a, digest)
        except Fallback as why:
            self.off = str(why) if why.stop else None
            self._say(f"worker {a.worker} round {a.round}: reading the global weights"
                      f"{' from now on' if why.stop else ''}: {why}", warn=why.warn)
        except Exception as exc:  # noqa: BLE001 - whatever a planted record or file does, the global is read
            what = str(exc) if isinstance(exc, (CheckpointError, RunError, StorageError)) else \
                f"a recorded input could not be replayed ({type(exc).__name__}: {exc})"
            self._say(f"worker {a.worker} round {a.round}: reading the global weights: {what}", warn=True)
        self.round, self.state = None, None  # the held weights may be part-stepped: read global_r+1 whole
        return None

    def took(self, replayed: bool, seconds: float) -> None:
        """The base of a round was in the model `seconds` after it was asked for, replayed or read:
        what round.replica auto chooses by (a read is timed every round it is chosen, so a
        filesystem that slows down brings the replica back)."""
        self.seconds[replayed] = seconds

    def _say(self, line: str, warn: bool = False, key: str | None = None) -> None:
        key = key or line.split(": ", 2)[-1]
        if warn or key not in self.said:
            self.said.add(key)
            (log.warning if warn else log.info)("replica: %s", line)

    def _replay(self, storage: Storage, a: Assignment, digest: str) -> dict[str, torch.Tensor]:
        r = a.round - 1
        record = RoundRecord.load(storage, r)
        if record is None:
            raise Fallback(f"round {r} has no record", warn=True)
        inputs, problem = recorded_inputs(record.to_json())
        if problem or record.global_digest != digest:
            raise Fallback(problem or f"round {r}'s record names another global than the published one", warn=True)
        if record.folded:
            raise Fallback(f"round {r} folded late contributions")
        published = read_manifest(storage, a.base_key)
        if published is None or published["digest"] != digest:
            raise Fallback(f"the global weights {storage.display(a.base_key)} changed since they were published", warn=True)
        sizes = [record.contribution_bytes.get(str(i.worker)) for i in inputs]
        if None in sizes or sum(sizes) >= published.get("bytes", 0):  # type: ignore[arg-type]
            raise Fallback(f"the round's {len(inputs)} contributions are not fewer bytes than the global weights")
        cfg = outer_at(self.cfg.outer, r)
        state = self._state(storage, r, cfg)
        sums = {n: torch.zeros(t.shape) for n, t in self.weights.items() if t.is_floating_point()}
        for i, size in zip(inputs, sizes):
            self._fold(storage, i.worker, i.key, i.weight, (record.contrib_digest.get(str(i.worker)), size), sums)
        total = float(sum(i.weight for i in inputs))
        new_state: State = {}
        for name, s in sums.items():
            b = self.weights[name]
            new, new_state[name], _ = outer_step_from_grad(b, outer_grad(s, total, b, "delta"), state.get(name, {}),
                                                         cfg, in_place=True)
            if new.data_ptr() != b.data_ptr():  # a global not in fp32: the step worked on a copy
                b.copy_(new)
        if armed(f"worker_{a.worker:03d}.replica"):  # tests: a replica that went wrong must not be used
            self.weights[next(iter(sums))].view(-1)[0].add_(1.0)
        with TensorFile(storage, a.base_key, published, f"global weights {storage.display(a.base_key)}") as f:
            specs = sorted(f.specs.values(), key=lambda sp: sp.start)
            made = digest_of([(sp.name, sp.dtype, sp.shape, sp.nbytes) for sp in specs], f.metadata,
                             ((sp.name, self.weights[sp.name]) for sp in specs if sp.name in self.weights))
        if made != digest:
            raise Fallback(f"the replayed global's digest {made[:12]} is not the published {digest[:12]}", stop=True)
        self.state = new_state
        return self.weights

    def _state(self, storage: Storage, r: int, cfg: OuterConfig) -> State:
        """The outer state round r's merge started from: held, or read once from outer/state_r."""
        if self.state is not None or not state_slots(cfg):
            return self.state or {}
        label = f"outer optimizer state {storage.display(L.outer_state(r))}"
        tensors, _, _ = load_checkpoint(storage, L.outer_state(r), label)
        layout = [(n, DTYPES[t.dtype], tuple(t.shape)) for n, t in self.weights.items()]
        have = state_in_specs({k: (DTYPES[t.dtype], tuple(t.shape)) for k, t in tensors.items()}, layout,
                              state_slots(cfg), label)
        log.info("replica: outer optimizer state of round %d read once from %s", r, storage.display(L.outer_state(r)))
        return {n: {slot: tensors[state_key(n, slot)] for slot, _ in slots} for n, slots in have.items()}

    def _fold(self, storage: Storage, worker: int, key: str, weight: float, recorded: tuple[str | None, int],
              sums: dict[str, torch.Tensor]) -> None:
        """Add one recorded input (the record's (digest, bytes) of it), as the merge added it: its
        delta's kept entries, or all of it. Its size is checked against the record's before a byte
        of it is read (TensorFile compares the file with its manifest)."""
        label = f"worker {worker}'s contribution {storage.display(key)}"
        if self.mine is not None and self.mine[0] == recorded[0]:  # its own, hashed as it was written
            _, tensors, meta = self.mine
        else:
            m = read_manifest(storage, key, label)
            if m is None or (m["digest"], m.get("bytes")) != recorded:
                raise Fallback(f"{label} is not the file the round's record merged (missing, replaced, or not the "
                               "size the record says)", warn=True)
            with TensorFile(storage, key, m, label) as f:  # the manifest just read, not read again
                tensors, meta = f.load_all(verify=True), f.metadata
        enc = codec.encoding_of(meta, label)
        if enc is None or enc.base_digest != self.digest:
            raise Fallback(f"{label} is not a delta against the round's global weights", warn=True)
        get = lambda n: codec.entry(tensors, n, label)  # noqa: E731
        for name, s in sums.items():
            shape = tuple(self.weights[name].shape)
            if enc.sparse:
                fold_sparse(s, *codec.sparse_tensor(name, shape, enc, get), weight)
            else:
                fold(s, codec.decode_tensor(name, shape, enc, get), weight)
