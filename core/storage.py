"""The run directory's storage: a thin layer over fsspec, the only coordinator of a run.

Keys are '/'-separated paths relative to the run root. Writes are atomic: on a filesystem, data
goes to a hidden temporary name and is renamed into place only once it is whole; on S3, which has
no rename (fsspec's `mv` is copy + delete), data goes straight to its key, because an object
appears only when its upload completes and a failed upload is aborted. Either way readers also
trust only checkpoints whose manifest, written last, exists (see core.checkpoint). Transient I/O
errors are retried with back-off; a full disk is reported at once and leaves no partial file.
What differs between a local run directory and an object store is a backend's (core/files.py):
a local one (core/local_files.py) reads only regular files inside the run and writes through no
link planted on the way. Reliability figures and S3 setup: docs/reliability.md.
"""
from __future__ import annotations

import contextlib
import copy
import errno
import json
import logging
import os
import posixpath
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import fsspec

from core.errors import CheckpointError, NotARegularFile, StorageError
from core.files import TMP_PREFIX, Files, FsspecFiles, Writer, protocols
from core.local_files import LocalFiles

log = logging.getLogger(__name__)
T = TypeVar("T")

# Errors no retry can fix: report them at once, with what to do.
_FATAL_ERRNOS = {errno.ENOSPC: "the disk is full: free space on it, then try again (a run: `orchestrate resume` it)",
                 errno.EDQUOT: "the disk quota is exceeded: free space, then try again (a run: `orchestrate resume` it)",
                 errno.EACCES: "permission denied: check the run directory's owner and mode",
                 errno.EPERM: "the operation is not permitted: check the run directory's owner and mode (and any "
                              "immutable or append-only attribute, lsattr)",
                 errno.EROFS: "the filesystem is read-only",
                 errno.ENOTDIR: "a file stands where a folder of that path is due: move the file aside"}
DROP_EVERY = 32 << 20
"""Bytes a staged local write writes between two drops of its pages from the page cache."""


@dataclass(frozen=True)
class Retries:
    """Storage's retries with back-off, and its errors: what failed, in `where`, why, what to do."""
    count: int
    backoff_s: float
    where: str
    """The storage's root, as a person pastes it."""

    def __call__(self, what: str, fn: Callable[[], T]) -> T:
        """Run `fn`, retrying an OSError `count` times, sleeping backoff_s, then twice as long each
        time (0.2 + 0.4 + 0.8 + 1.6 = 3.0 s by default); an error no retry can fix (_FATAL_ERRNOS)
        or the last one raises StorageError. FileNotFoundError is an answer, not a fault: raised as is."""
        delay, t0 = self.backoff_s, time.monotonic()
        for attempt in range(self.count + 1):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except OSError as exc:
                if exc.errno in _FATAL_ERRNOS:
                    raise self.error(what, exc) from exc
                if attempt == self.count:
                    raise self.error(what, exc, attempts=attempt + 1, seconds=time.monotonic() - t0) from exc
                log.warning("storage: %s failed (%s); retry %d/%d in %.1fs", what, exc, attempt + 1, self.count, delay)
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def error(self, what: str, exc: OSError, attempts: int = 1, seconds: float = 0.0) -> StorageError:
        if isinstance(exc, StorageError):
            return exc
        hint = _FATAL_ERRNOS.get(exc.errno or 0, "check that the storage is reachable and retry")
        tries = f" after {attempts} attempts over {seconds:.1f}s" if attempts > 1 else ""
        return StorageError(f"could not {what} in {self.where}{tries}: {exc.strerror or exc}; {hint}")


