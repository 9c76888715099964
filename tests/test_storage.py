"""One storage + checkpoint contract suite, run on every backend (local directory, memory://)."""
from __future__ import annotations

import errno
import os
import hashlib

import pytest
import torch
import xxhash
from safetensors.torch import load as st_load

from core.checkpoint import TensorFile, load_checkpoint, open_checkpoint, read_manifest
from core.checkpoint_writer import write_checkpoint
from core.errors import CheckpointError, StorageError
from core.storage import Storage

TENSORS = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.tensor([1.5, -2.0]).to(torch.bfloat16),
           "i": torch.tensor([7], dtype=torch.int64), "s": torch.tensor(3.0), "e": torch.empty(0, 4)}


class TestStorageContract:
    def test_write_read_list(self, storage):
        storage.write_bytes("x/one.bin", b"1")
        storage.write_json("x/two.json", {"k": 2})
        assert storage.read_bytes("x/one.bin") == b"1"
        assert storage.read_json("x/two.json") == {"k": 2}
        assert storage.list("x") == ["one.bin", "two.json"]
        assert storage.list("nothing-here") == []
        assert storage.read_json("x/absent.json") is None

    def test_failed_atomic_write_leaves_nothing(self, storage):
        with pytest.raises(RuntimeError):
            with storage.open_atomic("y/file.bin") as f:
                f.write(b"half")
                raise RuntimeError("killed mid-write")
        assert not storage.exists("y/file.bin")
        assert storage.list("y") == []
        assert storage.fs.find(storage.root) == []  # no temporary left either

    def test_temporaries_are_invisible_until_published(self, storage):
        with storage.open_atomic("z/f.bin") as f:
            f.write(b"data")
            assert storage.list("z") == []
        assert storage.list("z") == ["f.bin"]

    def test_corrupt_json_is_a_clear_error(self, storage):
        storage.write_bytes("bad.json", b"{not json")
        with pytest.raises(StorageError, match="bad.json is not valid JSON"):
            storage.read_json("bad.json")

    def test_create_exclusive(self, storage):
        assert storage.create_exclusive("lock", b"me")
        assert not storage.create_exclusive("lock", b"you")
        assert storage.read_bytes("lock") == b"me"

    def test_copy_and_remove(self, storage):
        storage.write_bytes("src", b"abc" * 1000)
        storage.copy("src", "sub/dst")
        assert storage.read_bytes("sub/dst") == b"abc" * 1000
        storage.remove("src")
        storage.remove("src")  # idempotent
        assert not storage.exists("src")


class TestCheckpointContract:
    def test_round_trip_and_manifest(self, storage):
        m = write_checkpoint(storage, "ck/w.safetensors", TENSORS, metadata={"k": "v"}, manifest={"round": 3})
        assert m["round"] == 3 and m["tensors"] == 5 and m["bytes"] == storage.size("ck/w.safetensors")
        tensors, meta, manifest = load_checkpoint(storage, "ck/w.safetensors")
        assert meta == {"k": "v"} and manifest["digest"] == m["digest"]
        for k, v in TENSORS.items():
            assert torch.equal(tensors[k], v) and tensors[k].dtype == v.dtype

    def test_files_are_plain_safetensors(self, storage):
        write_checkpoint(storage, "w.safetensors", TENSORS)
        loaded = st_load(storage.read_bytes("w.safetensors"))
        assert all(torch.equal(loaded[k], v) for k, v in TENSORS.items())

    def test_no_manifest_means_not_published(self, storage):
        write_checkpoint(storage, "w.safetensors", TENSORS)
        storage.remove("w.json")
        assert read_manifest(storage, "w.safetensors") is None
        with pytest.raises(CheckpointError, match="no manifest"):
            open_checkpoint(storage, "w.safetensors")

    def test_truncated_file_is_detected(self, storage):
        write_checkpoint(storage, "w.safetensors", TENSORS)
        raw = storage.read_bytes("w.safetensors")
        storage.fs.pipe_file(storage.path("w.safetensors"), raw[:-10])
        with pytest.raises(CheckpointError, match="truncated"):
            load_checkpoint(storage, "w.safetensors")

    def test_flipped_byte_is_detected(self, storage):
        write_checkpoint(storage, "w.safetensors", TENSORS)
        raw = bytearray(storage.read_bytes("w.safetensors"))
        raw[-20] ^= 0x01  # inside the data section
        storage.fs.pipe_file(storage.path("w.safetensors"), bytes(raw))
        with pytest.raises(CheckpointError, match="checksum does not match"):
            load_checkpoint(storage, "w.safetensors")

    def test_digest_is_xxh3_128_of_the_file(self, storage):
        m = write_checkpoint(storage, "w.safetensors", TENSORS)
        assert m["hash"] == "xxh3_128" and m["digest"] == xxhash.xxh3_128(storage.read_bytes("w.safetensors")).hexdigest()
        assert len(m["digest"]) == 32

    def test_digest_of_the_wrong_length_for_its_hash_is_refused(self, storage):
        m = write_checkpoint(storage, "w.safetensors", TENSORS)
        storage.write_json("w.json", {**m, "digest": m["digest"] * 2})  # 64 digits, but xxh3_128 has 32
        with pytest.raises(CheckpointError, match="digest has 64 hex digits where xxh3_128 has 32"):
            read_manifest(storage, "w.safetensors")

    @pytest.mark.parametrize("old", ["blake3", "sha256", "sha256 field"])
    def test_a_manifest_of_islands_0_1_is_refused_naming_the_version(self, storage, old):
        """Manifests hashed with BLAKE3 or sha256 (islands 0.1 before XXH3) are refused, not read:
        the message names the version and what to do."""
        write_checkpoint(storage, "w.safetensors", TENSORS, manifest={"round": 1})
        raw = storage.read_bytes("w.safetensors")
        m = {k: v for k, v in storage.read_json("w.json").items() if k not in ("hash", "digest")}
        storage.write_json("w.json", {**m, "sha256": hashlib.sha256(raw).hexdigest()} if old == "sha256 field" else
                           {**m, "hash": old, "digest": hashlib.sha256(raw).hexdigest()})
        with pytest.raises(CheckpointError, match=r"names hash (blake3|sha256): it was written by islands 0\.1 before "
                                                  r"2026-11-24, and islands 0\.2 reads only xxh3_128 manifests; finish"):
            load_checkpoint(storage, "w.safetensors")

    def test_an_unknown_hash_is_refused(self, storage):
        write_checkpoint(storage, "w.safetensors", TENSORS, manifest={"round": 1})
        old = {k: v for k, v in storage.read_json("w.json").items() if k not in ("hash", "digest")}
        storage.write_json("w.json", {**old, "hash": "md5", "digest": "a" * 64})
        with pytest.raises(CheckpointError, match="hash 'md5' is not xxh3_128"):
            read_manifest(storage, "w.safetensors")

    def test_garbage_is_not_a_checkpoint(self, storage):
        storage.write_bytes("g.safetensors", b"\xff" * 64)
        with pytest.raises(CheckpointError, match="implausible"):
            TensorFile(storage, "g.safetensors")

    def test_lazy_reads_only_what_is_asked(self, storage):
        write_checkpoint(storage, "w.safetensors", TENSORS)
        with open_checkpoint(storage, "w.safetensors") as ck:
            assert set(ck.keys()) == set(TENSORS)
            assert torch.equal(ck.get("i"), TENSORS["i"])
            ck.verify()  # out-of-order reads fall back to one sequential pass
            with pytest.raises(CheckpointError, match="has no tensor nope"):
                ck.get("nope")

    def test_killed_writer_publishes_nothing(self, storage):
        def stream():
            yield "a", TENSORS["a"]
            raise KeyboardInterrupt  # the process dies half way through the data
        with pytest.raises(KeyboardInterrupt):
            write_checkpoint(storage, "w.safetensors", specs=[("a", "F32", (3, 4), 48), ("b", "F32", (2,), 8)], stream=stream)
        assert storage.list("") == []


