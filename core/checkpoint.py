"""Checkpoints: safetensors files plus a JSON manifest written last. Never pickles.

The format, and its one reader: a file is trusted only once its manifest exists and its bytes hash
to the manifest's digest, so a half-written or damaged file is never taken for a whole one. The one
writer is core.checkpoint_writer.

Reading is lazy: the header is parsed and checked first, then each tensor is read when asked for
(by offset, on any fsspec file), so memory does not grow with the number of checkpoints open at once.
"""
from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from core.errors import CheckpointError
from core.manifest import read_manifest
from core.storage import Storage

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20
Alloc = Callable[[str, tuple[int, ...], torch.dtype], "torch.Tensor | None"]
"""(name, shape, dtype) -> a CPU tensor to read that tensor into, or None for a new one."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors dtype string, e.g. "F32"
    shape: tuple[int, ...]
    start: int  # byte offsets inside the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]


def spec_of(name: str, t: torch.Tensor) -> tuple[str, str, tuple[int, ...], int]:
    if t.dtype not in DTYPES:
        raise CheckpointError(f"tensor {name}: dtype {t.dtype} cannot be stored in safetensors")
    return name, DTYPES[t.dtype], tuple(t.shape), t.numel() * t.element_size()


def build_header(specs: Iterable[tuple[str, str, tuple[int, ...], int]], metadata: Mapping[str, str] | None) -> tuple[bytes, list[TensorSpec]]:
    """The safetensors header for tensors written in the given order (no data needed)."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset, out = 0, []
    for name, dtype, shape, nbytes in specs:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        out.append(TensorSpec(name, dtype, tuple(shape), offset, offset + nbytes))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data section to 8 bytes
    return struct.pack("<Q", len(raw)) + raw, out


def new_hasher() -> Any:
    """A hasher of the digest every manifest names (core.manifest.HASH)."""
    return xxhash.xxh3_128()


def parse_header(raw: bytes, label: str) -> tuple[dict[str, str], dict[str, TensorSpec]]:
    """(metadata, specs in file order) of a safetensors header, every entry checked: a JSON object;
    metadata strings only; each tensor a known dtype, a shape of non-negative integers, offsets that
    hold exactly shape x itemsize bytes; the tensors tile the data section without gaps or overlaps.
    Raises CheckpointError naming the file and the entry."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{label}: safetensors header is not valid JSON ({type(exc).__name__}): the file is damaged") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{label}: safetensors header is not a JSON object: the file is damaged")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError(f"{label}: safetensors __metadata__ must map strings to strings: the file is damaged")
    specs = {}
    for name, e in header.items():
        try:
            dtype, shape, (start, end) = e["dtype"], e["shape"], e["data_offsets"]
            ok = (dtype in TORCH_DTYPES and isinstance(shape, list) and all(_is_count(d) for d in shape)
                  and _is_count(start) and _is_count(end) and end - start == math.prod(shape) * ITEMSIZE[dtype])
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(f"{label}: header entry for tensor {name[:100]!r} is malformed ({str(e)[:200]}): "
                                  "the file is damaged or not a safetensors file")
        specs[name] = TensorSpec(name, dtype, tuple(shape), start, end)
    ordered = dict(sorted(specs.items(), key=lambda kv: (kv[1].start, kv[1].end)))
    pos = 0
    for spec in ordered.values():
        if spec.start != pos:
            raise CheckpointError(f"{label}: tensor {spec.name[:100]!r} starts at byte {spec.start} of the data, expected "
                                  f"{pos}: tensors overlap or leave gaps; the file is damaged")
        pos = spec.end
    return meta, ordered


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << 62)


ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
FLOATS = frozenset({"F64", "F32", "F16", "BF16"})


PIECE = 1 << 20
"""Bytes read, then hashed, at a time: small enough to be hashed while still in the core's cache."""
DROP_BEHIND_BYTES = 64 << 20
"""Local files at least this large are read with the kernel's read-ahead and dropped from the page
cache once read: a merge reads each input once, and letting a cold read fill the cache costs this
kind of machine several times the CPU (docs/benchmarks.md, Merge)."""


