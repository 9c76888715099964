"""Robust aggregation of a round (round.aggregate): the element-wise median or trimmed mean of the
contributions in place of their weighted mean, so that one valid-looking but wrong contribution
(a diverged worker, a bad shard, a co-tenant's file with a worker's manifest) cannot drag a round.

Flower's FedMedian and FedTrimmedAvg are the reference: unweighted, per element; the trimmed
mean drops int(trim x K) values at each end. The running sum (merge.rounds) still validates every
contribution as it lands; at the merge, `Values` reads the accepted ones again, one tensor of
every contribution at a time (K x the largest tensor in memory), each in the running sum's space.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from core import codec
from core.checkpoint import TensorFile, read_manifest
from core.errors import CheckpointError
from core.storage import Storage
from merge.inputs import InputError, finite, refusal
from merge.methods import median, sorted_elementwise
from merge.reading import decoded, in_space, stored_in, whole_tensors

AGGREGATES = ("mean", "median", "trimmed_mean")


def trimmed_mean(values: Sequence[torch.Tensor], trim: float) -> torch.Tensor:
    """Per element, the mean of the K values once int(trim * K) are dropped at each end."""
    k = len(values)
    cut = int(trim * k)
    if 2 * cut >= k:
        raise ValueError(f"trimmed mean: trimming {cut} of {k} at each end leaves nothing; lower round.trim")
    return torch.stack(sorted_elementwise(values)[cut:k - cut]).mean(dim=0)


def aggregate(values: Sequence[torch.Tensor], how: str, trim: float) -> torch.Tensor:
    """`median` (merge.methods's: the mean of the middle two for even K) or `trimmed_mean` of the values."""
    if how == "median":
        return median(values, [1.0] * len(values))
    return trimmed_mean(values, trim)


class Values:
    """Each accepted contribution's value of one tensor at a time, in the running sum's space
    (`weights`, or `delta` = base - weights), read again from storage and checked against the digest
    it was folded with: a reader thread per contribution (merge.reading.whole_tensors), so
    that a read that stalls fails instead of holding the service. A contribution in the other space
    or against another base (a late worker's) is decoded whole once (merge.reading.decoded,
    guarded likewise) and converted per tensor. Whatever goes wrong with one contribution raises
    InputError naming its worker (the round is refused, that worker runs again)."""

    def __init__(self, storage: Storage, folded: Sequence[Any], space: str, base_digest: str,
                 shapes: Mapping[str, tuple[int, ...]]) -> None:
        """`shapes`: the float tensors of the global weights, in the order get() will ask for them."""
        self._stack = contextlib.ExitStack()
        self._sources: list[tuple[int, str, Any]] = []  # (worker, label, tensor iterator or whole weights)
        self._files: list[tuple[int, TensorFile]] = []
        self.space = space
        try:
            for f in folded:
                label = f"worker {f.worker} ({storage.display(f.key)})"
                with _naming(f.worker, label):
                    m = read_manifest(storage, f.key, label)
                    if m is None or m.get("digest") != f.digest:
                        raise CheckpointError(f"{label}: replaced or removed since it was validated; merge the round again")
                    tf = self._stack.enter_context(TensorFile(storage, f.key, m, label))
                    enc = codec.encoding_of(tf.metadata, label)
                    if stored_in(space, enc, base_digest):
                        self._files.append((f.worker, tf))
                        it = self._stack.enter_context(contextlib.closing(whole_tensors(tf, enc, shapes, label, f.worker)))
                        self._sources.append((f.worker, label, it))
                    else:
                        self._sources.append((f.worker, label, decoded(storage, f.key, label, f.worker)))
        except BaseException:
            self._stack.close()
            raise

    def get(self, name: str, base: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
        """Every contribution's tensor `name` (float32; a view of a read buffer until the next get)."""
        out = []
        for worker, label, src in self._sources:
            with _naming(worker, label):
                if isinstance(src, dict):
                    out.append(in_space(src[name], base(), self.space).to(torch.float32))
                    continue
                got, t = next(src)
                assert got == name, f"tensors asked out of order: {name}, read {got}"
                if not finite(t):  # it was at its fold: named here, before its NaN spreads to the aggregate
                    raise CheckpointError(f"{label}: tensor {name} is not finite now though it was at its fold: the "
                                          "file changed since; merge the round again")
                out.append(t)
        return out

    def verify(self) -> None:
        for worker, tf in self._files:
            with _naming(worker, tf.label):
                tf.verify()

    def close(self) -> None:
        self._stack.close()


@contextlib.contextmanager
def _naming(worker: int, label: str) -> Iterator[None]:
    """Whatever goes wrong with one contribution's reads is an InputError naming its worker."""
    try:
        yield
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - one contribution's failure, whatever it is
        raise InputError(worker, refusal(label, exc)) from None
