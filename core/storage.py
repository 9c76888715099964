"""The run directory's storage: a thin layer over fsspec, the only coordinator of a run.

Keys are '/'-separated paths relative to the run root. Writes are atomic: on a filesystem, data
goes to a hidden temporary name and is renamed into place only once it is whole; on S3, which has
no rename (fsspec's `mv` is copy + delete), data goes straight to its key, because an object
appears only when its upload completes and a failed upload is aborted. Either way readers also
trust only checkpoints whose manifest, written last, exists (see core.checkpoint). Transient I/O
errors are retried with back-off; a full disk is reported at once and leaves no partial file.
Everything read from a local run directory is opened without following a symbolic link and
without blocking (a FIFO would block an open for good), and only a regular file whose real path
lies inside the run's root is read: a co-tenant's link to elsewhere, a named pipe or a device
planted in the run is refused with a CheckpointError naming it (`follow_links=True` lifts the
first and last rule for paths a user names, such as a Hugging Face cache's links to its blobs).
Everything written, renamed, made or removed in a local run directory is done by name inside a
folder descriptor reached from the root one name at a time without following a link
(core/folders.py): a link planted on the way is refused, and one swapped in after the walk
changes nothing.
Reliability figures and S3 setup: docs/reliability.md.
"""
from __future__ import annotations

import contextlib
import copy
import errno
import json
import logging
import os
import posixpath
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any, TypeVar

import fsspec

from core import folders
from core.errors import CheckpointError, NotARegularFile, StorageError

log = logging.getLogger(__name__)
T = TypeVar("T")

TMP_PREFIX = ".tmp-"
PRIVATE_FILE = folders.PRIVATE_FILE
# Errors no retry can fix: report them at once, with what to do.
_FATAL_ERRNOS = {errno.ENOSPC: "the disk is full: free space on it, then try again (a run: `orchestrate resume` it)",
                 errno.EDQUOT: "the disk quota is exceeded: free space, then try again (a run: `orchestrate resume` it)",
                 errno.EACCES: "permission denied: check the run directory's owner and mode",
                 errno.EROFS: "the filesystem is read-only",
                 errno.ENOTDIR: "a file stands where a folder of that path is due: move the file aside"}
# Object stores where a PUT is atomic (an object appears whole or not at all) and fsspec's file
# can abort its upload: open_atomic writes straight to the key there instead of copy + delete.
_ATOMIC_PUT_PROTOCOLS = {"s3", "s3a"}
# Where create_exclusive is a real conditional write (S3 `If-None-Match: *`, honoured by AWS S3
# since 2024-08, MinIO, moto); elsewhere off the local filesystem it is check-then-write.
_CONDITIONAL_PUT_PROTOCOLS = {"s3", "s3a"}
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
DROP_EVERY = 32 << 20
"""Bytes a staged local write writes between two drops of its pages from the page cache."""