class TensorFile:
    """One safetensors file opened for reading: the only reader of the format in islands.

    Opening reads and checks the whole header (parse_header) and the file's size against it, before
    any tensor data is read. Tensors, or slices of them, are then read on demand, into a buffer the
    caller gives or a new one, so that memory does not grow with the number of files open at once.
    Bytes read in file order are hashed on the way (with the hash the manifest names); `verify()`
    then reads whatever was skipped and compares the digest and size with the manifest. A file
    without a manifest (safetensors from elsewhere) has nothing to verify. One thread at a time.
    """

    def __init__(self, storage: Storage, key: str, manifest: Mapping[str, Any] | None = None, label: str = "") -> None:
        self.storage, self.key, self.label = storage, key, label or storage.display(key)
        self.manifest = dict(manifest) if manifest is not None else None
        self._hasher = new_hasher() if self.manifest is not None else None
        self._pos = 0  # bytes hashed so far, always a prefix of the file
        self._fd: int | None = None
        self._f: Any = None
        try:
            if storage.is_local:
                self._fd = storage.open_fd(key)
                actual = os.fstat(self._fd).st_size
            else:
                self._f = storage.open_read(key)
                actual = storage.size(key)
        except FileNotFoundError:
            self.close()
            raise CheckpointError(f"{self.label}: checkpoint file is missing") from None
        except OSError as exc:
            self.close()
            raise CheckpointError(f"{self.label}: cannot be opened ({exc}); check the path and its permissions") from None
        promised = self.manifest.get("bytes") if self.manifest is not None else None
        if promised is not None and actual != promised:  # before a byte is read: a planted file may be any size
            self.close()
            raise CheckpointError(f"{self.label}: the file has {actual} bytes, its manifest says {promised}: truncated "
                                  "or replaced; delete it and its .json so it is written again")
        self._drop = self._fd is not None and actual >= DROP_BEHIND_BYTES
        try:
            self.metadata, self.specs, self.data_start = self._read_header(actual)
        except BaseException:
            self.close()
            raise
        self.size = self.data_start + max((sp.end for sp in self.specs.values()), default=0)
        if actual != self.size:
            self.close()
            raise CheckpointError(f"{self.label}: " + (
                f"file is truncated: its header describes {self.size} bytes, the file has {actual}" if actual < self.size
                else f"file has {actual - self.size} bytes after the last tensor: damaged or not a safetensors file")
                + "; copy or download it again")
        if self._drop:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._f is not None:
            self._f.close()
            self._f = None

    def _read_header(self, actual: int) -> tuple[dict[str, str], dict[str, TensorSpec], int]:
        if actual < 8:
            raise CheckpointError(f"{self.label}: file is truncated ({actual} bytes): not a whole safetensors file")
        head = bytearray(8)
        self.read_into(0, memoryview(head))
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, actual - 8):
            raise CheckpointError(f"{self.label}: header length {n} is implausible for a file of {actual} bytes: "
                                  "not a safetensors file, or truncated")
        raw = bytearray(n)
        self.read_into(8, memoryview(raw))
        return (*parse_header(bytes(raw), self.label), 8 + n)

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill `out` with the file's bytes at `offset`, PIECE bytes at a time, each hashed as soon as
        it is read if it continues the hashed prefix; a large local file's pages are then dropped."""
        n = len(out)
        for o in range(0, n, PIECE):
            view = out[o:o + PIECE]
            self._read_exact(offset + o, view)
            if self._hasher is not None and offset + o == self._pos:
                self._hasher.update(view)
                self._pos += len(view)
        if self._drop and n:
            # everything before, not only the range read: the kernel's read-ahead brings in pages
            # just behind a reader too, and those would pile up (docs/benchmarks.md, Merge)
            os.posix_fadvise(self._fd, 0, offset + n, os.POSIX_FADV_DONTNEED)

    def _read_exact(self, offset: int, view: memoryview) -> None:
        want, got = len(view), 0
        try:
            while got < want:
                if self._fd is not None:
                    k = os.preadv(self._fd, [view[got:]], offset + got)
                else:
                    self._f.seek(offset + got)
                    k = self._f.readinto(view[got:])
                if not k:
                    break
                got += k
        except OSError as exc:
            raise CheckpointError(f"{self.label}: read failed at offset {offset} ({exc}); check the storage and retry") from None
        if got != want:
            raise CheckpointError(f"{self.label}: file is truncated (wanted {want} bytes at offset {offset}, got {got})")

    def keys(self) -> list[str]:
        return list(self.specs)

    def spec(self, name: str) -> TensorSpec:
        spec = self.specs.get(name)
        if spec is None:
            raise CheckpointError(f"{self.label}: has no tensor {name}")
        return spec

    def read(self, name: str, start: int = 0, stop: int | None = None, buf: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [start, stop) of tensor `name`: the whole tensor (its shape) by default, else a
        1-D slice. Read into `buf` (a CPU uint8 tensor of at least that many bytes, the caller's to
        reuse) or a new buffer; the result is a view of it in the tensor's dtype."""
        spec = self.spec(name)
        numel = math.prod(spec.shape)
        stop = numel if stop is None else stop
        item = ITEMSIZE[spec.dtype]
        nbytes = (stop - start) * item
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        raw = buf[:nbytes]
        if nbytes:
            self.read_into(self.data_start + spec.start + start * item, memoryview(raw.numpy()))
        t = raw.view(spec.torch_dtype)
        return t.reshape(spec.shape) if (start, stop) == (0, numel) else t

    def get(self, name: str, alloc: Alloc | None = None) -> torch.Tensor:
        """Tensor `name`, read into a new CPU tensor, or into `alloc(name, shape, dtype)` (reused
        buffers, e.g. page-locked ones a GPU copies from at full speed) when that gives one."""
        spec = self.spec(name)
        out = alloc(name, spec.shape, spec.torch_dtype) if alloc is not None and spec.nbytes else None
        if out is None:
            return self.read(name)
        if out.device.type != "cpu" or not out.is_contiguous() or out.dtype != spec.torch_dtype or tuple(out.shape) != spec.shape:
            raise CheckpointError(f"{self.label}: the buffer given for tensor {name} is not a contiguous CPU "
                                  f"{spec.torch_dtype} {list(spec.shape)} tensor (a bug in the caller)")
        self.read(name, buf=out.view(-1).view(torch.uint8))
        return out

    def load_all(self, verify: bool = True, alloc: Alloc | None = None) -> dict[str, torch.Tensor]:
        out = {name: self.get(name, alloc) for name in self.specs}
        if verify:
            self.verify()
        return out

    def verify(self) -> None:
        """Raise unless the whole file hashes to the manifest's digest and has its size; bytes not
        read in file order are read now, in one pass. Nothing to check without a manifest."""
        if self.manifest is None or self._hasher is None:
            return
        buf = memoryview(bytearray(min(16 << 20, max(1, self.size - self._pos))))
        while self._pos < self.size:
            self.read_into(self._pos, buf[: min(len(buf), self.size - self._pos)])
        if self.manifest.get("bytes") not in (None, self.size):
            raise CheckpointError(f"{self.label}: size {self.size} differs from the manifest's {self.manifest['bytes']}: "
                                  "truncated or replaced")
        if self._hasher.hexdigest() != self.manifest["digest"]:
            raise CheckpointError(f"{self.label}: checksum does not match the manifest: the file is corrupt; "
                                  "delete it and its .json so it is written again")


def open_checkpoint(storage: Storage, key: str, label: str = "") -> TensorFile:
    """Open a published checkpoint (its manifest must exist)."""
    manifest = read_manifest(storage, key, label)
    if manifest is None:
        raise CheckpointError(f"{label or storage.display(key)}: no manifest, so the checkpoint is incomplete or absent")
    return TensorFile(storage, key, manifest, label)


def load_checkpoint(storage: Storage, key: str, label: str = "",
                    alloc: Alloc | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, Any]]:
    """Read and verify a whole checkpoint: (tensors, safetensors metadata, manifest). `alloc`:
    see TensorFile.get."""
    with open_checkpoint(storage, key, label) as ck:
        tensors = ck.load_all(verify=True, alloc=alloc)
        return tensors, ck.metadata, ck.manifest or {}
