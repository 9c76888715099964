"""Writing checkpoints: the one writer of the format (core.checkpoint holds the format and its reader).

A file's safetensors header is computed from shapes and dtypes before any data (build_header), so
tensors are written as they are made: a worker's whole state dict at once (write_checkpoint), or a
merge's output slice by slice, from a thread that overlaps the disk with the maths (StreamWriter).
Either way every byte goes through one loop (_write_file): each tensor checked against its header
entry, hashed on the way, into a staged write of the storage (core.storage.Staged: a temporary
name on a filesystem, an upload not yet completed on S3). The data is published first, then the
manifest (round, worker, digest, bytes, ...): a reader trusts a checkpoint only once its manifest
exists and its bytes hash to the digest, so a half-written file is never taken for a whole one.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from core.checkpoint import DTYPES, TensorSpec, build_header, new_hasher, spec_of
from core.errors import CheckpointError
from core.layout import manifest_key
from core.manifest import HASH
from core.storage import Staged, Storage

Spec = tuple[str, str, tuple[int, ...], int]
"""(name, safetensors dtype, shape, bytes) of one tensor of a file, in file order."""
_DONE = object()


@dataclass
class OutputFile:
    """One checkpoint to write: where, its tensors in file order, and what goes beside them."""

    storage: Storage
    key: str
    specs: list[Spec]
    metadata: Mapping[str, str] | None = None
    """The safetensors header's __metadata__ (strings)."""
    manifest: Mapping[str, Any] | None = None
    """Fields of the JSON manifest written beside the file on commit; None: no manifest (HF shards)."""
    entry: dict[str, Any] = field(default_factory=dict)
    """The manifest as written, once committed."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def publish_manifest(storage: Storage, key: str, entry: dict[str, Any]) -> dict[str, Any]:
    """Write checkpoint `key`'s manifest (after its data is published): from now on it is whole."""
    entry["written_at"] = time.time()
    storage.write_json(manifest_key(key), entry)
    return entry


def _write_file(out: OutputFile, items: Iterator[tuple[str, torch.Tensor]], last: bool) -> Staged:
    """`out`'s bytes from `items` (whole tensors, or 1-D slices in order), staged, not published;
    `out.entry` becomes its manifest. Every piece must fit its header entry: same name and dtype,
    the header's shape when it is the whole tensor, no more bytes than the entry has left. `last`:
    nothing may follow (which also drives a generator to its end: code after its last yield, such
    as a merge's checksum verification, runs before anything is published)."""
    header, layout = build_header(out.specs, out.metadata)
    staged = out.storage.stage(out.key)
    digest, nbytes = new_hasher(), 0
    try:
        for data in _pieces(header, layout, items):
            staged.write(data)
            digest.update(data)
            nbytes += len(data)
        if last and (extra := next(items, None)) is not None:
            raise CheckpointError(f"more tensors than the {len(out.specs)} of {out.key}'s header (extra: {extra[0]})")
    except BaseException:
        staged.discard()
        raise
    out.entry = {} if out.manifest is None else {
        **out.manifest, "file": out.key.rsplit("/", 1)[-1], "hash": HASH, "digest": digest.hexdigest(),
        "bytes": nbytes, "tensors": len(layout)}
    return staged


def digest_of(specs: list[Spec], metadata: Mapping[str, str] | None, items: Iterator[tuple[str, torch.Tensor]]) -> str:
    """The digest the manifest of a checkpoint of `items` (in the order of `specs`) would name,
    computed from the same bytes a write hashes, without writing it: how a worker that replayed a
    round's merge checks its result against the published global weights."""
    header, layout = build_header(specs, metadata)
    digest = new_hasher()
    for data in _pieces(header, layout, items):
        digest.update(data)
    return digest.hexdigest()


def _pieces(header: bytes, layout: list[TensorSpec], items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[memoryview]:
    yield memoryview(header)
    for spec in layout:
        left, first = spec.nbytes, True
        while left > 0 or first:
            item = next(items, None)
            if item is None:
                raise CheckpointError(f"the tensors ended before {spec.name} was written: the writer's specs and its "
                                      "tensors disagree")
            name, t = item
            data = tensor_bytes(t)
            whole = first and len(data) == spec.nbytes and t.dim() != 1
            if name != spec.name or DTYPES.get(t.dtype) != spec.dtype or len(data) > left or \
                    whole and tuple(t.shape) != spec.shape:
                raise CheckpointError(f"tensor {name} {t.dtype} {tuple(t.shape)} ({len(data)} bytes) does not fit the "
                                      f"header entry {spec.name} {spec.dtype} {spec.shape} ({left} bytes left): the "
                                      "writer's specs and its tensors disagree")
            left, first = left - len(data), False
            if len(data):
                yield data


def write_checkpoint(storage: Storage, key: str, tensors: Mapping[str, torch.Tensor] | None = None, *,
                     specs: list[Spec] | None = None, stream: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None = None,
                     metadata: Mapping[str, str] | None = None, manifest: Mapping[str, Any] | None = None
                     ) -> dict[str, Any]:
    """Write a checkpoint and then its manifest; return the manifest.

    Either `tensors` (a mapping, written in sorted-name order) or `specs` + `stream`
    (a generator of the tensors in the order of `specs`, e.g. a merge computing them one at a time)."""
    if tensors is not None:
        names = sorted(tensors)
        specs, stream = [spec_of(n, tensors[n]) for n in names], lambda: ((n, tensors[n]) for n in names)
    assert specs is not None and stream is not None
    return publish_manifest(storage, key, write_data(OutputFile(storage, key, specs, metadata, dict(manifest or {})),
                                                     stream).entry)


def write_data(out: OutputFile, stream: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> OutputFile:
    """`out`'s data from `stream` (its tensors in the order of `out.specs`), published without its
    manifest: no reader takes it for a checkpoint until publish_manifest(out.storage, out.key,
    out.entry) commits it (a sharded worker's contribution waits for its state snapshot)."""
    try:
        _write_file(out, iter(stream()), last=True).publish()
    except OSError as exc:
        raise out.storage.error(f"write checkpoint {out.key}", exc) from exc
    return out


class StreamWriter:
    """Writes `files` one after another from a thread, tensor by tensor, in their specs' order;
    `commit()` publishes them all, in order, then their manifests; `abort()` discards them."""

    def __init__(self, files: list[OutputFile], depth: int = 2) -> None:
        """`depth`: tensors queued before `put` blocks."""
        self.files = files
        self._q: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._staged: list[Staged] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
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

    def _items(self) -> Iterator[tuple[str, torch.Tensor]]:
        while (item := self._q.get()) is not _DONE:
            yield item

    def _run(self) -> None:
        items = self._items()
        try:
            for out in self.files:
                try:
                    self._staged.append(_write_file(out, items, last=out is self.files[-1]))
                except OSError as exc:
                    raise out.storage.error(f"write {out.key}", exc) from exc
        except BaseException as exc:  # reported to the main thread by put()/finish()
            self._error = exc
            with contextlib.suppress(queue.Empty):  # unblock a producer waiting on a full queue
                while True:
                    self._q.get_nowait()

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
        self._error = self._error or CheckpointError("write aborted")
        with contextlib.suppress(queue.Empty):
            while True:
                self._q.get_nowait()
        with contextlib.suppress(queue.Full):
            self._q.put_nowait(_DONE)
        self._thread.join(timeout=30)
        for staged in self._staged:
            staged.discard()
        self._staged = []
