"""Streaming output of a merge: safetensors files written tensor by tensor, published only on commit.

Each file's header is computed from shapes and dtypes before any data (core.checkpoint.build_header),
so tensors are written as they are merged, by a writer thread that overlaps the disk with the maths
(a large local file around the page cache: merge.directio.DirectWriter).
Files go to hidden temporary names; `commit()` renames them all into place and then writes the
manifests (files that want one), in order; `abort()` deletes them. Nothing is visible until the
whole merge has succeeded. A `PendingWrite` is a writer whose files are written only after the
merge returned: the round merge's outer state, written once the new global is published, so that
the next round's workers do not wait for it.
"""
from __future__ import annotations

import contextlib
import posixpath
import queue
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from core.checkpoint import DTYPES, HASH, TensorSpec, build_header, new_hasher, tensor_bytes
from core.errors import CheckpointError
from core.failpoints import failpoint
from core.layout import manifest_key
from core.storage import TMP_PREFIX, Storage
from merge import directio

_DONE = object()


@dataclass
class OutputFile:
    storage: Storage
    key: str
    specs: list[tuple[str, str, tuple[int, ...], int]]  # (name, dtype, shape, nbytes) in file order
    metadata: Mapping[str, str] | None = None
    manifest: Mapping[str, Any] | None = None
    """Fields of the JSON manifest written beside the file on commit; None: no manifest (HF shards)."""
    entry: dict[str, Any] = field(default_factory=dict)  # the manifest as written, after commit
    io: str = "auto"
    """How a local file is written (merge.directio.IO_MODES): around the page cache
    (directio.DirectWriter) if it is large (`auto`) or always (`direct`), or through it (`buffered`)."""


