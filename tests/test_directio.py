"""Reading merge inputs with O_DIRECT (merge.directio): same bytes, same digests, same merges.

Real files on the test machine's disk, real O_DIRECT reads and a real page-cache probe: a file
is dropped from the cache with posix_fadvise(DONTNEED) after fsync, which the kernel honours for
clean pages. Where the filesystem under pytest's tmp_path offers no O_DIRECT the direct cases are
skipped (the reader then reads through the page cache, which the other merge tests cover).
"""
from __future__ import annotations

import errno
import fcntl
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.checkpoint import write_checkpoint
from core.errors import CheckpointError
from core.storage import Storage
from merge import directio, engine, reader
from merge.lanes import Lane, Read
from merge.manual import MergeError, manual_merge
from merge.reader import ITEMSIZE, InputError, TensorFile


def _evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _direct_or_skip(path) -> None:
    fd = directio.open_direct(str(path))
    if fd is None:
        pytest.skip(f"no O_DIRECT on the filesystem of {path}")
    os.close(fd)


def _odd_model(seed: int) -> dict[str, torch.Tensor]:
    """Tensors whose offsets fall anywhere in a page, some smaller than a page, one of 3 bytes
    (not floating point: equal in every input, as a merge requires)."""
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(3001, generator=g), "b": torch.randn(7, 5, generator=g),
            "c": torch.randn(5000, generator=g).to(torch.bfloat16), "d": torch.tensor([1, 2, 3], dtype=torch.uint8),
            "e": torch.randn(4096 + 3, generator=g)}


def test_direct_reads_give_the_files_bytes_and_digest(tmp_path):
    s = Storage(str(tmp_path))
    write_checkpoint(s, "m.safetensors", _odd_model(0))
    _direct_or_skip(tmp_path / "m.safetensors")
    raw = (tmp_path / "m.safetensors").read_bytes()
    f = TensorFile(s, "m.safetensors", "m", s.read_json("m.json"), io="direct")
    fds = []
    pread = f._pread
    f._pread = lambda fd, *a: (fds.append(fd), pread(fd, *a))[1]
    try:
        assert f.direct
        for spec in f.specs.values():  # in file order: every byte hashed on the way
            region = directio.aligned_bytes(directio.region_bytes(spec.nbytes))
            got = f.read_tensor(f.data_start + spec.start, spec.nbytes, region, ITEMSIZE[spec.dtype])
            assert bytes(got.numpy()) == raw[f.data_start + spec.start: f.data_start + spec.end], spec.name
            assert got.data_ptr() % ITEMSIZE[spec.dtype] == 0
        assert f._dfd in fds and f._fd in fds  # both ways were taken: big tensors direct, small ones not
        f.verify()  # the digest of what was read equals the manifest's
    finally:
        f.close()


def test_direct_dropbehind_and_buffered_merges_are_bitwise_equal(tmp_path, monkeypatch):
    monkeypatch.setattr(directio, "DIRECT_MIN_BYTES", 1)  # every file is "large"
    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"in{i}.safetensors"))
        write_checkpoint(Storage(str(tmp_path)), f"in{i}.safetensors", _odd_model(i))
    _direct_or_skip(paths[0])
    _mincore_or_skip(paths[0])
    for io, way in (("direct", "direct"), ("auto", "dropbehind"), ("buffered", "buffered")):
        for p in paths:
            _evict(p)
        res = manual_merge(paths, str(tmp_path / f"{io}.safetensors"), weights=[1, 2, 4], io=io)
        assert res.read_ways == {way: 3}
    raw = (tmp_path / "direct.safetensors").read_bytes()
    assert raw == (tmp_path / "buffered.safetensors").read_bytes() == (tmp_path / "auto.safetensors").read_bytes()
    got = load_file(str(tmp_path / "direct.safetensors"))
    models = [_odd_model(i) for i in range(3)]
    want = (models[0]["a"] + 2 * models[1]["a"] + 4 * models[2]["a"]) / 7  # plain torch, the whole tensor
    assert torch.allclose(got["a"], want, atol=1e-6)


