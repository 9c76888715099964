"""A checkpoint written as one file per rank (core/shards.py): what R ranks write, R' ranks read
back row for row, and every way a set can be damaged is refused naming the file.

Real files through the one writer; the oracle is torch.chunk (how FSDP2 cuts dim 0) and the
tensors as they were before they were split.
"""
from __future__ import annotations

import json
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.checkpoint_writer import write_checkpoint
from core.errors import CheckpointError
from core.layout import manifest_key
from core.shards import checkpoint_files, chunk, commit_shards, read_checkpoint, remove_checkpoint, shard_key, write_shard
from core.storage import Storage

KEY = "workers/worker_000/state_00003.safetensors"


def _tensors(rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    return {"w::exp_avg": torch.randn(rows, 3, generator=g), "b::exp_avg": torch.randn(rows, generator=g),
            "w::step": torch.tensor(7.0), "error_feedback/w": torch.randn(2, 2, generator=g)}


def _write_set(storage: Storage, tensors: dict[str, torch.Tensor], ranks: int, key: str = KEY) -> None:
    """What R ranks of a sharded worker write: their rows of each 1-D or 2-D tensor, the step count
    in every file, the feedback buffer in rank 0's."""
    entries = []
    for r in range(ranks):
        mine, rows = {}, {}
        for name, t in tensors.items():
            if name.startswith("error_feedback/"):
                if r == 0:
                    mine[name] = t
            elif t.dim():
                a, b = chunk(t.shape[0], r, ranks)
                mine[name], rows[name] = t[a:b].clone(), (a, b, t.shape[0])
            else:
                mine[name] = t
        entries.append(write_shard(storage, key, r, ranks, mine, rows, {"round": 3, "worker": 0}))
    commit_shards(storage, key, entries, {"round": 3, "worker": 0})


@given(total=st.integers(0, 40), ranks=st.integers(1, 9))
def test_chunk_is_how_torch_chunk_and_fsdp_cut_dim_0(total, ranks):
    pieces = list(torch.arange(total).chunk(ranks)) if total else []
    for r in range(ranks):
        a, b = chunk(total, r, ranks)
        want = pieces[r].tolist() if r < len(pieces) else []
        assert list(range(a, b)) == want


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), writers=st.integers(1, 5), readers=st.integers(1, 5))
def test_what_r_ranks_write_r_prime_ranks_read_back_row_for_row(rows, writers, readers):
    with tempfile.TemporaryDirectory() as tmp:
        s = Storage(tmp)
        tensors = _tensors(rows)
        _write_set(s, tensors, writers)
        assert read_checkpoint(s, KEY).keys() == tensors.keys()
        for name, t in read_checkpoint(s, KEY).items():  # a one-process worker: everything whole
            assert torch.equal(t, tensors[name]), name
        for r in range(readers):
            def want(name, shape, r=r):
                if name.startswith("error_feedback/"):
                    return r == 0
                return chunk(shape[0], r, readers) if shape else True
            got = read_checkpoint(s, KEY, want=want, prefer=r)
            for name, t in tensors.items():
                if name.startswith("error_feedback/"):
                    assert (name in got) == (r == 0)
                    continue
                a, b = chunk(t.shape[0], r, readers) if t.dim() else (None, None)
                assert torch.equal(got[name], t[a:b] if t.dim() else t), (name, r)


def test_a_plain_checkpoint_reads_by_rows_too(tmp_path):
    s = Storage(str(tmp_path))
    tensors = _tensors(5)
    write_checkpoint(s, KEY, tensors, manifest={"round": 3})
    got = read_checkpoint(s, KEY, want=lambda n, shape: (1, 4) if shape and not n.startswith("error") else False)
    assert torch.equal(got["w::exp_avg"], tensors["w::exp_avg"][1:4]) and "error_feedback/w" not in got


def test_only_the_rank_files_a_reader_needs_are_read(tmp_path):
    """A rank of a job with the same rank count reads its own file: another's damage is not its
    concern (the ranks then agree on one verdict: worker/state.py)."""
    s = Storage(str(tmp_path))
    _write_set(s, _tensors(8), 2)
    _flip_last_byte(tmp_path / shard_key(KEY, 1, 2))
    mine = read_checkpoint(s, KEY, want=lambda n, shape: chunk(shape[0], 0, 2) if shape and "/" not in n else not shape)
    assert mine["w::exp_avg"].shape == (4, 3)
    with pytest.raises(CheckpointError, match=r"rank 1 of 2 .*checksum does not match"):
        read_checkpoint(s, KEY)


def _flip_last_byte(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))


def _edit_json(path, edit) -> None:
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def _without_b_in_rank_2(path) -> None:
    """Rank 2's file written again without tensor b, the set's record of it updated to match."""
    s, key = Storage(str(path)), shard_key(KEY, 2, 3)
    m = json.loads((path / manifest_key(key)).read_text())
    tensors = read_checkpoint(s, key)
    del tensors["b::exp_avg"], m["rows"]["b::exp_avg"]
    entry = write_checkpoint(s, key, tensors, manifest={k: m[k] for k in ("rank", "ranks", "rows", "round", "worker")})
    _edit_json(path / manifest_key(KEY), lambda sm: sm["shards"][2].__setitem__("digest", entry["digest"]))


def _rank_1_of_round_2(path) -> None:
    """Rank 1's file as round 2's set wrote it (same shape, its manifest saying round 2) in round 3's
    set, the set's record of its digest updated to agree."""
    s, key = Storage(str(path)), shard_key(KEY, 1, 3)
    m = json.loads((path / manifest_key(key)).read_text())
    entry = write_checkpoint(s, key, read_checkpoint(s, key), manifest={**m, "round": 2})
    _edit_json(path / manifest_key(KEY), lambda sm: sm["shards"][1].__setitem__("digest", entry["digest"]))