class Storage:
    """A run root (any fsspec URL) and atomic, retried operations on keys below it."""

    def __init__(self, url: str, retries: int = 4, backoff_s: float = 0.2, *, follow_links: bool = False,
                 **storage_options: Any) -> None:
        """`follow_links`: read through symbolic links, wherever they point (for files a user names,
        never for a run directory, whose files anyone with write access may have planted)."""
        self.url = url.rstrip("/") or url
        protocol = fsspec.core.split_protocol(url)[0]
        if protocol not in (None, "file", "local") and "::" not in url:
            # A cached listing would hide files other processes publish from a poller (s3fs caches
            # every listing forever by default): always ask the store.
            storage_options.setdefault("use_listings_cache", False)
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/") or "/"
        local = "file" in protocols(self.fs)
        self._scheme = None if local else protocols(self.fs)[0]  # how display() names a remote path
        self._retry = Retries(retries, backoff_s, self.display())
        self.files: Files = LocalFiles(self.root, follow_links) if local else FsspecFiles(self.fs, self.root, self._retry)
        self.fence: Callable[[str], None] | None = None
        """Called with the key before anything is published, moved or removed (a lease's check
        that this writer still holds the run: orchestrator.lease); it raises to refuse."""

    def fenced(self, check: Callable[[str], None]) -> Storage:
        """This storage, every commit of which first calls `check(key)`."""
        other = copy.copy(self)
        other.fence = check
        return other

    def check_fence(self, key: str) -> None:
        """Raise if this writer may no longer commit `key` (see `fence`); also before acting on its
        behalf elsewhere (submitting or cancelling jobs)."""
        if self.fence is not None:
            self.fence(key)

    @property
    def is_local(self) -> bool:
        return isinstance(self.files, LocalFiles)

    def path(self, key: str) -> str:
        """The filesystem path of `key` (for this Storage's fs)."""
        return posixpath.join(self.root, key) if key else self.root

    def display(self, key: str = "") -> str:
        """A URL a person can paste: the local path, or protocol://path."""
        p = self.path(key)
        return p if self._scheme is None else f"{self._scheme}://{p.lstrip('/')}"

    @contextlib.contextmanager
    def local_folder(self, key: str) -> Iterator[int]:
        """A descriptor of the local run's folder `key`, made (0700) if missing and reached through no
        link, for a library that writes files there itself (TensorBoard's writer, given
        `/proc/self/fd/N`: that very folder, whatever is put at its name meanwhile)."""
        assert isinstance(self.files, LocalFiles)
        with self.files.folder(self.path(key), create=True) as fd:
            yield fd

    def local_path(self, key: str) -> str | None:
        return self.path(key) if self.is_local else None

    @property
    def atomic_put(self) -> bool:
        """True where a plain write is already atomic (S3): no temporary name, no copy."""
        return self.files.atomic_put

    # -- reading --------------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self._retry(f"check {key}", lambda: self.fs.exists(self.path(key)))

    def size(self, key: str) -> int:
        return int(self._retry(f"stat {key}", lambda: self.fs.size(self.path(key))))

    def read_bytes(self, key: str, limit: int | None = None) -> bytes:
        """The bytes at `key`; with `limit`, a CheckpointError instead of reading more than that."""
        def read() -> bytes:
            with self.open_read(key) as f:
                data = f.read() if limit is None else f.read(limit + 1)
            if limit is not None and len(data) > limit:
                raise CheckpointError(f"{self.display(key)} is over the limit of {limit} bytes for it: it was not "
                                      "written by islands; delete it")
            return data
        return self._retry(f"read {key}", read)

    def read_json(self, key: str, limit: int | None = None) -> Any | None:
        """Parsed JSON at `key`, or None when absent. Corrupt JSON raises StorageError."""
        try:
            data = self.read_bytes(key, limit)
        except FileNotFoundError:
            return None
        try:
            return json.loads(data)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: absurd nesting
            raise StorageError(f"{self.display(key)} is not valid JSON ({type(exc).__name__}: {str(exc)[:200]}); it was damaged outside "
                               "islands: restore it or delete it and `orchestrate resume` the run") from None

    def open_read(self, key: str) -> IO[bytes]:
        """A binary file to read `key` from (local: a regular file inside the run, see open_fd)."""
        return self.files.open_read(self.path(key))

    def open_fd(self, key: str) -> int:
        """A read-only descriptor of the local file at `key` (core.local_files.LocalFiles.open_fd)."""
        assert isinstance(self.files, LocalFiles)
        return self.files.open_fd(self.path(key))

    def list(self, prefix: str) -> list[str]:
        """Names (not keys) directly under `prefix`, without temporaries; [] when it is absent."""
        def ls() -> list[str]:
            try:
                entries = self.fs.ls(self.path(prefix), detail=False)
            except FileNotFoundError:
                return []
            return sorted(posixpath.basename(e.rstrip("/")) for e in entries)
        return [n for n in self._retry(f"list {prefix}", ls) if not n.startswith(TMP_PREFIX)]

    def kind(self, key: str = "") -> str | None:
        """What is at `key` (`directory`, `file`, ...: fsspec's type), None when nothing is. Not
        retried: for a path a person named, whose error should say at once what to check."""
        try:
            return self.fs.info(self.path(key)).get("type")
        except FileNotFoundError:
            return None

    def find(self, prefix: str = "") -> dict[str, dict[str, Any]]:
        """{key: fsspec info} of every file below `prefix`, from one listing; not retried."""
        return {posixpath.relpath(k, self.root): v for k, v in self.fs.find(self.path(prefix), detail=True).items()}

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """The bytes [start, end) of each (key, start, end), as one batch of range requests (fsspec's
        cat_ranges: concurrent on an object store)."""
        paths, starts, ends = [self.path(k) for k, _, _ in ranges], [a for _, a, _ in ranges], [b for _, _, b in ranges]
        return [bytes(b) for b in self._retry(f"read {len(ranges)} ranges",
                                              lambda: self.fs.cat_ranges(paths, starts, ends, on_error="raise"))]

    # -- writing --------------------------------------------------------------------------------
    def stage(self, key: str) -> Staged:
        """Begin writing `key`: write to the returned Staged's `file`, then `publish()` it (readers
        see the old content or the whole new one, never a part) or `discard()` it. Several staged
        files may be published one after another once all are written (a merge's outputs)."""
        return Staged(self, key)

    @contextlib.contextmanager
    def open_atomic(self, key: str) -> Iterator[Staged]:
        """Write `key` atomically: a Staged write (`write`, `flush`) published on clean exit,
        discarded on error."""
        staged = self.stage(key)
        try:
            yield staged
        except BaseException:
            staged.discard()
            raise
        staged.publish()

    def write_bytes(self, key: str, data: bytes) -> None:
        def write() -> None:
            with self.open_atomic(key) as f:
                f.write(data)
        self._retry(f"write {key}", write)

    def write_json(self, key: str, obj: Any) -> None:
        self.write_bytes(key, json.dumps(obj, indent=1, sort_keys=True).encode())

    def create_exclusive(self, key: str, data: bytes) -> bool:
        """Create `key` holding `data` only if it is absent; True if this call created it. Atomic on
        local and NFS filesystems and on S3 (the backends say how); elsewhere, and on S3-compatible
        servers that ignore `If-None-Match`, check-then-write: two callers racing may both win."""
        if not self.files.exclusive:
            if self.exists(key):
                return False
            self.write_bytes(key, data)
            return True
        try:
            return self.files.create_exclusive(self.path(key), data)
        except OSError as exc:
            raise self.error(f"create {key}", exc) from exc

    def identity(self, key: str) -> tuple | None:
        """What tells this file at `key` from another later put there (None: nothing there): on a
        filesystem its inode, size and mtime, the link itself if it is one; elsewhere its size and
        ETag or modification time."""
        return self.files.identity(self.path(key))

    def remove(self, key: str, recursive: bool = False) -> None:
        """Remove `key` (a link itself, not its target); nothing there is no error."""
        self.check_fence(key)
        with contextlib.suppress(FileNotFoundError):
            self._retry(f"remove {key}", lambda: self.files.unlink(self.path(key), recursive))

    def move(self, src: str, dst: str) -> None:
        """Rename `src` to `dst` without reading it (whatever it is: a FIFO planted in the run moves
        like a file); object stores copy then delete."""
        self.check_fence(dst)
        self._retry(f"move {src} to {dst}", lambda: self.files.move(self.path(src), self.path(dst)))

    def move_if(self, src: str, dst: str, seen: tuple | None) -> bool:
        """Move `src` to `dst` only if it is still the file `identity(src)` was `seen` to be; False,
        leaving what is at `src` where it is, if another file was put there since (a worker's new
        contribution landing at the key of a refused one)."""
        self.check_fence(dst)
        return self.files.move_if(self.path(src), self.path(dst), seen)

    def copy(self, src: str, dst: str) -> None:
        with self.open_read(src) as fin, self.open_atomic(dst) as fout:
            while chunk := fin.read(16 << 20):
                fout.write(chunk)

    def error(self, what: str, exc: OSError, attempts: int = 1, seconds: float = 0.0) -> StorageError:
        """A StorageError saying what failed, where, why, and what to do about it."""
        return self._retry.error(what, exc, attempts, seconds)