def _mincore_or_skip(path) -> None:
    """Skip unless the page cache can be asked about `path` and emptied of it (not on a tmpfs)."""
    _evict(path)
    share = _cached(path)
    if share is None:
        pytest.skip("mincore(2) unavailable: auto cannot tell cached files from cold ones")
    if share >= 0.5:
        pytest.skip(f"the filesystem of {path} keeps its pages in memory: nothing to read cold")


def _cached(path, start: int = 0, end: int | None = None) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        return directio.cached_fraction(fd, start, os.fstat(fd).st_size if end is None else end)
    finally:
        os.close(fd)


def test_a_dropbehind_merge_leaves_its_cold_inputs_out_of_the_page_cache(tmp_path, monkeypatch):
    """Read the usual way, a cold 4 MiB input ends up in the page cache; read drop-behind (auto),
    no page of it is left there once merged, and the merge is the same."""
    monkeypatch.setattr(directio, "DIRECT_MIN_BYTES", 1 << 16)
    monkeypatch.setattr(engine, "_MIN_CHUNK", 1 << 14)  # 64 KiB segments: many reads, many drops
    paths = []
    for i in range(2):
        write_checkpoint(Storage(str(tmp_path)), f"in{i}.safetensors", {"w": torch.randn(1 << 20), "b": torch.randn(5)})
        paths.append(str(tmp_path / f"in{i}.safetensors"))
    _mincore_or_skip(paths[0])
    for io in ("buffered", "auto"):
        for p in paths:
            _evict(p)
        assert max(_cached(p) for p in paths) < 0.5
        res = manual_merge(paths, str(tmp_path / f"{io}.safetensors"), io=io, buffer_bytes=1 << 20)
        left = [_cached(p) for p in paths]
        if io == "buffered":
            assert res.read_ways == {"buffered": 2} and min(left) > 0.9
        else:
            assert res.read_ways == {"dropbehind": 2} and max(left) == 0
    assert (tmp_path / "auto.safetensors").read_bytes() == (tmp_path / "buffered.safetensors").read_bytes()


def test_dropbehind_drops_the_prefix_in_file_order_and_only_the_range_out_of_it(tmp_path, monkeypatch):
    """Pages the kernel's read-ahead brings in behind the readers are dropped with the next read
    in file order; a read out of file order drops its own range only (the pages before it may
    still be wanted). The cache holds pages in folios of up to 2 MiB, and a folio is dropped only
    when the range covers all of it: the checks look 2 MiB inside each 8 MiB tensor."""
    monkeypatch.setattr(directio, "DIRECT_MIN_BYTES", 1 << 16)
    s = Storage(str(tmp_path))
    g = torch.Generator().manual_seed(0)
    write_checkpoint(s, "m.safetensors", {n: torch.randn(1 << 21, generator=g) for n in "abc"})
    path = tmp_path / "m.safetensors"
    _mincore_or_skip(path)
    _evict(path)
    f = TensorFile(s, "m.safetensors", "m", s.read_json("m.json"))
    margin = 2 << 20
    try:
        assert f.way == "dropbehind"
        spans = {n: (f.data_start + sp.start, sp.nbytes) for n, sp in f.specs.items()}

        def read(name):
            off, n = spans[name]
            return f.read_tensor(off, n, directio.aligned_bytes(directio.region_bytes(n)), 4)

        def inside(name):  # the share of the tensor's pages (all but its ends) in the cache
            off, n = spans[name]
            return _cached(path, off + margin, off + n - margin)

        def recache(name):  # what a late read-ahead does behind the readers (no read-ahead past it)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                off, n = spans[name]
                os.pread(fd, n, off)
            finally:
                os.close(fd)

        read("a")
        assert inside("a") == 0
        recache("a")
        assert inside("a") == 1
        read("c")  # out of order ("b" not read yet): its own range only, "a" stays
        assert inside("c") == 0 and inside("a") == 1
        read("b")  # in order again: everything before its end goes, "a" with it
        assert inside("a") == 0 and inside("b") == 0
        f.verify()  # every byte hashed on the way ("c" read again by verify)
    finally:
        f.close()