DAMAGE = {
    "a rank file of another round": (_rank_1_of_round_2, r"rank 1 of 3 .*names round 2, the set's 3: a file of another"),
    "a missing rank file": (lambda p: (p / shard_key(KEY, 1, 3)).unlink(), r"rank 1 of 3 .*checkpoint file is missing"),
    "a missing rank manifest": (lambda p: (p / manifest_key(shard_key(KEY, 2, 3))).unlink(), r"rank 2 of 3 .*missing"),
    "a rank file replaced after the commit": (
        lambda p: write_checkpoint(Storage(str(p)), shard_key(KEY, 0, 3), {"x": torch.zeros(1)},
                                   manifest={"rank": 0, "ranks": 3, "rows": {}}),
        r"rank 0 of 3 .*replaced after the set was written"),
    "rows that do not tile": (
        lambda p: _edit_json(p / manifest_key(shard_key(KEY, 1, 3)), lambda m: m["rows"].__setitem__("w::exp_avg", [3, 5, 6])),
        r"rank 1 of 3 .*w::exp_avg's rows 3:5 of \[6, 3\] .*do not follow the rank files before it \(rows up to 2"),
    "rows that stop short": (
        lambda p: _edit_json(p / manifest_key(shard_key(KEY, 2, 3)), lambda m: m["rows"].pop("b::exp_avg")),
        r"rank 2 of 3 .*tensor b::exp_avg F32 \[2\] disagrees with the other rank files' copy or rows of it"),
    "a rank file without one tensor": (_without_b_in_rank_2, r"rows of tensor b::exp_avg do not tile its 6 rows"),
    "a total that disagrees": (
        lambda p: _edit_json(p / manifest_key(shard_key(KEY, 2, 3)), lambda m: m["rows"]["w::exp_avg"].__setitem__(2, 9)),
        r"rank 2 of 3 .*w::exp_avg's rows 4:6 of \[9, 3\] \(F32\) do not follow .*rows up to 4 of \[6, 3\]"),
    "a set listing a file outside its own": (
        lambda p: _edit_json(p / manifest_key(KEY), lambda m: m["shards"][1].__setitem__("file", "../../config.yaml")),
        r"rank 1's file is listed as '\.\./\.\./config\.yaml'"),
    "a set whose rank count and list disagree": (
        lambda p: _edit_json(p / manifest_key(KEY), lambda m: m.__setitem__("ranks", 4)), r"ranks 4 and its list of 3 rank files disagree"),
    "flipped bits in a rank file": (lambda p: _flip_last_byte(p / shard_key(KEY, 2, 3)), r"rank 2 of 3 .*checksum"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_set_is_refused_naming_the_file(tmp_path, case):
    s = Storage(str(tmp_path))
    _write_set(s, _tensors(6), 3)
    damage, message = DAMAGE[case]
    damage(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(s, KEY, label="worker 0 optimizer state")


def test_removing_a_set_removes_its_manifest_first_and_every_rank_file(tmp_path):
    s = Storage(str(tmp_path))
    _write_set(s, _tensors(4), 2)
    files = checkpoint_files(s, KEY)
    assert files[0] == manifest_key(KEY) and len(files) == 2 + 4  # set manifest, key, 2 x (file + manifest)
    (tmp_path / "workers/worker_000/state_00004-rank0of2.safetensors").write_bytes(b"another round's")
    remove_checkpoint(s, KEY)
    assert sorted(p.name for p in (tmp_path / "workers/worker_000").iterdir()) == ["state_00004-rank0of2.safetensors"]


def test_the_workers_loaders_read_sets_and_set_a_damaged_one_aside_whole(tmp_path):
    """worker/state.py's two entry points (the state snapshot a job starts from, the in-flight
    checkpoint it resumes) read sets through read_checkpoint: a set with one rank file damaged is
    moved to rejected/ with every file of it, and the snapshot before is taken."""
    from worker.state import inflight_tensors, usable_state

    s = Storage(str(tmp_path))
    older = _tensors(5)
    write_checkpoint(s, "workers/worker_000/state_00000.safetensors", older, manifest={"round": 0, "worker": 0})
    for key in ("workers/worker_000/state_00001.safetensors", "workers/worker_000/inflight_00002.safetensors"):
        _write_set(s, _tensors(5), 2, key)
        _flip_last_byte(tmp_path / shard_key(key, 1, 2))
    key, got = usable_state(s, 0, 2)
    assert key.endswith("state_00000.safetensors") and torch.equal(got["w::exp_avg"], older["w::exp_avg"])
    m = json.loads((tmp_path / "workers/worker_000/inflight_00002.json").read_text())
    assert inflight_tensors(s, "workers/worker_000/inflight_00002.safetensors", "in-flight", m.get("base_digest", ""),
                            10, float("inf")) is None  # not this base's: left alone
    _edit_json(tmp_path / "workers/worker_000/inflight_00002.json",
               lambda m: m.update(base_digest="0" * 32, steps_done=3))
    assert inflight_tensors(s, "workers/worker_000/inflight_00002.safetensors", "in-flight", "0" * 32, 10,
                            float("inf")) is None
    left = sorted(p.name for p in (tmp_path / "workers/worker_000").iterdir() if p.is_file())
    assert left == ["state_00000.json", "state_00000.safetensors"]
    rejected = sorted(p.name for p in (tmp_path / "workers/worker_000/rejected").iterdir())
    assert len([n for n in rejected if n.startswith("state_00001_")]) == 6  # set manifest, 2 files + 2 manifests, reason
    assert len([n for n in rejected if n.startswith("inflight_00002_")]) == 6