class Storage:
    """A run root (any fsspec URL) and atomic, retried operations on keys below it."""

    def __init__(self, url: str, retries: int = 4, backoff_s: float = 0.2, *, follow_links: bool = False,
                 **storage_options: Any) -> None:
        """`follow_links`: read through symbolic links, wherever they point (for files a user names,
        never for a run directory, whose files anyone with write access may have planted)."""
        self.url = url.rstrip("/") or url
        self.follow_links = follow_links
        self._real_root: str | None = None
        protocol = fsspec.core.split_protocol(url)[0]
        if protocol not in (None, "file", "local") and "::" not in url:
            # A cached listing would hide files other processes publish from a poller (s3fs caches
            # every listing forever by default): always ask the store.
            storage_options.setdefault("use_listings_cache", False)
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/") or "/"
        self.retries = retries
        self.backoff_s = backoff_s
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
        return "file" in _protocols(self.fs)

    def path(self, key: str) -> str:
        """The filesystem path of `key` (for this Storage's fs)."""
        return posixpath.join(self.root, key) if key else self.root

    def display(self, key: str = "") -> str:
        """A URL a person can paste: the local path, or protocol://path."""
        p = self.path(key)
        return p if self.is_local else f"{_protocols(self.fs)[0]}://{p.lstrip('/')}"

    def makedirs_path(self, path: str) -> None:
        """Create folder `path` (a filesystem path of this fs) and its parents; on a local or shared
        POSIX filesystem each new folder is private to the user (0700): a run directory holds what
        workers execute from (config, checkpoints), so nobody else may write into it."""
        if not self.is_local:
            self.fs.makedirs(path, exist_ok=True)
            return
        with self._folder(path, create=True):
            pass

    @contextlib.contextmanager
    def local_folder(self, key: str) -> Iterator[int]:
        """A descriptor of the local run's folder `key`, made (0700) if missing and reached through no
        link (see `_folder`), for a library that writes files there itself (TensorBoard's writer,
        given `/proc/self/fd/N`: that very folder, whatever is put at its name meanwhile)."""
        with self._folder(self.path(key), create=True) as fd:
            yield fd

    @contextlib.contextmanager
    def _folder(self, path: str, create: bool = False) -> Iterator[int]:
        """A descriptor of the local folder `path` inside the run (core.folders.open_folder)."""
        fd = self._open_folder(path, create)
        try:
            yield fd
        finally:
            os.close(fd)

    def _open_folder(self, path: str, create: bool) -> int:
        return folders.open_folder(self.root, path, create=create, follow_links=self.follow_links)

    def local_path(self, key: str) -> str | None:
        return self.path(key) if self.is_local else None

    @property
    def atomic_put(self) -> bool:
        """True where a plain write is already atomic (S3): no temporary name, no copy."""
        return bool(_ATOMIC_PUT_PROTOCOLS.intersection(_protocols(self.fs)))

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
        if self.is_local:
            return os.fdopen(self.open_fd(key), "rb")
        return self._retry(f"open {key}", lambda: self.fs.open(self.path(key), "rb"))

    def open_fd(self, key: str) -> int:
        """A read-only descriptor of the local file at `key`, opened without blocking and (unless
        `follow_links`) without following a link; NotARegularFile unless it is a regular file whose
        real path is inside the root. FileNotFoundError when absent."""
        path = self.path(key)
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if self.follow_links else os.O_NOFOLLOW)
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotARegularFile(f"{path} is a symbolic link: islands reads only regular files inside the run "
                                      "directory; delete the link") from None
            raise
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                kind = {stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFDIR: "a folder", stat.S_IFCHR: "a device",
                        stat.S_IFBLK: "a device", stat.S_IFSOCK: "a socket"}.get(stat.S_IFMT(mode), "not a regular file")
                raise NotARegularFile(f"{path} is {kind}, not a regular file: islands reads only regular files; delete it")
            if not self.follow_links:
                self._check_inside(fd, path)
            os.set_blocking(fd, True)  # a regular file: reads wait for the disk as usual
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _check_inside(self, fd: int, path: str) -> None:
        """The opened file's real path (a linked folder on the way resolves elsewhere) is in the root."""
        if self._real_root is None:
            self._real_root = os.path.realpath(self.root)
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc: resolve the name instead (a race away from exact)
            real = os.path.realpath(path)
        if not real.startswith(self._real_root.rstrip("/") + "/"):
            raise NotARegularFile(f"{path} resolves to {real}, outside the run directory {self._real_root} (a linked "
                                  "folder on the way): islands reads only files inside the run; remove the link")

    def list(self, prefix: str) -> list[str]:
        """Names (not keys) directly under `prefix`, without temporaries; [] when it is absent."""
        def ls() -> list[str]:
            try:
                entries = self.fs.ls(self.path(prefix), detail=False)
            except FileNotFoundError:
                return []
            return sorted(posixpath.basename(e.rstrip("/")) for e in entries)
        return [n for n in self._retry(f"list {prefix}", ls) if not n.startswith(TMP_PREFIX)]

    def sizes(self, prefix: str) -> dict[str, int]:
        """{`prefix`/NAME: bytes} of the files of the flat folder `prefix`, from one listing (on an object
        store asking each file its size is a request); {} when it is absent or cannot be listed."""
        try:
            listed = self.fs.find(self.path(prefix), detail=True)
        except OSError:
            return {}
        return {posixpath.join(prefix, k.rsplit("/", 1)[-1]): int(v["size"]) for k, v in listed.items()}

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
        """Create `key` holding `data` only if it is absent; True if this call created it.

        Atomic on local and NFS filesystems (a whole temporary file hard-linked to the name: link
        fails if the name exists, and readers never see a half-written file) and on S3 (a
        conditional PUT, `If-None-Match: *`). Elsewhere, and on S3-compatible servers that ignore
        that header, it is check-then-write: two callers racing within one round trip may both win.
        """
        if self.is_local:
            return self._create_exclusive_local(key, data)
        if _CONDITIONAL_PUT_PROTOCOLS.intersection(_protocols(self.fs)):
            failed_before = [False]

            def put() -> bool:
                try:
                    self.fs.pipe_file(self.path(key), data, mode="create")
                except FileExistsError:
                    # An attempt whose reply was lost may have created it: then it holds our bytes.
                    return failed_before[0] and self.fs.cat_file(self.path(key)) == data
                except OSError:
                    failed_before[0] = True
                    raise
                return True
            return self._retry(f"create {key}", put)
        if self.exists(key):
            return False
        self.write_bytes(key, data)
        return True

    def _create_exclusive_local(self, key: str, data: bytes) -> bool:
        path = self.path(key)
        name = posixpath.basename(path)
        tmp = f"{TMP_PREFIX}{uuid.uuid4().hex[:12]}-{name}"
        try:
            with self._folder(posixpath.dirname(path), create=True) as d:
                try:
                    with open(os.open(tmp, _NEW_FILE, PRIVATE_FILE, dir_fd=d), "wb") as f:
                        f.write(data)
                    try:
                        os.link(tmp, name, src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
                        return True
                    except FileExistsError:
                        return False
                    except OSError as exc:  # a filesystem without hard links: O_EXCL (atomic, not whole-at-once)
                        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                            raise
                    try:
                        fd = os.open(name, _NEW_FILE, PRIVATE_FILE, dir_fd=d)
                    except FileExistsError:
                        return False
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                    return True
                finally:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=d)
        except OSError as exc:
            raise self.error(f"create {key}", exc) from exc

    def sweep_temporaries(self, older_than_s: float, skip: tuple[str, ...] = ()) -> list[str]:
        """Delete the `.tmp-*` files that killed writers left anywhere under the root, if last
        modified more than `older_than_s` ago; return their keys. A live writer's temporary is
        younger than that (its mtime moves with every write), so it is never touched; nothing
        reads temporaries, so deleting an old one loses nothing. Top-level folders in `skip` are
        not walked (submitit's job folder). Object stores leave no temporaries: nothing to do."""
        if self.atomic_put:
            return []
        now, gone = time.time(), []
        try:
            found = self._retry("list the run directory", lambda: self.fs.find(self.root, detail=True))
        except FileNotFoundError:
            return []
        for path, info in found.items():
            key = posixpath.relpath(path, self.root)
            if not posixpath.basename(path).startswith(TMP_PREFIX) or key.split("/", 1)[0] in skip:
                continue
            if now - _mtime(info, now) < older_than_s:
                continue
            try:
                with contextlib.suppress(FileNotFoundError):  # another sweeper or its writer's cleanup came first
                    self._unlink(path)
                    gone.append(key)
            except NotARegularFile:  # a walk through a planted link: not the run's temporary
                continue
        if gone:
            log.info("storage: deleted %d temporaries older than %.0fs left by killed writers: %s",
                     len(gone), older_than_s, gone[:5])
        return gone

    def identity(self, key: str) -> tuple | None:
        """What tells this file at `key` from another later put there (None: nothing there): on a
        filesystem its inode, size and mtime, the link itself if it is one; elsewhere its size and
        ETag or modification time."""
        if self.is_local:
            try:
                return _identity(os.lstat(self.path(key)))
            except (FileNotFoundError, NotADirectoryError):
                return None
        try:
            info = self.fs.info(self.path(key))
        except FileNotFoundError:
            return None
        return info.get("size"), str(info.get("ETag") or info.get("mtime") or info.get("LastModified") or info.get("created"))

    def remove(self, key: str, recursive: bool = False) -> None:
        self.check_fence(key)
        if not self.is_local:
            with contextlib.suppress(FileNotFoundError):
                self._retry(f"remove {key}", lambda: self.fs.rm(self.path(key), recursive=recursive))
            return
        with contextlib.suppress(FileNotFoundError):
            self._retry(f"remove {key}", lambda: self._unlink(self.path(key), recursive))

    def _unlink(self, path: str, recursive: bool = False) -> None:
        """Remove the local file (or with `recursive` the folder) at `path`, a link itself, not its target."""
        with self._folder(posixpath.dirname(path)) as d:
            name = posixpath.basename(path)
            if recursive and stat.S_ISDIR(os.stat(name, dir_fd=d, follow_symlinks=False).st_mode):
                shutil.rmtree(name, dir_fd=d)  # by descriptors, never through a link (Linux)
            else:
                os.unlink(name, dir_fd=d)

    def move(self, src: str, dst: str) -> None:
        """Rename `src` to `dst` without reading it (whatever it is: a FIFO planted in the run moves
        like a file); object stores copy then delete."""
        self.check_fence(dst)

        def mv() -> None:
            if not self.is_local:
                self.fs.mv(self.path(src), self.path(dst))
                return
            s, d = self.path(src), self.path(dst)
            with self._folder(posixpath.dirname(s)) as sd, self._folder(posixpath.dirname(d), create=True) as dd:
                os.replace(posixpath.basename(s), posixpath.basename(d), src_dir_fd=sd, dst_dir_fd=dd)
        self._retry(f"move {src} to {dst}", mv)

    def move_if(self, src: str, dst: str, seen: tuple | None) -> bool:
        """Move `src` to `dst` only if it is still the file `identity(src)` was `seen` to be; False,
        leaving what is at `src` where it is, if another file was put there since (a worker's new
        contribution landing at the key of a refused one). Locally the file is renamed first and
        checked after, and a wrong one is linked back under its name (never over a newer one): no
        window between the check and the move. Object stores, which have no rename, check first."""
        self.check_fence(dst)
        if not self.is_local:
            if self.identity(src) != seen:
                return False
            with contextlib.suppress(FileNotFoundError):
                self.move(src, dst)
            return True
        s, d = self.path(src), self.path(dst)
        sname, dname = posixpath.basename(s), posixpath.basename(d)
        with contextlib.ExitStack() as stack:
            try:
                sd = stack.enter_context(self._folder(posixpath.dirname(s)))
            except FileNotFoundError:
                return seen is None
            dd = stack.enter_context(self._folder(posixpath.dirname(d), create=True))
            try:
                os.rename(sname, dname, src_dir_fd=sd, dst_dir_fd=dd)
            except FileNotFoundError:
                return seen is None
            if _identity(os.stat(dname, dir_fd=dd, follow_symlinks=False)) == seen:
                return True
            try:
                os.link(dname, sname, src_dir_fd=dd, dst_dir_fd=sd, follow_symlinks=False)
            except FileExistsError:
                pass  # an even newer file is there: it stays
            except OSError:  # no hard links here: renamed back (over a newer one only if it landed just now)
                os.rename(dname, sname, src_dir_fd=dd, dst_dir_fd=sd)
                return False
            os.unlink(dname, dir_fd=dd)
            return False

    def copy(self, src: str, dst: str) -> None:
        with self.open_read(src) as fin, self.open_atomic(dst) as fout:
            while chunk := fin.read(16 << 20):
                fout.write(chunk)

    # -- retries --------------------------------------------------------------------------------
    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """Run `fn`, retrying an OSError `retries` times, sleeping backoff_s, then twice as long each
        time (0.2 + 0.4 + 0.8 + 1.6 = 3.0 s by default); an error no retry can fix (_FATAL_ERRNOS)
        or the last one raises StorageError. FileNotFoundError is an answer, not a fault: raised as is."""
        delay, t0 = self.backoff_s, time.monotonic()
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except OSError as exc:
                if exc.errno in _FATAL_ERRNOS:
                    raise self.error(what, exc) from exc
                if attempt == self.retries:
                    raise self.error(what, exc, attempts=attempt + 1, seconds=time.monotonic() - t0) from exc
                log.warning("storage: %s failed (%s); retry %d/%d in %.1fs", what, exc, attempt + 1, self.retries, delay)
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def error(self, what: str, exc: OSError, attempts: int = 1, seconds: float = 0.0) -> StorageError:
        """A StorageError saying what failed, where, why, and what to do about it."""
        if isinstance(exc, StorageError):
            return exc
        hint = _FATAL_ERRNOS.get(exc.errno or 0, "check that the storage is reachable and retry")
        tries = f" after {attempts} attempts over {seconds:.1f}s" if attempts > 1 else ""
        return StorageError(f"could not {what} in {self.display()}{tries}: {exc.strerror or exc}; {hint}")


