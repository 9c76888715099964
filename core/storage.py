"""The run directory's storage: a thin layer over fsspec, the only coordinator of a run.

Keys are '/'-separated paths relative to the run root. Writes are atomic: data goes to a hidden
temporary name and is renamed into place only once it is whole (on object stores, where rename is
a copy, readers are protected by manifests written last: see core.checkpoint). Transient I/O
errors are retried with back-off; a full disk is reported at once and leaves no partial file.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import posixpath
import time
import uuid
from collections.abc import Callable, Iterator
from typing import IO, Any, TypeVar

import fsspec

from core.errors import StorageError

log = logging.getLogger(__name__)
T = TypeVar("T")

TMP_PREFIX = ".tmp-"
# Errors no retry can fix: report them at once, with what to do.
_FATAL_ERRNOS = {errno.ENOSPC: "the disk is full: free space on it, then `orchestrate resume` the run",
                 errno.EDQUOT: "the disk quota is exceeded: free space, then `orchestrate resume` the run",
                 errno.EACCES: "permission denied: check the run directory's owner and mode",
                 errno.EROFS: "the filesystem is read-only"}


class Storage:
    """A run root (any fsspec URL) and atomic, retried operations on keys below it."""

    def __init__(self, url: str, retries: int = 4, backoff_s: float = 0.2, **storage_options: Any) -> None:
        self.url = url.rstrip("/") or url
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/") or "/"
        self.retries = retries
        self.backoff_s = backoff_s

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

    def local_path(self, key: str) -> str | None:
        return self.path(key) if self.is_local else None

    # -- reading --------------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self._retry(f"check {key}", lambda: self.fs.exists(self.path(key)))

    def size(self, key: str) -> int:
        return int(self._retry(f"stat {key}", lambda: self.fs.size(self.path(key))))

    def read_bytes(self, key: str) -> bytes:
        return self._retry(f"read {key}", lambda: self.fs.cat_file(self.path(key)))

    def read_json(self, key: str) -> Any | None:
        """Parsed JSON at `key`, or None when absent. Corrupt JSON raises StorageError."""
        try:
            data = self.read_bytes(key)
        except FileNotFoundError:
            return None
        try:
            return json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StorageError(f"{self.display(key)} is not valid JSON ({exc}); it was damaged outside "
                               "islands: restore it or delete it and `orchestrate resume` the run") from None

    def open_read(self, key: str) -> IO[bytes]:
        return self._retry(f"open {key}", lambda: self.fs.open(self.path(key), "rb"))

    def list(self, prefix: str) -> list[str]:
        """Names (not keys) directly under `prefix`, without temporaries; [] when it is absent."""
        def ls() -> list[str]:
            try:
                entries = self.fs.ls(self.path(prefix), detail=False)
            except FileNotFoundError:
                return []
            return sorted(posixpath.basename(e.rstrip("/")) for e in entries)
        return [n for n in self._retry(f"list {prefix}", ls) if not n.startswith(TMP_PREFIX)]

    # -- writing --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def open_atomic(self, key: str) -> Iterator[IO[bytes]]:
        """Write to a temporary name; rename into place on clean exit, delete it on error."""
        final = self.path(key)
        tmp = posixpath.join(posixpath.dirname(final), f"{TMP_PREFIX}{uuid.uuid4().hex[:12]}-{posixpath.basename(final)}")
        self._retry(f"create the folder of {key}", lambda: self.fs.makedirs(posixpath.dirname(final), exist_ok=True))
        try:
            with self.fs.open(tmp, "wb") as f:
                yield f
            self._retry(f"publish {key}", lambda: self.fs.mv(tmp, final))
        except BaseException:
            # A killed or failed write leaves nothing behind that could be taken for whole.
            with contextlib.suppress(Exception):
                self.fs.rm(tmp)
            raise

    def write_bytes(self, key: str, data: bytes) -> None:
        def write() -> None:
            with self.open_atomic(key) as f:
                f.write(data)
        self._retry(f"write {key}", write)

    def write_json(self, key: str, obj: Any) -> None:
        self.write_bytes(key, json.dumps(obj, indent=1, sort_keys=True).encode())

    def create_exclusive(self, key: str, data: bytes) -> bool:
        """Create `key` only if absent; True if this call created it (a best-effort lock on object stores)."""
        if self.is_local:
            import os
            path = self.path(key)
            os.makedirs(posixpath.dirname(path), exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return True
        if self.exists(key):
            return False
        self.write_bytes(key, data)
        return True

    def remove(self, key: str, recursive: bool = False) -> None:
        try:
            self._retry(f"remove {key}", lambda: self.fs.rm(self.path(key), recursive=recursive))
        except FileNotFoundError:
            pass

    def copy(self, src: str, dst: str) -> None:
        with self.open_read(src) as fin, self.open_atomic(dst) as fout:
            while chunk := fin.read(16 << 20):
                fout.write(chunk)

    # -- retries --------------------------------------------------------------------------------
    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except OSError as exc:
                if exc.errno in _FATAL_ERRNOS or attempt == self.retries:
                    raise self.error(what, exc) from exc
                log.warning("storage: %s failed (%s); retry %d/%d in %.1fs", what, exc, attempt + 1, self.retries, delay)
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def error(self, what: str, exc: OSError) -> StorageError:
        if isinstance(exc, StorageError):
            return exc
        hint = _FATAL_ERRNOS.get(exc.errno or 0, "check that the storage is reachable and retry")
        return StorageError(f"could not {what} in {self.display()}: {exc.strerror or exc}; {hint}")


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
