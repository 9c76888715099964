"""A merge's output: safetensors files written tensor by tensor from a thread, published on commit.

Each file's header is computed from shapes and dtypes before any data (core.checkpoint.build_header),
so tensors are written as they are merged, by a thread that overlaps the disk with the maths. Each
file is a staged write of the run's storage (core.storage.Staged: a temporary name on a filesystem,
an upload not yet completed on S3); `commit()` publishes them all, in order, then writes the
manifests of the files that want one; `abort()` discards them. Nothing is visible until the whole
merge has succeeded.
"""
from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from core.checkpoint import DTYPES, HashingWriter, TensorSpec, build_header, publish_manifest, tensor_bytes
from core.errors import CheckpointError
from core.storage import Staged, Storage

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


class StreamWriter:
    """Writes `files` one after another from a thread, tensor by tensor, in their specs' order."""

    def __init__(self, files: list[OutputFile], depth: int = 2) -> None:
        """`depth`: tensors queued before `put` blocks."""
        self.files = files
        self._q: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._staged: list[Staged] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="merge-writer", daemon=True)
        self._thread.start()

    def put(self, name: str, t: torch.Tensor) -> None:
        """Queue the next tensor (or the next slice of one, in order); the writer owns it from now on."""
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
            if self._q.get() is not _DONE:
                raise CheckpointError("the merge produced more tensors than the output's headers hold")
        except BaseException as exc:  # reported to the main thread by put()/finish()
            self._error = exc
            with contextlib.suppress(queue.Empty):  # unblock a producer waiting on a full queue
                while True:
                    self._q.get_nowait()

    def _write_file(self, out: OutputFile) -> None:
        header, layout = build_header(out.specs, out.metadata)
        staged = out.storage.stage(out.key)
        self._staged.append(staged)
        w = HashingWriter(staged)
        try:
            for data in self._chunks(header, layout):
                w.write(data)
        except OSError as exc:
            raise out.storage.error(f"write {out.key}", exc) from exc
        out.entry = {} if out.manifest is None else w.manifest(out.key, out.manifest, len(layout))

    def _chunks(self, header: bytes, layout: list[TensorSpec]) -> Iterator[memoryview]:
        yield memoryview(header)
        for spec in layout:
            left, first = spec.nbytes, True
            while left > 0 or first:
                item = self._q.get()
                if item is _DONE:
                    raise CheckpointError(f"the merge ended before tensor {spec.name} was written")
                name, t = item
                data = tensor_bytes(t)
                if name != spec.name or DTYPES.get(t.dtype) != spec.dtype or len(data) > left:
                    raise CheckpointError(f"tensor {name} {t.dtype} ({len(data)} bytes) does not fit the output header's "
                                          f"{spec.name} {spec.dtype} ({left} bytes left): the merge's order is wrong")
                left, first = left - len(data), False
                if len(data):
                    yield data

    def finish(self) -> None:
        """Wait until every queued tensor is written (the files still staged, not visible)."""
        while self._error is None and self._thread.is_alive():
            try:
                self._q.put(_DONE, timeout=0.5)
                break
            except queue.Full:
                continue
        self._thread.join()
        if self._error is not None:
            raise self._error

    def commit(self) -> list[dict[str, Any]]:
        """Publish every file, then write the manifests; returns them ({} for a file without one)."""
        for staged in self._staged:
            staged.publish()
        self._staged = []
        for out in self.files:
            if out.manifest is not None:
                publish_manifest(out.storage, out.key, out.entry)
        return [out.entry for out in self.files]

    def abort(self) -> None:
        """Stop the thread and discard every file: nothing of this merge stays behind."""
        self._error = self._error or CheckpointError("merge aborted")
        with contextlib.suppress(queue.Empty):
            while True:
                self._q.get_nowait()
        with contextlib.suppress(queue.Full):
            self._q.put_nowait(_DONE)
        self._thread.join(timeout=30)
        for staged in self._staged:
            staged.discard()
        self._staged = []