class StreamWriter:
    """Writes `files` one after another from a thread, tensor by tensor, in their specs' order."""

    def __init__(self, files: list[OutputFile], depth: int = 2, start: bool = True) -> None:
        """`depth`: tensors queued before `put` blocks (0: never blocks, the queue holds them all).
        `start=False`: nothing is written until `start()`; the queue fills meanwhile."""
        self.files = files
        self._q: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._tmp: list[tuple[OutputFile, str]] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="merge-writer", daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        self._thread.start()

    def put(self, name: str, t: torch.Tensor) -> None:
        """Queue the next tensor (or slice of one, in order); the writer owns it from now on."""
        while True:
            if self._error is not None:
                raise self._error
            try:
                self._q.put((name, t), timeout=0.5)
                return
            except queue.Full:
                continue

    def _run(self) -> None:
        try:
            for out in self.files:
                self._write_file(out)
            item = self._q.get()
            if item is not _DONE:
                raise CheckpointError(f"the merge produced more tensors than the output's headers hold (extra: {item[0]})")
        except BaseException as exc:  # reported to the main thread by put()/finish()
            self._error = exc
            with contextlib.suppress(queue.Empty):  # unblock a producer waiting on a full queue
                while True:
                    self._q.get_nowait()

    def _write_file(self, out: OutputFile) -> None:
        header, layout = build_header(out.specs, out.metadata)
        final = out.storage.path(out.key)
        tmp = posixpath.join(posixpath.dirname(final), f"{TMP_PREFIX}{uuid.uuid4().hex[:12]}-{posixpath.basename(final)}")
        fs = out.storage.fs
        try:
            out.storage.makedirs_path(posixpath.dirname(final))  # private folders on POSIX (core.storage)
            f: Any = None if not out.storage.is_local else directio.create_direct(
                tmp, len(header) + sum(s.nbytes for s in layout), out.io)
            if f is None:
                f = fs.open(tmp, "wb")
            out.storage.make_private(tmp)
        except OSError as exc:
            raise out.storage.error(f"create {out.key}", exc) from exc
        self._tmp.append((out, tmp))
        sha = new_hasher() if out.manifest is not None else None
        nbytes = 0
        try:
            with f:  # closing writes what is still buffered: a full disk may show only then
                for data in self._file_chunks(header, layout):
                    f.write(data)
                    if sha is not None:
                        sha.update(data)
                    nbytes += len(data)
        except OSError as exc:
            raise out.storage.error(f"write {out.key}", exc) from exc
        out.entry = {} if sha is None else {
            **(out.manifest or {}), "file": out.key.rsplit("/", 1)[-1], "hash": HASH, "digest": sha.hexdigest(),
            "bytes": nbytes,
            "tensors": len(layout)}

    def _file_chunks(self, header: bytes, layout: list[TensorSpec]):
        yield memoryview(header)
        for spec in layout:
            left = spec.nbytes
            first = True
            while left > 0 or first:
                item = self._q.get()
                if item is _DONE:
                    raise CheckpointError(f"the merge ended before tensor {spec.name} was written")
                name, t = item
                data = tensor_bytes(t)
                if name != spec.name or DTYPES.get(t.dtype) != spec.dtype or len(data) > left:
                    raise CheckpointError(f"tensor {name} {t.dtype} ({len(data)} bytes) does not fit the output header's "
                                          f"{spec.name} {spec.dtype} ({left} bytes left): the engine's order is wrong")
                left -= len(data)
                first = False
                if len(data):
                    yield data

    def finish(self) -> None:
        """Wait until every queued tensor is written (files still under temporary names)."""
        while self._thread.is_alive():
            if self._error is None:
                try:
                    self._q.put(_DONE, timeout=0.5)
                    break
                except queue.Full:
                    continue
            break
        self._thread.join()
        if self._error is not None:
            raise self._error

    def commit(self) -> list[dict[str, Any]]:
        """Rename every file into place, then write the manifests; returns them ({} for none)."""
        for out, tmp in self._tmp:
            try:
                out.storage.fs.mv(tmp, out.storage.path(out.key))
            except OSError as exc:
                raise out.storage.error(f"publish {out.key}", exc) from exc
        self._tmp = []
        for out in self.files:
            if out.manifest is not None:
                out.entry["written_at"] = time.time()
                out.storage.write_json(manifest_key(out.key), out.entry)
        return [out.entry for out in self.files]

    def abort(self) -> None:
        """Stop the thread and delete every temporary file: nothing of this merge stays behind."""
        self._error = self._error or CheckpointError("merge aborted")
        with contextlib.suppress(queue.Empty):
            while True:
                self._q.get_nowait()
        with contextlib.suppress(queue.Full):
            self._q.put_nowait(_DONE)
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=30)
        for out, tmp in self._tmp:
            with contextlib.suppress(Exception):
                out.storage.fs.rm(tmp)
        self._tmp = []


class PendingWrite:
    """Files of a merge that are written after it returned, from their own thread, once `start()`
    is called: their tensors wait in memory (the writer's queue) until then. The merge service
    starts the round's outer state after the round's record, and `wait()`s for it before it needs
    the file (the next merge) or leaves; a failed or interrupted write leaves only a temporary
    file, and the state is rebuilt from the round's inputs (orchestrator.outer_state)."""

    def __init__(self, writer: StreamWriter) -> None:
        self._writer = writer
        self._thread = threading.Thread(target=self._run, name="merge-pending-writer", daemon=True)
        self._error: BaseException | None = None
        self.manifests: list[dict[str, Any]] = []

    def start(self) -> None:
        if self._thread.ident is None:
            self._thread.start()

    def _run(self) -> None:
        try:
            failpoint("merge.before_pending_write")  # crash tests: the round committed, its state not written
            self._writer.start()
            self._writer.finish()
            self.manifests = self._writer.commit()
        except BaseException as exc:  # raised by wait()
            self._error = exc
            self._writer.abort()

    def wait(self) -> list[dict[str, Any]]:
        """Write (if not started yet) and wait; the manifests written, or the write's error."""
        self.start()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.manifests

    def discard(self) -> None:
        """Never write these files (the merge they belong to was not committed)."""
        if self._thread.ident is None:
            self._writer.abort()
        else:
            self._thread.join()
