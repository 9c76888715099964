"""Folding contributions on local disk into the running sum (merge.rounds.RunningSum).

Real files under tmp_path, read by a reader thread (merge.reading.Prefetch) through the one reader
of the format (core.checkpoint.TensorFile). The oracle is plain torch on whole tensors in the same
order: S = sum_i (w_i * x_i) in float32, each product rounded first.
"""
from __future__ import annotations

import pytest
import torch

from core.checkpoint import read_manifest
from core.checkpoint_writer import write_checkpoint
from core.storage import Storage
from merge import reading, rounds
from merge.rounds import Contribution, RunningSum

WEIGHTS = [1.0, 2.0, 0.5]


def _model(seed: int) -> dict[str, torch.Tensor]:
    """bf16 tensors of awkward sizes, and one that is not summed."""
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(3001, generator=g).bfloat16(), "b": torch.randn(7, 5, generator=g).bfloat16(),
            "c": torch.randn(70_000, generator=g).bfloat16(), "d": torch.tensor([1, 2, 3], dtype=torch.uint8)}


def _setup(tmp_path) -> Storage:
    s = Storage(str(tmp_path))
    write_checkpoint(s, "g.safetensors", _model(0), manifest={"round": 0})
    for i in range(len(WEIGHTS)):
        write_checkpoint(s, f"w{i}.safetensors", _model(i + 1), manifest={"round": 0, "worker": i})
    return s


@pytest.mark.parametrize("chunk", [None, 1000])
def test_folds_equal_plain_torch_in_the_same_order(tmp_path, monkeypatch, chunk):
    """chunk 1000: tensors a and c are read and added in slices of 1000 elements (c in 70)."""
    if chunk:
        monkeypatch.setattr(reading, "FOLD_CHUNK", chunk)
    s = _setup(tmp_path)
    acc = RunningSum(s, "g.safetensors")
    buffers = []
    for i, w in enumerate(WEIGHTS):
        assert acc.add(Contribution(i, f"w{i}.safetensors", w))
        buffers.append(sorted(b.raw.data_ptr() for b in acc.reader.buffers))
    want = {n: torch.zeros(t.shape) for n, t in _model(0).items() if t.is_floating_point()}
    for i, w in enumerate(WEIGHTS):
        for n, t in _model(i + 1).items():
            if n in want:
                want[n] += t.float() * w
    for n, t in want.items():
        assert torch.equal(acc.sums[n], t), n
    assert torch.equal(acc.sums["d"], torch.tensor([1, 2, 3], dtype=torch.uint8))
    assert [f.digest for f in acc.folded] == [read_manifest(s, f"w{i}.safetensors")["digest"] for i in range(3)]
    # the sum's own read buffers served every fold: grown by the first, the very same ones after
    assert buffers[0] == buffers[1] == buffers[2]
    # a buffer holds one read: a slice of 1000 bf16, or all of c (70,000 bf16)
    assert max(b.raw.numel() for b in acc.reader.buffers) == 2 * (chunk or 70_000)


def test_a_nan_in_a_local_contribution_is_refused_and_the_sum_is_what_it_was(tmp_path):
    s = _setup(tmp_path)
    acc = RunningSum(s, "g.safetensors")
    assert acc.add(Contribution(0, "w0.safetensors", 1.0))
    before = {n: acc.sums[n].clone() for n in ("a", "b", "c")}
    bad = _model(2)
    bad["c"][69_999] = float("nan")  # the last value of the last summed tensor: the rest was added already
    write_checkpoint(s, "bad.safetensors", bad, manifest={"round": 0, "worker": 1})
    assert not acc.add(Contribution(1, "bad.safetensors", 1.0))
    assert "tensor c has NaN or Inf values" in acc.rejected[1][1] and "worker 1" in acc.rejected[1][1]
    assert acc.add(Contribution(2, "w2.safetensors", 1.0))  # S was rebuilt from worker 0 before this
    for n, t in before.items():
        assert torch.equal(acc.sums[n], t + _model(3)[n].float()), n


def test_a_truncated_local_contribution_is_refused_naming_the_worker(tmp_path):
    s = _setup(tmp_path)
    raw = (tmp_path / "w1.safetensors").read_bytes()
    (tmp_path / "w1.safetensors").write_bytes(raw[:-100])
    acc = RunningSum(s, "g.safetensors")
    assert not acc.add(Contribution(1, "w1.safetensors", 1.0))
    assert "worker 1" in acc.rejected[1][1] and "truncated" in acc.rejected[1][1]


@pytest.mark.parametrize("weight", [0.0, -1.0, float("inf"), float("nan")])
def test_a_weight_that_is_not_positive_and_finite_is_one_rejection(tmp_path, weight):
    s = _setup(tmp_path)
    acc = RunningSum(s, "g.safetensors")
    assert acc.add(Contribution(0, "w0.safetensors", 1.0))
    assert not acc.add(Contribution(1, "w1.safetensors", weight))
    assert "not a positive finite number" in acc.rejected[1][1]
    assert [f.worker for f in acc.folded] == [0]


def test_any_exception_while_folding_is_one_rejection_not_a_crash(tmp_path, monkeypatch):
    """Whatever goes wrong with one contribution (here a bug-like TypeError deep in the read), it
    is refused with the reason and the sum stays that of the others."""
    s = _setup(tmp_path)
    acc = RunningSum(s, "g.safetensors")
    assert acc.add(Contribution(0, "w0.safetensors", 1.0))
    real = rounds.RunningSum._add

    def explode(self, c, label, name, x, start=0, stop=None):
        if c.worker == 1 and name == "c":
            raise TypeError("unhashable type: 'list'")
        return real(self, c, label, name, x, start, stop)
    monkeypatch.setattr(rounds.RunningSum, "_add", explode)
    assert not acc.add(Contribution(1, "w1.safetensors", 1.0))
    assert "TypeError: unhashable type" in acc.rejected[1][1] and "worker 1" in acc.rejected[1][1]
    assert torch.equal(acc.sums["a"], _model(1)["a"].float())


@pytest.fixture
def stalled_w1(tmp_path, stall_reads):
    """The run's storage, where reads of w1.safetensors' data block (tests/conftest.py)."""
    stall_reads("w1.safetensors")
    return _setup(tmp_path)


def test_a_read_that_stalls_rejects_its_contribution_instead_of_hanging(stalled_w1):
    """A contribution whose storage stops answering is refused once no data came for
    merge.reading.STALL_S, and the service goes on. The blocked read keeps its thread until it returns."""
    acc = RunningSum(stalled_w1, "g.safetensors")
    assert not acc.add(Contribution(1, "w1.safetensors", 1.0))
    assert "no data came from the storage for 0 s: it stalls" in acc.rejected[1][1], acc.rejected[1][1]
    assert acc.add(Contribution(0, "w0.safetensors", 1.0))


def test_after_a_stalled_read_the_next_fold_gets_buffers_of_its_own(stalled_w1):
    """The stalled read's thread may still write into the buffer it was filling: the sum must not
    hand that buffer to the next contribution."""
    acc = RunningSum(stalled_w1, "g.safetensors")
    before = list(acc.reader.buffers)
    assert not acc.add(Contribution(1, "w1.safetensors", 1.0))
    assert "it stalls" in acc.rejected[1][1], acc.rejected[1][1]
    assert not set(map(id, acc.reader.buffers)) & set(map(id, before))
    assert acc.add(Contribution(0, "w0.safetensors", 1.0))
    assert torch.equal(acc.sums["a"], _model(1)["a"].float())