class Staged:
    """One file being written to `key` of a Storage, invisible to readers until `publish()`.

    Filesystems (local, NFS, anything with a rename): a hidden temporary name beside the key
    (`.tmp-<random>-<name>`, which `list` never shows and `sweep_temporaries` deletes once a killed
    writer left it), renamed into place, with retries, by `publish()`. S3: the key itself, because
    an object appears only when its upload completes: `publish()` completes it, `discard()` aborts
    it (a killed writer leaves an incomplete multipart upload, which no reader sees)."""

    def __init__(self, storage: Storage, key: str) -> None:
        self.storage, self.key = storage, key
        final = storage.path(key)
        self._name = posixpath.basename(final)
        self._tmp = None if storage.atomic_put else f"{TMP_PREFIX}{uuid.uuid4().hex[:12]}-{self._name}"
        self._dir: int | None = None  # a local file's folder (Storage._folder): opened, renamed, removed in it
        self.file: Any = None
        self._fd: int | None = None  # a local file's descriptor, for dropping what is written behind
        self._written = self._dropped = 0

        def create() -> Any:
            if self._tmp is None:
                return storage.fs.open(final, "wb")
            if not storage.is_local:
                storage.makedirs_path(posixpath.dirname(final))
                return storage.fs.open(self._tmp_path(), "wb")
            self._dir = storage._open_folder(posixpath.dirname(final), create=True)
            try:
                return os.fdopen(os.open(self._tmp, _NEW_FILE, PRIVATE_FILE, dir_fd=self._dir), "wb")
            except BaseException:
                self._close_dir()
                raise
        self.file = storage._retry(f"create {key}", create)
        if storage.is_local:
            self._fd = self.file.fileno()

    def _close_dir(self) -> None:
        if self._dir is not None:
            os.close(self._dir)
            self._dir = None

    def _tmp_path(self) -> str:
        return posixpath.join(posixpath.dirname(self.storage.path(self.key)), str(self._tmp))

    def write(self, data: Any) -> None:
        """Write the next bytes. A local file's pages are dropped from the page cache behind the
        writes (each call of posix_fadvise DONTNEED starts the write-back of what was written and
        drops what is on disk already): a merge's large output would otherwise fill the cache, which
        costs more CPU than the merge's maths on some machines (docs/benchmarks.md, Merge)."""
        self.file.write(data)
        self._written += len(data)
        if self._fd is not None and self._written - self._dropped >= DROP_EVERY:
            os.posix_fadvise(self._fd, 0, self._written, os.POSIX_FADV_DONTNEED)
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
                self.file.close()  # S3: the single PUT, or the multipart upload's completion
            except OSError as exc:
                raise s.error(f"write {self.key}", exc) from exc
            if self._dir is not None:
                d = self._dir
                s._retry(f"publish {self.key}", lambda: os.rename(str(self._tmp), self._name, src_dir_fd=d, dst_dir_fd=d))
                self._close_dir()
            elif self._tmp is not None:
                s._retry(f"publish {self.key}", lambda: s.fs.mv(self._tmp_path(), s.path(self.key)))
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Drop everything written: nothing that could be taken for whole stays behind."""
        with contextlib.suppress(Exception):
            if self._tmp is None:
                # Not close(): a buffered fsspec file would commit the upload, publishing a part.
                self.file.discard()  # aborts the multipart upload, drops the buffer
                self.file.closed = True  # so that its __del__ does not upload what is left
            else:
                self.file.close()
        with contextlib.suppress(Exception):
            if self._dir is not None:
                os.unlink(str(self._tmp), dir_fd=self._dir)
            elif self._tmp is not None:
                self.storage.fs.rm(self._tmp_path())
        self._close_dir()


def _identity(st: os.stat_result) -> tuple:
    return st.st_ino, st.st_size, st.st_mtime_ns


def _mtime(info: dict[str, Any], default: float) -> float:
    """Last-modified time of an fsspec `info` entry as epoch seconds (backends name it differently)."""
    for field in ("mtime", "created", "LastModified", "last_modified"):
        value = info.get(field)
        if isinstance(value, (int, float)):
            return float(value)
        if hasattr(value, "timestamp"):
            return value.timestamp()
    return default  # unknown age: treated as new, so never deleted


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
