"""The merge engine's readers (merge.lanes): several reader threads per local input, payloads handed
over and hashed in segment order, errors in order, no hang on close.

Real files on the test machine's disk read through merge.reader.TensorFile (positional reads);
a `memory://` file for the single-thread case. Reads are slowed per segment where the test needs
a later thread's read to finish before an earlier one's (a real sleep in the read, not a mock).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from core.checkpoint import write_checkpoint
from core.errors import CheckpointError
from core.storage import Storage
from merge.lanes import READERS, Lane, Read
from merge.reader import InputError, TensorFile


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {f"t{i}": torch.randn(1000 + 37 * i, generator=g) for i in range(6)}


def _plan(f: TensorFile, chunk: int = 300) -> tuple[list[list[Read]], list[torch.Tensor]]:
    """Slices of at most `chunk` elements of every tensor in file order, and what each must hold."""
    plan, want = [], []
    for name, spec in f.specs.items():
        n = spec.shape[0]
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            plan.append([Read(None, f, spec, s, e, (e - s,))])
            want.append((name, s, e))
    return plan, want


def _drain(lane: Lane, n: int) -> list[torch.Tensor]:
    got = []
    for _ in range(n):
        slot, payload = lane.take()
        got.append(payload[None].clone())
        lane.free.put(slot)
    return got


def _read_all(plan: list[list[Read]], readers: int) -> list[torch.Tensor]:
    lane = Lane("m", 0, plan, depth=4)
    try:
        assert len(lane.threads) == readers
        return _drain(lane, len(plan))
    finally:
        lane.close()


def _open(tmp_path, tensors) -> tuple[Storage, TensorFile]:
    s = Storage(str(tmp_path))
    write_checkpoint(s, "m.safetensors", tensors)
    return s, TensorFile(s, "m.safetensors", "m", s.read_json("m.json"), io="buffered")


def test_several_readers_hand_over_in_order_and_hash_the_file_in_one_pass(tmp_path):
    tensors = _model()
    _, f = _open(tmp_path, tensors)
    assert f.positional
    fetch = f.fetch_tensor
    calls = iter(range(10**6))

    def uneven(*a, **kw):  # uneven read times: later reads often finish before earlier ones
        time.sleep((3 - next(calls) % 4) * 0.005)
        return fetch(*a, **kw)

    f.fetch_tensor = uneven
    plan, want = _plan(f)
    got = _read_all(plan, readers=min(READERS, 4))
    assert READERS > 1
    for t, (name, s, e) in zip(got, want):
        assert torch.equal(t, tensors[name][s:e])
    assert f._pos == f.size  # every byte hashed in order, as read: verify() reads nothing again
    f.verify()
    f.close()


def test_a_bad_segment_is_reported_after_the_good_ones_before_it_and_close_does_not_hang(tmp_path):
    tensors = _model()
    tensors["t3"][500] = float("nan")
    _, f = _open(tmp_path, tensors)
    plan, want = _plan(f)
    bad = next(i for i, (name, s, e) in enumerate(want) if name == "t3" and s <= 500 < e)
    lane = Lane("m", 7, plan, depth=4)
    got = _drain(lane, bad)
    with pytest.raises(InputError) as e:
        lane.take()
    assert e.value.ident == 7 and "t3" in str(e.value) and "NaN" in str(e.value)
    closer = threading.Thread(target=lane.close)
    closer.start()
    closer.join(10)
    assert not closer.is_alive()
    assert all(torch.equal(t, tensors[n][s:e]) for t, (n, s, e) in zip(got, want))
    f.close()


def test_a_failed_read_names_the_input(tmp_path):
    _, f = _open(tmp_path, _model())
    plan, _ = _plan(f)
    fetch, bad = f.fetch_tensor, plan[4][0].offset  # the fifth segment's read fails (whichever thread reads it)

    def failing(offset, *a, **kw):
        if offset == bad:
            raise CheckpointError("m: read failed at offset 1234 (EIO); check the storage and retry")
        return fetch(offset, *a, **kw)

    f.fetch_tensor = failing
    lane = Lane("m", 2, plan, depth=4)
    try:
        _drain(lane, 4)
        with pytest.raises(InputError, match="offset 1234"):
            lane.take()
    finally:
        lane.close()
        f.close()


def test_a_file_without_positional_reads_gets_one_reader(tmp_path):
    s = Storage("memory://lanes-test")
    tensors = _model()
    write_checkpoint(s, "m.safetensors", tensors)
    f = TensorFile(s, "m.safetensors", "m", s.read_json("m.json"))
    assert not f.positional
    plan, want = _plan(f)
    got = _read_all(plan, readers=1)
    assert all(torch.equal(t, tensors[n][s:e]) for t, (n, s, e) in zip(got, want))
    f.verify()
    f.close()


def test_a_file_in_memory_is_handed_over_as_views_with_no_slot_buffer():
    """A lane over a model held in memory (the round merge's global and state) hands over views
    of its bytes and gives its slots no read buffer: one would be allocated, with its pages, and
    never filled."""
    from merge.memory import MemoryFile

    mem = MemoryFile("held", [("a", "F32", (5000,)), ("b", "F32", (3,))])
    mem.view("a").copy_(torch.arange(5000.0))
    mem.view("b").copy_(torch.tensor([1.0, 2.0, 3.0]))
    plan = [[Read(None, mem, mem.specs["a"], s, s + 1000, (1000,))] for s in range(0, 5000, 1000)]
    plan.append([Read(None, mem, mem.specs["b"], 0, 3, (3,))])
    lane = Lane("held", 0, plan, depth=2)
    try:
        slots, got = set(), []
        for _ in plan:
            slot, payload = lane.take()
            slots.add(slot)
            got.append(payload[None].clone())
            assert payload[None].data_ptr() >= mem.data.data_ptr()  # a view of the held bytes
            lane.free.put(slot)
    finally:
        lane.close()
    assert torch.equal(torch.cat(got), torch.cat([torch.arange(5000.0), torch.tensor([1.0, 2.0, 3.0])]))
    assert all(slot.raw.numel() == 0 for slot in slots)


def test_close_while_one_reader_finishes_and_others_wait_does_not_hang(monkeypatch):
    """The interleaving that hung a round merge once in the full suite (a contribution refused
    during the outer step closes its lane early): reader A is finishing segment 0, reader B waits
    for its turn with segment 1, reader C is still reading segment 2. close() stops the lane, which
    wakes B, who leaves; A then finished segment 0 and used to clear the stop, so C, done reading,
    waited for B's turn forever and close() never returned. Slot.fetch/finish are replaced by
    versions that block on events, to force that order (the real ones are tested above)."""
    import types

    from merge import lanes

    finishing, finish_go, reading, read_go = (threading.Event() for _ in range(4))

    def fetch(self, reads):
        if reads[0].i == 2:
            reading.set()
            read_go.wait(10)
        return reads

    def finish(self, reads, fetched, check):
        if reads[0].i == 0:
            finishing.set()
            finish_go.wait(10)
        return {None: torch.zeros(1)}

    monkeypatch.setattr(lanes.Slot, "fetch", fetch)
    monkeypatch.setattr(lanes.Slot, "finish", finish)
    file = types.SimpleNamespace(positional=True, streams=False)
    plan = [[types.SimpleNamespace(file=file, i=i)] for i in range(3)]
    lane = Lane("m", 0, plan, depth=3, readers=3)
    assert finishing.wait(10) and reading.wait(10)
    deadline = time.monotonic() + 10
    while len(lane._cv._waiters) < 1 and time.monotonic() < deadline:  # B waiting for its turn
        time.sleep(0.01)
    closer = threading.Thread(target=lane.close, daemon=True)  # if it hangs, it must not keep pytest alive
    closer.start()
    while not lane._stop and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # B woken by the stop, gone
    finish_go.set()  # A hands over segment 0
    time.sleep(0.05)
    read_go.set()  # C has read segment 2 and wants its turn
    closer.join(10)
    assert not closer.is_alive(), "Lane.close() hung"
