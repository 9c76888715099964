"""Folding contributions on local disk into the running sum (merge.incremental through merge.lanes).

Real files under tmp_path, read by a lane's reader threads (positional reads) and, with
`io` direct where the filesystem offers it, around the page cache. The oracle is plain torch on
whole tensors in the same order: S = sum_i (w_i * x_i) in float32, each product rounded first.
"""
from __future__ import annotations

import pytest
import torch

from core.checkpoint import read_manifest, write_checkpoint
from core.errors import CheckpointError
from core.storage import Storage
from merge import directio
from merge.rounds import Contribution
from merge import fold_reader
from merge.fold_reader import FOLD_SLOTS
from merge.incremental import RunningSum

WEIGHTS = [1.0, 2.0, 0.5]


def _model(seed: int) -> dict[str, torch.Tensor]:
    """bf16 tensors of awkward sizes (offsets anywhere in a page), and one that is not summed."""
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(3001, generator=g).bfloat16(), "b": torch.randn(7, 5, generator=g).bfloat16(),
            "c": torch.randn(70_000, generator=g).bfloat16(), "d": torch.tensor([1, 2, 3], dtype=torch.uint8)}


def _setup(tmp_path, monkeypatch, direct: bool) -> Storage:
    if direct:
        monkeypatch.setattr(directio, "DIRECT_MIN_BYTES", 1)  # every file is "large": read around the cache
    s = Storage(str(tmp_path))
    write_checkpoint(s, "g.safetensors", _model(0), manifest={"round": 0})
    for i in range(len(WEIGHTS)):
        write_checkpoint(s, f"w{i}.safetensors", _model(i + 1), manifest={"round": 0, "worker": i})
    return s


@pytest.mark.parametrize("chunk", [None, 1000])
@pytest.mark.parametrize("direct", [False, True])
def test_folds_equal_plain_torch_in_the_same_order(tmp_path, monkeypatch, direct, chunk):
    """chunk 1000: tensors a and c are read and added in slices of 1000 elements (c in 70)."""
    if chunk:
        monkeypatch.setattr(fold_reader, "FOLD_CHUNK", chunk)
    s = _setup(tmp_path, monkeypatch, direct)
    acc = RunningSum(s, "g.safetensors")
    buffers = []
    for i, w in enumerate(WEIGHTS):
        assert acc.add(Contribution(i, f"w{i}.safetensors", w))
        buffers.append(sorted(sl.raw.data_ptr() for sl in acc._slots))
    want = {n: torch.zeros(t.shape) for n, t in _model(0).items() if t.is_floating_point()}
    for i, w in enumerate(WEIGHTS):
        for n, t in _model(i + 1).items():
            if n in want:
                want[n] += t.float() * w
    for n, t in want.items():
        assert torch.equal(acc.sum.view(n), t), n
    assert torch.equal(acc.sum.view("d"), torch.tensor([1, 2, 3], dtype=torch.uint8))
    assert [f.digest for f in acc.folded] == [read_manifest(s, f"w{i}.safetensors")["digest"] for i in range(3)]
    # the sum's own read buffers served every fold: grown by the first, the very same ones after
    assert len(acc._slots) == FOLD_SLOTS and all(sl.raw.numel() > 0 for sl in acc._slots)
    assert buffers[0] == buffers[1] == buffers[2]
    # a slot holds one read: a slice of 1000 bf16, or all of c (70,000 bf16)
    assert max(sl.raw.numel() for sl in acc._slots) == directio.region_bytes(2 * (chunk or 70_000))


def test_a_nan_in_a_local_contribution_is_refused_and_the_sum_is_what_it_was(tmp_path, monkeypatch):
    s = _setup(tmp_path, monkeypatch, direct=False)
    acc = RunningSum(s, "g.safetensors")
    assert acc.add(Contribution(0, "w0.safetensors", 1.0))
    before = {n: acc.sum.view(n).clone() for n in ("a", "b", "c")}
    bad = _model(2)
    bad["c"][69_999] = float("nan")  # the last value of the last summed tensor: the rest was added already
    write_checkpoint(s, "bad.safetensors", bad, manifest={"round": 0, "worker": 1})
    assert not acc.add(Contribution(1, "bad.safetensors", 1.0))
    assert "tensor c has NaN or Inf values" in acc.rejected[1][1] and "worker 1" in acc.rejected[1][1]
    assert acc.add(Contribution(2, "w2.safetensors", 1.0))  # S was rebuilt from worker 0 before this
    for n, t in before.items():
        assert torch.equal(acc.sum.view(n), t + _model(3)[n].float()), n


def test_a_truncated_local_contribution_is_refused_naming_the_worker(tmp_path, monkeypatch):
    s = _setup(tmp_path, monkeypatch, direct=False)
    raw = (tmp_path / "w1.safetensors").read_bytes()
    (tmp_path / "w1.safetensors").write_bytes(raw[:-100])
    acc = RunningSum(s, "g.safetensors")
    assert not acc.add(Contribution(1, "w1.safetensors", 1.0))
    assert "worker 1" in acc.rejected[1][1] and "truncated" in acc.rejected[1][1]


def test_a_gated_sum_hands_over_each_slice_once_it_is_final():
    """The outer step reads the running sum through a GatedFile while the last fold adds to it: a
    read returns once the bytes it covers are final, not before, and not only at the tensor's end."""
    import threading
    from merge.memory import GatedFile, MemoryFile
    mem = MemoryFile("sum", [("a", "F32", (100,)), ("b", "F32", (10,))])
    mem.view("a").copy_(torch.arange(100.0))
    gate = GatedFile(mem)
    start = mem.specs["a"].start
    got: list[torch.Tensor] = []
    reader = threading.Thread(target=lambda: got.append(gate.read_tensor(start + 160, 40, None).clone()))
    gate.advance("a", 160)  # elements 0..39 final
    assert torch.equal(gate.read_tensor(start, 160, None).view(torch.float32), torch.arange(40.0))
    reader.start()  # wants elements 40..49
    reader.join(0.2)
    assert reader.is_alive() and got == []
    gate.advance("a", 200)
    reader.join(5)
    assert torch.equal(got[0].view(torch.float32), torch.arange(40.0, 50.0))
    errors: list[Exception] = []

    def read_b() -> None:
        try:
            gate.read_tensor(mem.specs["b"].start, 40, None)
        except CheckpointError as exc:
            errors.append(exc)
    late = threading.Thread(target=read_b)
    late.start()
    gate.finish(False)  # the fold was refused: a waiting reader is woken with the reason
    late.join(5)
    assert not late.is_alive() and "refused" in str(errors[0])
    with pytest.raises(CheckpointError, match="refused"):
        gate.verify()