class _Recorder:
    """A digest that notes what it is fed, in `events`, beside the reads."""

    def __init__(self, sha, events: list) -> None:
        self.sha, self.events = sha, events

    def update(self, data) -> None:
        self.events.append(("hash", len(memoryview(data).cast("B"))))
        self.sha.update(data)

    def hexdigest(self) -> str:
        return self.sha.hexdigest()


def test_a_dropbehind_file_streams_through_one_reader_hashing_each_piece_as_it_is_read(tmp_path, monkeypatch):
    """Read drop-behind, a file is read in turn by one reader per lane, PIECE bytes at a time,
    each piece hashed before the next is read (it is still in the core's cache then); the lane
    hands over the file's bytes and the digest is the manifest's."""
    monkeypatch.setattr(directio, "DIRECT_MIN_BYTES", 1 << 16)
    monkeypatch.setattr(reader, "PIECE", 64 << 10)
    s = Storage(str(tmp_path))
    g = torch.Generator().manual_seed(1)
    tensors = {"a": torch.randn(300_001, generator=g), "b": torch.randn(70_000, generator=g)}
    write_checkpoint(s, "m.safetensors", tensors)
    _mincore_or_skip(tmp_path / "m.safetensors")
    f = TensorFile(s, "m.safetensors", "m", s.read_json("m.json"))
    events: list = []
    f._sha = _Recorder(f._sha, events)
    pread = f._pread
    f._pread = lambda fd, offset, out, need: (events.append(("read", len(out))), pread(fd, offset, out, need))[1]
    plan, want = [], []
    for name, spec in f.specs.items():
        for start in range(0, spec.shape[0], 100_000):  # 400 KB segments: 7 pieces each
            stop = min(start + 100_000, spec.shape[0])
            plan.append([Read(None, f, spec, start, stop, (stop - start,))])
            want.append(tensors[name][start:stop])
    lane = Lane("m", 0, plan, depth=4)
    try:
        assert f.streams and len(lane.threads) == 1
        for w in want:
            slot, payload = lane.take()
            assert torch.equal(payload[None], w)
            lane.free.put(slot)
    finally:
        lane.close()
    assert events and all(n <= 64 << 10 for _, n in events)
    assert [kind for kind, _ in events] == ["read", "hash"] * (len(events) // 2)
    assert sum(n for kind, n in events if kind == "hash") == f.size - f.data_start
    f.verify()
    f.close()


def test_a_read_failing_while_a_file_streams_names_the_input_and_offset(tmp_path, monkeypatch):
    """A streaming file is read in its reader's turn, after the segments before it are handed
    over: those arrive, then the failure, as an InputError naming the input and the offset."""
    monkeypatch.setattr(directio, "DIRECT_MIN_BYTES", 1 << 16)
    s = Storage(str(tmp_path))
    tensors = {"a": torch.randn(300_000)}
    write_checkpoint(s, "m.safetensors", tensors)
    _mincore_or_skip(tmp_path / "m.safetensors")
    f = TensorFile(s, "m.safetensors", "m", s.read_json("m.json"))
    spec = f.specs["a"]
    bad = f.data_start + spec.start + 400_000  # the second segment

    def pread(fd, offset, out, need):
        if offset >= bad:
            raise OSError(errno.EIO, "Input/output error")
        return os.preadv(fd, [out], offset)

    f._pread = pread
    plan = [[Read(None, f, spec, a, a + 100_000, (100_000,))] for a in range(0, 300_000, 100_000)]
    lane = Lane("m", 5, plan, depth=4)
    try:
        assert f.streams
        slot, payload = lane.take()
        assert torch.equal(payload[None], tensors["a"][:100_000])
        lane.free.put(slot)
        with pytest.raises(InputError) as e:
            lane.take()
        assert e.value.ident == 5 and f"read failed at offset {bad}" in str(e.value) and "m:" in str(e.value)
    finally:
        lane.close()
        f.close()


def test_direct_read_of_a_damaged_file_is_refused(tmp_path):
    s = Storage(str(tmp_path))
    write_checkpoint(s, "m.safetensors", {"w": torch.ones(10000)})
    _direct_or_skip(tmp_path / "m.safetensors")
    other = str(tmp_path / "o.safetensors")
    save_file({"w": torch.zeros(10000)}, other)
    raw = bytearray((tmp_path / "m.safetensors").read_bytes())
    raw[-5] ^= 0x01  # still finite: only the digest can tell
    (tmp_path / "m.safetensors").write_bytes(bytes(raw))
    with pytest.raises(MergeError, match=r"m\.safetensors: checksum does not match the manifest"):
        manual_merge([str(tmp_path / "m.safetensors"), other], str(tmp_path / "out.safetensors"), io="direct")
    assert not (tmp_path / "out.safetensors").exists()


def test_auto_reads_cold_large_files_dropping_behind_and_cached_ones_through_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(directio, "DIRECT_MIN_BYTES", 1 << 16)  # "large" for a test: 64 KiB
    s = Storage(str(tmp_path))
    write_checkpoint(s, "big.safetensors", {"w": torch.randn(1 << 16)})  # 256 KiB
    write_checkpoint(s, "small.safetensors", {"w": torch.randn(100)})
    _mincore_or_skip(tmp_path / "big.safetensors")
    (tmp_path / "big.safetensors").read_bytes()  # back in the page cache, as a file just written is

    def opened(key, io="auto"):
        f = TensorFile(s, key, key, None, io)
        try:
            return f.way, f.direct
        finally:
            f.close()

    assert opened("big.safetensors") == ("buffered", False)  # just written: in the page cache
    _evict(tmp_path / "big.safetensors")
    _evict(tmp_path / "small.safetensors")
    assert opened("big.safetensors") == ("dropbehind", False)  # cold and large: each page dropped once read
    assert opened("small.safetensors") == ("buffered", False)  # cold but small: nothing worth dropping
    if directio.open_direct(str(tmp_path / "big.safetensors")) is not None:
        assert opened("small.safetensors", "direct") == ("direct", True)  # forced


def test_the_cache_probe_samples_windows_and_reads_nothing(tmp_path, monkeypatch):
    """is_cached looks at WINDOWS windows spread over the file, not every page: on a file with
    its middle third cached, the sampled share is close to the exact one; with windows covering
    every page it is the exact one; and asking reads nothing into the cache."""
    monkeypatch.setattr(directio, "WINDOW", 16 << 10)
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(12 << 20))
    _mincore_or_skip(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead past what is read
        os.pread(fd, 4 << 20, 4 << 20)
        exact = directio.cached_fraction(fd, 0, 12 << 20)
        assert 0.3 <= exact <= 0.4
        calls = []
        mincore = directio._LIBC.mincore
        monkeypatch.setattr(directio._LIBC, "mincore", lambda *a: (calls.append(a[1]), mincore(*a))[1])
        sampled = directio.cached_fraction(fd, 0, 12 << 20, 32)
        assert len(calls) == 32 and set(calls) == {16 << 10} and abs(sampled - exact) < 0.1
        assert directio.cached_fraction(fd, 0, 12 << 20, 12 << 20 // (16 << 10)) == exact
        calls.clear()
        assert directio.is_cached(fd, 0, 12 << 20) is False
        assert len(calls) == directio.WINDOWS  # sampled, not every page
        os.pread(fd, 8 << 20, 0)
        assert directio.is_cached(fd, 0, 12 << 20) is True
        assert directio.cached_fraction(fd, 8 << 20, 12 << 20) == 0  # the probes read nothing in
    finally:
        os.close(fd)


def test_aligned_buffers_come_with_their_pages():
    """aligned_bytes allocates every page at once (MAP_POPULATE): the process's resident memory
    grows by the buffer's size before anything is written into it."""
    if not hasattr(__import__("mmap"), "MAP_POPULATE") or not os.path.exists("/proc/self/statm"):
        pytest.skip("no MAP_POPULATE or no /proc here")

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident()
    buf = directio.aligned_bytes(64 << 20)
    assert resident() - before >= 60 << 20
    assert buf.data_ptr() % directio.PAGE == 0 and buf.numel() == 64 << 20


def test_unknown_io_mode_is_refused(tmp_path):
    s = Storage(str(tmp_path))
    write_checkpoint(s, "m.safetensors", {"w": torch.ones(3)})
    with pytest.raises(ValueError, match="io mode 'fast' is not one of auto, direct, buffered"):
        TensorFile(s, "m.safetensors", "m", None, io="fast")
    with pytest.raises(MergeError, match="io mode 'fast'"):
        manual_merge([str(tmp_path / "m.safetensors")], str(tmp_path / "o.safetensors"), io="fast")


def test_truncated_file_read_direct_names_the_file(tmp_path):
    s = Storage(str(tmp_path))
    write_checkpoint(s, "m.safetensors", {"w": torch.ones(5000)})
    _direct_or_skip(tmp_path / "m.safetensors")
    f = TensorFile(s, "m.safetensors", "m", None, io="direct")
    try:
        os.truncate(tmp_path / "m.safetensors", f.data_start + 100)  # cut behind the reader's back
        spec = f.specs["w"]
        with pytest.raises(CheckpointError, match=r"m: file is truncated"):
            f.read_tensor(f.data_start + spec.start, spec.nbytes, directio.aligned_bytes(directio.region_bytes(spec.nbytes)))
    finally:
        f.close()


def test_a_refused_direct_read_falls_back_to_the_page_cache(tmp_path, monkeypatch, caplog):
    """A device that refuses an O_DIRECT read (EINVAL) after the open: the read is done buffered,
    the file is read buffered from then on, and the bytes and digest are the same."""
    s = Storage(str(tmp_path))
    write_checkpoint(s, "m.safetensors", {"w": torch.randn(5000)})
    _direct_or_skip(tmp_path / "m.safetensors")
    raw = (tmp_path / "m.safetensors").read_bytes()
    f = TensorFile(s, "m.safetensors", "m", s.read_json("m.json"), io="direct")
    direct_fd, preadv = f._dfd, os.preadv

    def refuse(fd, *a):
        if fd == direct_fd:
            raise OSError(22, "Invalid argument")
        return preadv(fd, *a)

    monkeypatch.setattr(os, "preadv", refuse)
    try:
        spec = f.specs["w"]
        got = f.read_tensor(f.data_start + spec.start, spec.nbytes, directio.aligned_bytes(directio.region_bytes(spec.nbytes)), 4)
        assert bytes(got.numpy()) == raw[f.data_start + spec.start: f.data_start + spec.end]
        assert not f.direct and "O_DIRECT read failed" in caplog.text
        f.verify()
    finally:
        f.close()


def test_after_a_refused_direct_read_its_descriptor_stays_open_until_close(tmp_path, monkeypatch):
    """Another reader thread may be using it (merge.lanes): close(), not the fallback, closes it."""
    s = Storage(str(tmp_path))
    write_checkpoint(s, "m.safetensors", {"w": torch.randn(5000)})
    _direct_or_skip(tmp_path / "m.safetensors")
    f = TensorFile(s, "m.safetensors", "m", s.read_json("m.json"), io="direct")
    direct_fd, preadv = f._dfd, os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, *a: (_ for _ in ()).throw(OSError(22, "Invalid argument"))
                        if fd == direct_fd else preadv(fd, *a))
    spec = f.specs["w"]
    f.read_tensor(f.data_start + spec.start, spec.nbytes, directio.aligned_bytes(directio.region_bytes(spec.nbytes)), 4)
    assert not f.direct
    os.fstat(direct_fd)  # still open
    f.close()
    with pytest.raises(OSError):
        os.fstat(direct_fd)


# -- writing ---------------------------------------------------------------------------------------
def _pieces(seed: int) -> list[bytes]:
    """Writes of every awkward size: empty, under a page, across pages, across staging buffers."""
    g = torch.Generator().manual_seed(seed)
    sizes = [0, 1, 4095, 4097, 3 * 4096 + 5, 10, 2 * 4096, 7 * 4096 + 1]
    return [bytes(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy()) for n in sizes]


def test_direct_writer_gives_the_exact_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(directio.DirectWriter, "CHUNK", 3 * 4096)  # many staging flushes for a small file
    path = tmp_path / "out.bin"
    w = directio.create_direct(str(path), 1, "direct")
    if w is None:
        pytest.skip(f"no O_DIRECT on the filesystem of {tmp_path}")
    assert fcntl.fcntl(w.fd, fcntl.F_GETFL) & os.O_DIRECT
    pieces = _pieces(0)
    with w:
        for p in pieces:
            assert w.write(memoryview(p)) == len(p)
    assert path.read_bytes() == b"".join(pieces)  # the last page's padding cut off
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_a_refused_direct_write_is_done_through_the_page_cache(tmp_path, monkeypatch, caplog):
    """A filesystem that opens with O_DIRECT but refuses the write (EINVAL; simulated: this
    machine's disk accepts it): the descriptor is switched to buffered writes, nothing is lost."""
    monkeypatch.setattr(directio.DirectWriter, "CHUNK", 2 * 4096)
    path = tmp_path / "out.bin"
    w = directio.create_direct(str(path), 1, "direct")
    if w is None:
        pytest.skip(f"no O_DIRECT on the filesystem of {tmp_path}")
    pwrite = os.pwrite

    def refuse_direct(fd, data, offset):
        if fd == w.fd and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refuse_direct)
    pieces = _pieces(1)
    with w:
        for p in pieces:
            w.write(p)
    assert path.read_bytes() == b"".join(pieces)
    assert "O_DIRECT write refused" in caplog.text


