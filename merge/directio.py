"""Reading and writing big local files without filling the page cache, and the aligned buffers that needs.

A merge reads every input once and never again, so the page cache only costs it: on the
development machine a cold buffered read of 8 GiB spent 4 to 21 CPU-seconds in the kernel
(page allocation, copy, reclaim), enough to leave a 2-core machine no time for hashing and maths
(docs/benchmarks.md). A file that is already in the cache (a contribution written on this node a
moment ago) is the opposite case: copying it from memory beats reading the disk again. So
`read_way` picks, for a large local file that is mostly absent from the cache (mincore(2) on a
mapping of it, which neither reads nor caches anything: a probing read would start the very
read-ahead it asks about), reads through the cache with the kernel's read-ahead, each page
dropped once read (`advise_dropbehind`, `drop_behind`); anything else (a small or cached file, a
platform without mincore) is read through the cache as usual. O_DIRECT reads (`direct`) stay
for `--io direct`: they were the default until the drop-behind reads measured faster.
Outputs are written with O_DIRECT (`DirectWriter`).

O_DIRECT wants the file offset, the length and the buffer's address aligned to the device's
logical block; `PAGE` (4 KiB) covers every common device. Reads are widened to page boundaries
into page-aligned buffers (`aligned_bytes`); the caller is told where its bytes start.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import queue
import threading

import numpy as np
import torch

log = logging.getLogger(__name__)

PAGE = 4096
DIRECT_MIN_BYTES = 64 << 20
"""Files smaller than this are read and written through the page cache as usual in `auto` mode
(small files are cheap either way, and an O_DIRECT write waits for the disk)."""
IO_MODES = ("auto", "direct", "buffered")
WINDOWS, WINDOW = 64, 256 << 10
"""How `is_cached` samples a file: 64 windows of 256 KiB (4096 pages, ~0.15 ms) at any size."""


def aligned_bytes(n: int) -> torch.Tensor:
    """A page-aligned uint8 tensor of n bytes (private anonymous memory, usable as an O_DIRECT
    buffer), its pages allocated at once: every such buffer is filled right away, and one
    populating call costs half what faulting its pages in one by one does (512 MiB of read
    slots: 0.17 against 0.35 CPU-s here)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(-1, max(n, PAGE), flags=flags)
    return torch.frombuffer(mm, dtype=torch.uint8)[:n]  # the tensor keeps the mapping alive


def region_bytes(n: int) -> int:
    """Buffer space a read of n bytes needs when it may be widened to page boundaries."""
    return (n + 2 * PAGE + PAGE - 1) // PAGE * PAGE


def page_span(offset: int, n: int) -> tuple[int, int]:
    """The page-aligned byte range [start, end) that covers [offset, offset + n)."""
    return offset - offset % PAGE, -(-(offset + n) // PAGE) * PAGE


def cached_fraction(fd: int, start: int, end: int, windows: int = 0) -> float | None:
    """The share of [start, end) of the file that is in the page cache, from mincore(2) on a
    mapping of it (which reads nothing and caches nothing); None where that cannot be asked.
    `windows` > 0: the share of that many evenly spaced windows of WINDOW bytes instead (mincore
    costs ~35 ns a page here: 9 ms for every page of a 1 GiB file)."""
    if _LIBC is None or end <= start:
        return None
    off = start - start % PAGE
    length = end - off
    addr = _LIBC.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, off)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return None
    try:
        pages = (length + PAGE - 1) // PAGE
        window = WINDOW // PAGE
        if windows <= 0 or windows * window >= pages:
            spans = [(0, pages)]
        else:
            step = (pages - window) // (windows - 1) if windows > 1 else 0
            spans = [(i * step, window) for i in range(windows)]
        resident = 0
        vec = (ctypes.c_ubyte * max(n for _, n in spans))()
        for first, n in spans:
            if _LIBC.mincore(addr + first * PAGE, min(n * PAGE, length - first * PAGE), vec) != 0:
                return None
            resident += int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8, count=n) & 1))  # bit 0: resident
        return resident / sum(n for _, n in spans)
    finally:
        _LIBC.munmap(addr, length)


def is_cached(fd: int, start: int, end: int) -> bool | None:
    """Is most of [start, end) of the file in the page cache (a few pages that outlived an
    eviction do not make a file cached)? None when the kernel or the filesystem cannot say.
    Judged from WINDOWS windows spread over the range: a cached file is cached in long runs."""
    share = cached_fraction(fd, start, end, WINDOWS)
    return None if share is None else share >= 0.5


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        return libc
    except (OSError, AttributeError):  # not Linux/glibc-like: no residency check, reads stay buffered
        return None


_LIBC = _libc()