def sweep_temporaries(storage: Storage, older_than_s: float, skip: tuple[str, ...] = ()) -> list[str]:
    """Delete the `.tmp-*` files that killed writers left anywhere under the root, if last
    modified more than `older_than_s` ago; return their keys. A live writer's temporary is
    younger than that (its mtime moves with every write), so it is never touched; nothing
    reads temporaries, so deleting an old one loses nothing. Top-level folders in `skip` are
    not walked (submitit's job folder). Object stores leave no temporaries: nothing to do."""
    if storage.atomic_put:
        return []
    now, gone = time.time(), []
    try:
        found = storage._retry("list the run directory", lambda: storage.find(""))
    except FileNotFoundError:
        return []
    for key, info in found.items():
        path = storage.path(key)
        if not posixpath.basename(key).startswith(TMP_PREFIX) or key.split("/", 1)[0] in skip:
            continue
        if now - _mtime(info, now) < older_than_s:
            continue
        try:
            with contextlib.suppress(FileNotFoundError):  # another sweeper or its writer's cleanup came first
                storage.files.unlink(path)
                gone.append(key)
        except NotARegularFile:  # a walk through a planted link: not the run's temporary
            continue
    if gone:
        log.info("storage: deleted %d temporaries older than %.0fs left by killed writers: %s",
                 len(gone), older_than_s, gone[:5])
    return gone