def test_full_disk_is_reported_at_once_with_the_fix(tmp_path, monkeypatch):
    # The error injected where it would be raised (the temporary's creation, by descriptor);
    # test_faults.py fills a real 1 MiB tmpfs for the same guarantee.
    s = Storage(str(tmp_path / "run"))
    calls, real_open = [], os.open

    def full(path, *a, **k):
        if str(path).startswith(".tmp-"):
            calls.append(1)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *a, **k)
    monkeypatch.setattr(os, "open", full)
    with pytest.raises(StorageError, match="disk is full.*orchestrate resume"):
        s.write_bytes("x.bin", b"data")
    assert len(calls) == 1  # not retried
    assert not (tmp_path / "run" / "x.bin").exists()


def test_transient_errors_are_retried(tmp_path, monkeypatch):
    s = Storage(str(tmp_path / "run"), backoff_s=0.001)
    s.write_bytes("x.bin", b"data")
    real = s.open_fd  # local reads open a descriptor themselves (core.storage)
    fails = [OSError(errno.EIO, "I/O error"), OSError(errno.ESTALE, "Stale file handle")]

    def flaky(key, *a, **k):
        if fails:
            raise fails.pop(0)
        return real(key, *a, **k)
    monkeypatch.setattr(s, "open_fd", flaky)
    assert s.read_bytes("x.bin") == b"data"


def test_large_local_reads_and_writes_drop_their_pages_behind(tmp_path, monkeypatch):
    """A large local file read or written once leaves no pages in the cache: each read drops every
    page before its end (read-ahead also brings pages just behind a reader), and a staged write
    drops everything written so far every DROP_EVERY bytes (posix_fadvise DONTNEED, spied on)."""
    import os

    import core.checkpoint as ck
    import core.storage as st
    calls: list[tuple[int, int, int]] = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n, advice)) or
                        real(fd, off, n, advice))
    monkeypatch.setattr(st, "DROP_EVERY", 1 << 16)
    monkeypatch.setattr(ck, "DROP_BEHIND_BYTES", 1 << 16)
    s = Storage(str(tmp_path))
    write_checkpoint(s, "big.safetensors", {"a": torch.ones(1 << 16), "b": torch.ones(1 << 16)})  # 2 x 256 KiB
    header = s.size("big.safetensors") - (1 << 19)
    # after each 256 KiB tensor: the whole prefix written so far
    assert calls == [(0, header + (1 << 18), os.POSIX_FADV_DONTNEED), (0, header + (1 << 19), os.POSIX_FADV_DONTNEED)]
    calls.clear()
    with open_checkpoint(s, "big.safetensors") as f:
        f.read("a")
        f.read("b")
        f.verify()
    drops = [(o, n) for o, n, a in calls if a == os.POSIX_FADV_DONTNEED]
    # everything before each read's end: the header's length, the header, tensor a, tensor b
    assert drops == [(0, 8), (0, f.data_start), (0, f.data_start + (1 << 18)), (0, f.size)]