def open_direct(path: str) -> int | None:
    """An O_DIRECT descriptor of `path`, or None where the filesystem does not offer it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            log.debug("%s: O_DIRECT open failed (%s); reading through the page cache", path, exc)
        return None


def mode_problem(mode: str) -> str | None:
    """Why `mode` is not an io mode (IO_MODES), or None if it is one."""
    return None if mode in IO_MODES else f"io mode {mode!r} is not one of {', '.join(IO_MODES)}"


def read_way(mode: str, fd: int, data_start: int, size: int) -> str:
    """How to read a local file under `mode` (checked: mode_problem): `direct` (O_DIRECT, forced
    only), `dropbehind` (`auto`, a large file mostly absent from the page cache: see
    `advise_dropbehind`) or `buffered` (forced, small, cached, or the kernel cannot say)."""
    if mode == "buffered" or size <= data_start:
        return "buffered"
    if mode == "direct":
        return "direct"
    if size < DIRECT_MIN_BYTES or is_cached(fd, data_start, size) is not False:
        return "buffered"
    return "dropbehind"


def advise_dropbehind(fd: int) -> None:
    """Ask for the kernel's sequential read-ahead on `fd` (double the device's window): a file to
    be read once, front to back, whose pages are dropped once read (`drop_behind`).

    Why not O_DIRECT, which never fills the cache at all: an O_DIRECT read queues only its own
    requests, and on the development machine 8 cold 1 GiB files read with O_DIRECT gave 1.3-2.2
    GB/s however many reads were in flight (4-16 per file, 1-16 MiB each) where the kernel's
    read-ahead gave 2.0-2.7; the merge itself read at 1.5-1.6 GB/s with O_DIRECT and 1.7-1.9 this
    way (docs/benchmarks.md). The pages must be dropped, though: a cold buffered read that lets
    the cache grow costs several times the CPU (page allocation, then reclaim)."""
    with contextlib.suppress(OSError, AttributeError):  # advice only: no posix_fadvise, nothing lost
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


def drop_behind(fd: int, start: int, end: int) -> None:
    """Drop the file's cached pages in [start, end) (clean pages only: nothing is lost). The
    caller passes start = 0 while it reads in file order: with several reader threads the
    kernel's read-ahead now and then reads in pages just behind the readers, after their range
    was dropped, and dropping only the latest range let 2.4 GB of those pile up in an 8 GiB merge
    (0.5 GB, the read-ahead in flight, when the whole prefix is dropped each time; dropping an
    empty 1 GiB range takes about a microsecond)."""
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)


class DirectWriter:
    """Sequential writes of a new local file around the page cache (O_DIRECT).

    A merge writes each output once and does not read it back, and on the development machine a
    buffered write of a 240 MiB file cost 0.06 to 0.55 CPU-seconds in the kernel (page allocation
    and reclaim; the disk write itself came later, from a kernel thread), against 0.05 for the same
    bytes written directly (docs/benchmarks.md). Bytes are staged in page-aligned buffers, and a
    full buffer is written by a background thread (positional writes) while the caller fills the
    next: an O_DIRECT write waits for the disk, and the caller (the merge's writer thread) has the
    output's digest to compute meanwhile (242 MiB written and hashed: 0.28 s one after the other,
    0.14-0.16 s this way). The tail is padded to a page and the file cut back to its length
    on close. If the kernel refuses an O_DIRECT write after all, the descriptor is switched to
    buffered writes (fcntl) and the same bytes written again. A failed write is raised by the next
    `write` or by `close`."""

    CHUNK = 8 << 20
    BUFFERS = 3
    """Staging buffers: one being filled, the others being written (or waiting to be). More
    buffers, or two or three writes in flight, measured no faster on the development machine."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd
        self._free: queue.Queue[np.ndarray] = queue.Queue()
        for _ in range(self.BUFFERS):
            self._free.put(aligned_bytes(self.CHUNK).numpy())
        self._jobs: queue.Queue[tuple[np.ndarray, int, int] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="direct-writer", daemon=True)
        self._thread.start()
        self._buf = self._free.get()
        self._n = 0  # bytes staged in _buf
        self._at = 0  # file offset of _buf's first byte
        self.size = 0  # bytes written by the caller so far

    def write(self, data: bytes | memoryview) -> int:
        src = np.frombuffer(data, dtype=np.uint8)
        pos = 0
        while pos < len(src):
            k = min(len(src) - pos, len(self._buf) - self._n)
            self._buf[self._n: self._n + k] = src[pos: pos + k]
            self._n += k
            pos += k
            if self._n == len(self._buf):
                self._submit()
        self.size += len(src)
        return len(src)

    def _submit(self) -> None:
        """Hand the staged buffer to the write thread; take a free one (raising a write's error)."""
        self._jobs.put((self._buf, self._at, self._n))
        self._at += self._n
        self._n = 0
        self._buf = self._free.get()  # the write thread gives every buffer back, written or not
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            buf, at, n = job
            try:
                if self._error is None:
                    self._pwrite(buf, at, n)
            except BaseException as exc:  # raised by the caller's next write() or close()
                self._error = exc
            self._free.put(buf)

    def _pwrite(self, buf: np.ndarray, at: int, n: int) -> None:
        padded = -(-n // PAGE) * PAGE
        buf[n: padded] = 0  # the padding past the end is cut off by close()
        data, done = memoryview(buf)[:padded], 0
        while done < padded:
            try:
                done += os.pwrite(self.fd, data[done:], at + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not _buffered(self.fd):
                    raise

    def _drain(self) -> None:
        """Stop the write thread once every submitted buffer is written."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def close(self) -> None:
        if self.fd is None:
            return
        try:
            if self._n:
                self._jobs.put((self._buf, self._at, self._n))
            self._drain()
            if self._error is not None:
                raise self._error
            os.ftruncate(self.fd, self.size)
        finally:
            self._release()

    def _release(self) -> None:
        self._drain()
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> DirectWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        elif self.fd is not None:  # failed: the caller deletes the file; staged bytes are dropped, not retried
            self._error = self._error or OSError("aborted")  # the thread skips what is still queued
            self._release()


def _buffered(fd: int) -> bool:
    """Turn O_DIRECT off on `fd` (True), or False if it was not on."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if not flags & os.O_DIRECT:
        return False
    log.warning("O_DIRECT write refused (EINVAL); writing through the page cache")
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
    return True


def create_direct(path: str, size: int, mode: str = "auto") -> DirectWriter | None:
    """A new file at `path` (mode 0600) to write `size` bytes around the page cache, or None where
    that is not wanted (`buffered`, a small file in `auto`) or not offered (the caller then opens
    it the usual way)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or mode == "buffered" or (mode == "auto" and size < DIRECT_MIN_BYTES):
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flag, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        return None
    return DirectWriter(fd)
