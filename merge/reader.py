"""Reading safetensors files for a merge: headers first, then byte ranges into reusable buffers.

`TensorFile` parses and checks a file's header (and its size, so a truncated file is refused
before any maths), then reads byte ranges straight into caller-owned buffers: positional reads
(`os.preadv`) on local files, seek + readinto on any other fsspec file. No per-tensor bytes
objects, no copies. Large local files that are not in the page cache are read through it with
every page dropped once read (merge.directio: a cache left to fill costs more CPU in page
handling than the merge's maths); the `io` argument forces O_DIRECT or plain buffered reads.
When the file has a manifest (our checkpoints do), ranges read in file order are hashed on the
way (with the hash the manifest names: core.checkpoint.new_hasher) and `verify()` compares with
the manifest at the end; files without one (safetensors from elsewhere) are not hashed. A file
read drop-behind `streams`: its ranges are read in file order PIECE bytes at a time, each piece
hashed the moment it is read.

`Model` is one merge input: a single `.safetensors` file or a Hugging Face model directory
(`model.safetensors`, or shards listed by `model.safetensors.index.json`).
"""
from __future__ import annotations

import json
import logging
import math
import os
import posixpath
import struct
from dataclasses import dataclass
from typing import Any

import fsspec
import torch

from core.checkpoint import TORCH_DTYPES, TensorSpec, new_hasher
from core.errors import CheckpointError, StorageError
from core.layout import manifest_key
from core.manifest import check_manifest
from core.storage import Storage
from merge import directio

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
FLOATS = {"F64", "F32", "F16", "BF16"}
_MAX_HEADER = 100 << 20
_VERIFY_CHUNK = 16 << 20
PIECE = 1 << 20
"""Bytes read and then hashed at a time by a streaming file (`TensorFile.read_hashing`): small
enough to be hashed while still in the core's cache. Hashing each 8 MiB segment after reading
it read every byte back from memory: the K = 8 merge of 1.016 GiB inputs used 8.7 CPU-s where
1 MiB pieces use 7.8 (child processes, alternating, medians of 4; docs/benchmarks.md); 256 KiB
pieces cost more (more calls), 4 MiB no less."""


class InputError(CheckpointError):
    """One input of a merge is unusable; `ident` says which (a worker id, an input index)."""

    def __init__(self, ident: Any, message: str) -> None:
        super().__init__(message)
        self.ident = ident
        self.reason = message


def load_manifest(storage: Storage, key: str, required: bool, label: str) -> dict[str, Any] | None:
    """The manifest beside `key`: required for checkpoints of a run, optional for plain files.

    A plain file's neighbour `X.json` that is not a manifest (no digest) is ignored.
    """
    try:
        m = storage.read_json(manifest_key(key))
    except StorageError as exc:
        if required:
            raise CheckpointError(f"manifest of {label} is damaged: {exc}") from None
        log.warning("%s: ignoring %s, which is not a manifest (%s)", label, manifest_key(key), exc)
        return None
    if m is None:
        if required:
            raise CheckpointError(f"{label}: no manifest, so the checkpoint is incomplete or absent")
        return None
    if not isinstance(m, dict) or ("digest" not in m and "sha256" not in m):  # sha256: from before BLAKE3
        if required:
            raise CheckpointError(f"manifest of {label} lacks a digest; delete it so the checkpoint is rewritten")
        log.warning("%s: ignoring %s, which is not a manifest (no digest)", label, manifest_key(key))
        return None
    return check_manifest(m, label, key)  # every field validated before use (core.checkpoint)