class Staged:
    """One file being written to `key` of a Storage, invisible to readers until `publish()`.

    Filesystems (local, NFS, anything with a rename): a hidden temporary name beside the key
    (`.tmp-<random>-<name>`, which `list` never shows and `sweep_temporaries` deletes once a killed
    writer left it), renamed into place, with retries, by `publish()`. S3: the key itself, because
    an object appears only when its upload completes: `publish()` completes it, `discard()` aborts
    it (a killed writer leaves an incomplete multipart upload, which no reader sees). The backend's
    Writer (core/files.py) does each."""

    def __init__(self, storage: Storage, key: str) -> None:
        self.storage, self.key = storage, key
        self._writer: Writer = storage._retry(f"create {key}", lambda: storage.files.writer(storage.path(key)))
        self.file = self._writer.file
        self._written = self._dropped = 0

    def write(self, data: Any) -> None:
        """Write the next bytes. A local file's pages are dropped from the page cache behind the
        writes (each call of posix_fadvise DONTNEED starts the write-back of what was written and
        drops what is on disk already): a merge's large output would otherwise fill the cache, which
        costs more CPU than the merge's maths on some machines (docs/benchmarks.md, Merge)."""
        self.file.write(data)
        self._written += len(data)
        fd = self._writer.fd
        if fd is not None and self._written - self._dropped >= DROP_EVERY:
            os.posix_fadvise(fd, 0, self._written, os.POSIX_FADV_DONTNEED)
            self._dropped = self._written

    def flush(self) -> None:
        self.file.flush()

    def publish(self) -> None:
        """Close the file (its buffered bytes written now: a full disk may show only here) and make
        it visible under its key; on failure nothing is visible and the temporary is gone."""
        s = self.storage
        try:
            s.check_fence(self.key)  # before the bytes become visible: a fenced writer publishes nothing
            try:
                self._writer.close()
            except OSError as exc:
                raise s.error(f"write {self.key}", exc) from exc
            s._retry(f"publish {self.key}", self._writer.commit)
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Drop everything written: nothing that could be taken for whole stays behind."""
        self._writer.abort()


def _mtime(info: dict[str, Any], default: float) -> float:
    """Last-modified time of an fsspec `info` entry as epoch seconds (backends name it differently)."""
    for field in ("mtime", "created", "LastModified", "last_modified"):
        value = info.get(field)
        if isinstance(value, (int, float)):
            return float(value)
        if hasattr(value, "timestamp"):
            return value.timestamp()
    return default  # unknown age: treated as new, so never deleted