@pytest.mark.parametrize("fail_at", [0, 3])
def test_a_failed_background_write_is_raised_by_the_writer(tmp_path, monkeypatch, fail_at):
    """The staged buffers are written by a background thread: its error (a full disk, simulated:
    a tmpfs offers no O_DIRECT to fill) reaches the caller at its next write or at close, the
    descriptor is closed, nothing hangs."""
    monkeypatch.setattr(directio.DirectWriter, "CHUNK", 2 * 4096)
    path = tmp_path / "out.bin"
    w = directio.create_direct(str(path), 1, "direct")
    if w is None:
        pytest.skip(f"no O_DIRECT on the filesystem of {tmp_path}")
    pwrite, calls = os.pwrite, iter(range(10**6))

    def full(fd, data, offset):
        if fd == w.fd and next(calls) >= fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    fd = w.fd
    with pytest.raises(OSError) as e:
        with w:
            for p in _pieces(2) * 4:
                w.write(p)
    assert e.value.errno == errno.ENOSPC
    assert w.fd is None and not w._thread.is_alive()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_which_writes_go_direct(tmp_path, monkeypatch):
    monkeypatch.setattr(directio, "DIRECT_MIN_BYTES", 1 << 16)
    probe = directio.create_direct(str(tmp_path / "probe"), 1, "direct")
    if probe is None:
        pytest.skip(f"no O_DIRECT on the filesystem of {tmp_path}")
    probe.close()
    assert directio.create_direct(str(tmp_path / "a"), 1 << 20, "buffered") is None
    assert directio.create_direct(str(tmp_path / "b"), 1 << 10, "auto") is None  # small: not worth a disk round trip
    for name, size, mode in (("c", 1 << 20, "auto"), ("d", 1 << 10, "direct")):
        w = directio.create_direct(str(tmp_path / name), size, mode)
        assert w is not None
        w.close()
    with pytest.raises(FileExistsError):  # a new file only: never written over another's
        directio.create_direct(str(tmp_path / "c"), 1 << 20, "auto")


def test_merge_outputs_are_written_direct_unless_told_otherwise(tmp_path, monkeypatch):
    made = []
    create = directio.create_direct
    monkeypatch.setattr(directio, "create_direct", lambda *a: made.append(create(*a)) or made[-1])
    paths = []
    for i in range(2):
        write_checkpoint(Storage(str(tmp_path)), f"in{i}.safetensors", _odd_model(i))
        paths.append(str(tmp_path / f"in{i}.safetensors"))
    _direct_or_skip(paths[0])
    manual_merge(paths, str(tmp_path / "direct.safetensors"), io="direct")
    assert [type(w).__name__ for w in made] == ["DirectWriter"]
    made.clear()
    manual_merge(paths, str(tmp_path / "buffered.safetensors"), io="buffered")
    assert made == [None]
    assert (tmp_path / "direct.safetensors").read_bytes() == (tmp_path / "buffered.safetensors").read_bytes()