class TensorFile:
    """One safetensors file: parsed header, positional reads into buffers, optional digest check."""

    in_memory = False  # reads fill the caller's buffer (merge.memory's files hand out views instead)

    def __init__(self, storage: Storage, key: str, label: str, manifest: dict[str, Any] | None,
                 io: str = "auto") -> None:
        if (problem := directio.mode_problem(io)) is not None:
            raise ValueError(problem)
        self.storage, self.key, self.label, self.manifest = storage, key, label, manifest
        self._fd: int | None = None
        self._dfd: int | None = None  # O_DIRECT descriptor for the data, when chosen (merge.directio)
        self._dfd_open: int | None = None  # the same, still open after a failed O_DIRECT read (closed by close())
        self.way = "buffered"  # how the data was chosen to be read at open (merge.directio.read_way; `direct`: still O_DIRECT)
        self._dropped = 0  # with `dropbehind`: the file's pages before this offset are dropped from the cache
        self._f: Any = None
        local = storage.local_path(key)
        try:
            if local is not None:
                self._fd = os.open(local, os.O_RDONLY)
                actual = os.fstat(self._fd).st_size
            else:
                self._f = storage.open_read(key)
                actual = storage.size(key)
        except FileNotFoundError:
            self.close()
            raise CheckpointError(f"{label}: no such file") from None
        except OSError as exc:
            self.close()
            raise CheckpointError(f"{label}: cannot be opened ({exc}); check the path and its permissions") from None
        self._sha = new_hasher(manifest) if manifest is not None else None
        self._pos = 0  # bytes hashed so far: always a prefix of the file
        try:
            self.metadata, self.specs, self.data_start = self._read_header(actual)
        except BaseException:
            self.close()
            raise
        self.size = self.data_start + max((s.end for s in self.specs.values()), default=0)
        if actual < self.size:
            self.close()
            raise CheckpointError(f"{label}: file is truncated: its header describes {self.size} bytes, the file has "
                                  f"{actual}; copy or download it again")
        if actual > self.size:
            self.close()
            raise CheckpointError(f"{label}: file has {actual - self.size} bytes after the last tensor: damaged or "
                                  "not a safetensors file; copy or download it again")
        if self._fd is not None:
            self.way = directio.read_way(io, self._fd, self.data_start, self.size)
            if self.way == "direct":
                self._dfd = self._dfd_open = directio.open_direct(local)
                self.way = "direct" if self._dfd is not None else "buffered"
            elif self.way == "dropbehind":
                directio.advise_dropbehind(self._fd)
                self._dropped = self.data_start  # the header was read first

    @property
    def direct(self) -> bool:
        return self._dfd is not None

    @property
    def streams(self) -> bool:
        """Read through the kernel's read-ahead and dropped behind: the kernel keeps the reads in
        flight, so one reader suffices, reading in file order with `read_hashing` (merge.lanes)."""
        return self.way == "dropbehind"

    def done_with(self, offset: int, n: int) -> None:
        """The n bytes at `offset` are read and hashed: with `dropbehind`, drop them from the page
        cache, with everything before them while reads go in file order (merge.directio.drop_behind)."""
        if not self.streams:
            return
        in_order = offset - self._dropped < directio.PAGE  # tensors follow one another (gaps are rare and small)
        directio.drop_behind(self._fd, 0 if in_order else offset, offset + n)
        if in_order:
            self._dropped = max(self._dropped, offset + n)

    def close(self) -> None:
        for fd in (self._fd, self._dfd_open):
            if fd is not None:
                os.close(fd)
        self._fd = self._dfd = self._dfd_open = None
        if self._f is not None:
            self._f.close()
            self._f = None

    def _read_header(self, actual: int) -> tuple[dict[str, str], dict[str, TensorSpec], int]:
        if actual < 8:
            raise CheckpointError(f"{self.label}: file is truncated ({actual} bytes): not a whole safetensors file")
        (n,) = struct.unpack("<Q", self._read_bytes(0, 8))
        if n > _MAX_HEADER or 8 + n > actual:
            raise CheckpointError(f"{self.label}: header length {n} is implausible for a file of {actual} bytes: "
                                  "not a safetensors file, or truncated")
        try:
            header = json.loads(self._read_bytes(8, n))
            if not isinstance(header, dict):
                raise ValueError("not a JSON object")
        except (UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(f"{self.label}: safetensors header is not valid JSON ({exc}): the file is damaged") from None
        meta = header.pop("__metadata__", None) or {}
        specs = {}
        for name, e in header.items():
            try:
                spec = TensorSpec(name, e["dtype"], tuple(int(d) for d in e["shape"]), *map(int, e["data_offsets"]))
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.label}: header entry for tensor {name} is malformed") from None
            if spec.dtype not in TORCH_DTYPES:
                raise CheckpointError(f"{self.label}: tensor {name} has unsupported dtype {spec.dtype} "
                                      f"(supported: {', '.join(ITEMSIZE)})")
            if spec.nbytes != math.prod(spec.shape) * ITEMSIZE[spec.dtype] or spec.start < 0 or min(spec.shape, default=0) < 0:
                raise CheckpointError(f"{self.label}: header entry for tensor {name} is malformed: offsets "
                                      f"{spec.start}..{spec.end} do not hold {spec.dtype}{list(spec.shape)}")
            specs[name] = spec
        ordered = dict(sorted(specs.items(), key=lambda kv: kv[1].start))
        return meta, ordered, 8 + n

    def _read_bytes(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        self.read_into(offset, memoryview(buf))
        return bytes(buf)

    def read_tensor(self, offset: int, n: int, region: torch.Tensor, itemsize: int = 1) -> torch.Tensor:
        """The n bytes at `offset`, read into `region` (a page-aligned uint8 tensor of at least
        directio.region_bytes(n)); returns the slice of it that holds them (hashed like read_into),
        starting at a multiple of `itemsize` so that it can be viewed as the tensor's dtype."""
        return self.complete(offset, n, self.fetch_tensor(offset, n, region, itemsize))

    def complete(self, offset: int, n: int, fetched: torch.Tensor) -> torch.Tensor:
        """read_tensor's second half, called in file order: the bytes `fetch_tensor` gave back,
        hashed (a streaming file's read here into the region it gave back, `read_hashing`), then
        dropped from the page cache (`done_with`); returns them."""
        if self.streams:
            out = self.read_hashing(offset, n, fetched)
        else:
            out = fetched
            self.hash_range(offset, out.numpy())
        self.done_with(offset, n)
        return out

    def read_hashing(self, offset: int, n: int, region: torch.Tensor) -> torch.Tensor:
        """The n bytes at `offset` read into `region` PIECE bytes at a time, each piece hashed as
        soon as it is read (if it continues the hashed prefix); returns the slice that holds them."""
        out = region[:n]
        view = memoryview(out.numpy())
        for o in range(0, n, PIECE):
            self.read_into(offset + o, view[o:o + PIECE])
        return out

    @property
    def positional(self) -> bool:
        """Reads are positional (pread on a local file): several threads may read it at once."""
        return self._fd is not None

    def fetch_tensor(self, offset: int, n: int, region: torch.Tensor, itemsize: int = 1) -> torch.Tensor:
        """read_tensor's first half, which may run out of file order (merge.lanes has several
        reads in flight): the bytes, not hashed; the caller passes them to `complete` in file
        order. A streaming file reads nothing here: `region` comes back for `complete` to fill."""
        if self.streams:
            return region
        dfd = self._dfd
        if dfd is not None and offset % itemsize == 0 and n >= directio.PAGE and region.data_ptr() % directio.PAGE == 0:
            start, end = directio.page_span(offset, n)
            try:
                self._pread(dfd, start, memoryview(region[: end - start].numpy()), offset + n - start)
            except OSError as exc:  # alignment refused after all (an unusual device): buffered from now on
                if self._dfd is not None:
                    log.warning("%s: O_DIRECT read failed (%s); reading through the page cache", self.label, exc)
                # not closed here: another reader thread may be using it (close() does)
                self._dfd = None
            else:
                return region[offset - start: offset - start + n]
        out = region[:n]
        self.read_into(offset, memoryview(out.numpy()), hash_it=False)
        return out

    def _pread(self, fd: int, offset: int, out: memoryview, need: int) -> None:
        """Read up to len(out) bytes at `offset` (O_DIRECT: whole pages); at least `need` must come."""
        got = 0
        while got < need:
            k = os.preadv(fd, [out[got:]], offset + got)
            if k <= 0:
                break
            got += k
        if got < need:
            raise CheckpointError(f"{self.label}: file is truncated (wanted {need} bytes at offset {offset}, got {got})")

    def hash_range(self, offset: int, data: Any) -> None:
        """Feed the digest the bytes at `offset`, if they continue the hashed prefix (the rest is
        hashed by verify())."""
        if self._sha is not None and offset == self._pos:
            self._sha.update(data)
            self._pos += len(data)

    def read_into(self, offset: int, out: memoryview, hash_it: bool = True) -> None:
        """Fill `out` with the file's bytes at `offset`; hash them if they continue the hashed prefix."""
        want, got = len(out), 0
        try:
            if self._fd is not None:
                self._pread(self._fd, offset, out, want)
                got = want
            else:
                self._f.seek(offset)
                while got < want:
                    n = self._f.readinto(out[got:])
                    if not n:
                        break
                    got += n
        except OSError as exc:
            raise CheckpointError(f"{self.label}: read failed at offset {offset} ({exc}); check the storage and retry") from None
        if got != want:
            raise CheckpointError(f"{self.label}: file is truncated (wanted {want} bytes at offset {offset}, got {got})")
        if hash_it:
            self.hash_range(offset, out)

    def verify(self) -> None:
        """Raise unless the whole file hashes to its manifest's digest (files without one: no check)."""
        if self.manifest is None or self._sha is None:
            return
        if self._pos < self.size:  # some ranges were read out of file order: hash the rest in one pass
            buf = memoryview(bytearray(min(_VERIFY_CHUNK, self.size - self._pos)))
            while self._pos < self.size:
                self.read_into(self._pos, buf[: min(len(buf), self.size - self._pos)])
        if self.manifest.get("bytes") not in (None, self.size):
            raise CheckpointError(f"{self.label}: size {self.size} differs from the manifest's {self.manifest['bytes']}: "
                                  "truncated or replaced")
        if self._sha.hexdigest() != self.manifest["digest"]:
            raise CheckpointError(f"{self.label}: checksum does not match the manifest: the file is corrupt; "
                                  "delete it and its .json so it is written again")


@dataclass
class Model:
    """One merge input: tensors by name, each in one of its files (1 file, or the shards of a directory)."""

    label: str
    ident: Any
    files: list[TensorFile]
    tensors: dict[str, tuple[TensorFile, TensorSpec]]
    storage: Storage | None = None
    directory: bool = False
    index: dict[str, Any] | None = None

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def close(self) -> None:
        for f in self.files:
            f.close()

    def verify(self) -> None:
        for f in self.files:
            f.verify()

    def layout(self) -> list[tuple[TensorFile, list[str]]]:
        """Files in order with their tensors in file order: the order a merge reads and writes."""
        return [(f, [n for n in f.specs if self.tensors[n][0] is f]) for f in self.files]


def split_url(url: str) -> tuple[str, str]:
    """('memory://a/b', 'c.safetensors') for 'memory://a/b/c.safetensors'."""
    proto, path = fsspec.core.split_protocol(url)
    path = path.rstrip("/")
    parent, name = posixpath.split(path)
    parent = parent or ("/" if path.startswith("/") else ".")
    return (f"{proto}://{parent}" if proto else parent), name


def open_file_model(storage: Storage, key: str, label: str, ident: Any = None, *, require_manifest: bool,
                    io: str = "auto") -> Model:
    """A model stored as one safetensors file at `key` of `storage` (`io`: merge.directio.IO_MODES)."""
    manifest = load_manifest(storage, key, require_manifest, label)
    f = TensorFile(storage, key, label, manifest, io)
    return Model(label, ident, [f], {n: (f, s) for n, s in f.specs.items()}, storage)


def open_model(url: str, ident: Any = None, label: str | None = None, io: str = "auto") -> Model:
    """Open a merge input by URL: a `.safetensors` file or a Hugging Face model directory."""
    label = label or url
    proto, path = fsspec.core.split_protocol(url)
    storage = Storage(url)
    try:
        is_dir = storage.fs.isdir(storage.root)
    except OSError as exc:
        raise CheckpointError(f"{label}: cannot be read ({exc}); check the URL and credentials") from None
    if not is_dir:
        if not storage.fs.exists(storage.root):
            raise CheckpointError(f"{label}: no such file or directory")
        parent, name = split_url(url)
        return open_file_model(Storage(parent), name, label, ident, require_manifest=False, io=io)
    names = storage.list("")
    if INDEX in names:
        index = storage.read_json(INDEX)
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise CheckpointError(f"{label}/{INDEX}: has no weight_map: not a Hugging Face safetensors index")
        shards = sorted(set(index["weight_map"].values()))
    elif SINGLE in names:
        index, shards = None, [SINGLE]
    else:
        found = [n for n in names if n.endswith(".safetensors")]
        if len(found) != 1:
            raise CheckpointError(f"{label}: a model directory needs {SINGLE} or {INDEX}; found "
                                  f"{found or 'no .safetensors files'}")
        index, shards = None, found
    files: list[TensorFile] = []
    try:
        for s in shards:
            flabel = f"{label.rstrip('/')}/{s}"
            files.append(TensorFile(storage, s, flabel, load_manifest(storage, s, False, flabel), io))
        tensors: dict[str, tuple[TensorFile, TensorSpec]] = {}
        for f in files:
            for n, spec in f.specs.items():
                if n in tensors:
                    raise CheckpointError(f"{label}: tensor {n} is in both {tensors[n][0].key} and {f.key}: "
                                          "the shards overlap; fix the model directory")
                tensors[n] = (f, spec)
        if index is not None:
            wm = index["weight_map"]
            wrong = [n for n, shard in wm.items() if n not in tensors or tensors[n][0].key != shard]
            unlisted = [n for n in tensors if n not in wm]
            if wrong or unlisted:
                raise CheckpointError(f"{label}/{INDEX} disagrees with the shards: tensors {wrong[:5]} are not where "
                                      f"the index says, {unlisted[:5]} are not in the index; re-save the model")
    except BaseException:
        for f in files:
            f.close()
        raise
    return Model(label, ident, files, tensors, storage, directory=True, index=index)
