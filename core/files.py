"""The file operations core.storage asks of a backend, and the backend for any fsspec filesystem.

`Storage` (core/storage.py) owns keys, retries, fencing, JSON and staged writes; what differs
between a local run directory and an object store (how a file is opened, created only if absent,
renamed, removed, told apart from a later one, and written invisibly until whole) is a backend's:
`FsspecFiles` here (S3, GCS, memory://, anything fsspec opens), `LocalFiles` (core/local_files.py:
a local or shared POSIX filesystem, reached through no link). Both take fsspec paths (root + key).

Why not fsspec's transactions for the staged writes: on a local filesystem fsspec writes a
temporary file by path and moves it into place with shutil.move, following any link planted on the
way, which core/local_files.py's folder descriptors exist to refuse; on S3 a transaction defers the upload's completion to
the transaction's end, which is what writing straight to the key and completing it on publish
(`_Upload`) already does, one file at a time.
"""
from __future__ import annotations

import contextlib
import posixpath
import uuid
from collections.abc import Callable
from typing import IO, Any, Protocol, TypeVar

import fsspec

T = TypeVar("T")
TMP_PREFIX = ".tmp-"
# Object stores where a PUT is atomic (an object appears whole or not at all) and fsspec's file
# can abort its upload: a staged write goes straight to the key there instead of copy + delete.
_ATOMIC_PUT_PROTOCOLS = {"s3", "s3a"}
# Where create_exclusive is a real conditional write (S3 `If-None-Match: *`, honoured by AWS S3
# since 2024-08, MinIO, moto); elsewhere off the local filesystem it is check-then-write.
_CONDITIONAL_PUT_PROTOCOLS = {"s3", "s3a"}
Retry = Callable[[str, Callable[[], Any]], Any]


def temp_name(name: str) -> str:
    """A hidden temporary name beside `name`: Storage.list never shows it, sweep_temporaries deletes it."""
    return f"{TMP_PREFIX}{uuid.uuid4().hex[:12]}-{name}"


def protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


class Writer(Protocol):
    """One file being written, invisible to readers until `commit` (after `close`)."""
    file: Any
    fd: int | None
    """A local file's descriptor (Staged drops its written pages from the page cache), else None."""

    def close(self) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


class Files(Protocol):
    """What a backend does with the paths of one run root (see the module docstring)."""
    atomic_put: bool
    """A plain write is atomic (S3): no temporary name, no copy, nothing left to sweep."""
    exclusive: bool
    """create_exclusive is atomic here; where it is not, Storage checks first, then writes."""

    def makedirs(self, path: str) -> None: ...
    def open_read(self, path: str) -> IO[bytes]: ...
    def create_exclusive(self, path: str, data: bytes) -> bool: ...
    def identity(self, path: str) -> tuple | None: ...
    def unlink(self, path: str, recursive: bool = False) -> None: ...
    def move(self, src: str, dst: str) -> None: ...
    def move_if(self, src: str, dst: str, seen: tuple | None) -> bool: ...
    def writer(self, path: str) -> Writer: ...


class FsspecFiles:
    """Any fsspec filesystem off the local disk. `retry(what, fn)`: Storage's retry with back-off."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, retry: Retry) -> None:
        self.fs, self.root, self.retry = fs, root, retry
        self.atomic_put = bool(_ATOMIC_PUT_PROTOCOLS.intersection(protocols(fs)))
        self.exclusive = bool(_CONDITIONAL_PUT_PROTOCOLS.intersection(protocols(fs)))

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def open_read(self, path: str) -> IO[bytes]:
        return self.retry(f"open {self._key(path)}", lambda: self.fs.open(path, "rb"))

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """A conditional PUT (only where `exclusive`: Storage checks, then writes, elsewhere)."""
        failed_before = [False]

        def put() -> bool:
            try:
                self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                # An attempt whose reply was lost may have created it: then it holds our bytes.
                return failed_before[0] and self.fs.cat_file(path) == data
            except OSError:
                failed_before[0] = True
                raise
            return True
        return self.retry(f"create {self._key(path)}", put)

    def identity(self, path: str) -> tuple | None:
        """Its size and ETag or modification time."""
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        return info.get("size"), str(info.get("ETag") or info.get("mtime") or info.get("LastModified") or info.get("created"))

    def unlink(self, path: str, recursive: bool = False) -> None:
        self.fs.rm(path, recursive=recursive)

    def move(self, src: str, dst: str) -> None:
        self.fs.mv(src, dst)  # an object store copies, then deletes

    def move_if(self, src: str, dst: str, seen: tuple | None) -> bool:
        """No rename here: the identity is checked first, then the file moved."""
        if self.identity(src) != seen:
            return False
        with contextlib.suppress(FileNotFoundError):
            self.retry(f"move {self._key(src)} to {self._key(dst)}", lambda: self.move(src, dst))
        return True

    def writer(self, path: str) -> Writer:
        return _Upload(self.fs, path) if self.atomic_put else _RemoteTemp(self, path)

    def _key(self, path: str) -> str:
        """`path` as a key, for a message (Storage.error names the root)."""
        return posixpath.relpath(path, self.root) if path.startswith(self.root) else path


class _Upload:
    """S3: the key itself, because an object appears only when its upload completes: close completes
    it, abort aborts it (a killed writer leaves an incomplete multipart upload, which no reader sees)."""
    fd = None

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self.file = fs.open(path, "wb")

    def close(self) -> None:
        self.file.close()  # the single PUT, or the multipart upload's completion

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            # Not close(): a buffered fsspec file would commit the upload, publishing a part.
            self.file.discard()  # aborts the multipart upload, drops the buffer
            self.file.closed = True  # so that its __del__ does not upload what is left


class _RemoteTemp:
    """A filesystem with a rename: a hidden temporary name beside the key, moved into place."""
    fd = None

    def __init__(self, files: FsspecFiles, path: str) -> None:
        self.fs, self.path = files.fs, path
        folder = posixpath.dirname(path)
        files.makedirs(folder)
        self.tmp = posixpath.join(folder, temp_name(posixpath.basename(path)))
        self.file = self.fs.open(self.tmp, "wb")

    def close(self) -> None:
        self.file.close()

    def commit(self) -> None:
        self.fs.mv(self.tmp, self.path)

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.file.close()
        with contextlib.suppress(Exception):
            self.fs.rm(self.tmp)
