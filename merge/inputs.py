"""A merge's inputs: one safetensors file, or a Hugging Face model directory, read through the one
reader of the format (core.checkpoint.TensorFile).

A directory holds `model.safetensors`, or the shards that `model.safetensors.index.json` lists. An
index comes from the user's disk or a download, so it is checked like any other file: its shard
names must be plain file names inside the directory (no folders, no `..`, no absolute paths) and
it must agree with the shards' headers. A checkpoint of ours has a manifest beside it, and its
digest is checked as the merge streams it; plain files from elsewhere have nothing to check.
"""
from __future__ import annotations

import math
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
import torch

from core.checkpoint import TensorFile, TensorSpec
from core.errors import CheckpointError, StorageError
from core.manifest import read_manifest
from core.storage import Storage

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_INDEX_BYTES = 64 << 20
_SHARD = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}\.safetensors")


class InputError(CheckpointError):
    """One input of a merge is unusable; `ident` says which (a worker id, an input index)."""

    def __init__(self, ident: Any, message: str) -> None:
        super().__init__(message)
        self.ident = ident
        self.reason = message


def finite(t: torch.Tensor) -> bool:
    """All values finite? One sum first (cheap; NaN and Inf propagate), the exact test only if it is not."""
    return not t.numel() or math.isfinite(float(t.sum(dtype=torch.float32))) or bool(torch.isfinite(t).all())


NONFINITE = "tensor {name} has NaN or Inf values: the model diverged or the file is damaged; leave it out of the merge"
"""Why an input holding a NaN or Inf is refused: the one message for it."""


def nonfinite(label: str, name: str) -> str:
    return f"{label}: {NONFINITE.format(name=name)}"


def overflowed(name: str, how: str, fix: str) -> str:
    """Why a merge whose result is not finite, from finite inputs, fails: `how` it merged, what to `fix`."""
    return f"merged tensor {name} has NaN or Inf values although every input is finite: the {how} overflowed; {fix}"


def refusal(label: str, exc: BaseException) -> str:
    """The reason a contribution is refused: a CheckpointError's own message (it names the file
    and tensor), anything else named with `label`. Whatever one contribution does, it is one
    rejection, never the round's failure."""
    return str(exc) if isinstance(exc, CheckpointError) else f"{label}: {type(exc).__name__}: {exc}"


@dataclass
class Model:
    """One merge input: tensors by name, each in one of its files (1 file, or a directory's shards)."""

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

    @property
    def specs(self) -> dict[str, TensorSpec]:
        return {n: spec for n, (_, spec) in self.tensors.items()}

    def close(self) -> None:
        for f in self.files:
            f.close()

    def verify(self) -> None:
        for f in self.files:
            f.verify()

    def layout(self) -> list[tuple[TensorFile, list[str]]]:
        """Files in order with their tensors in file order: the order a merge reads and writes."""
        return [(f, [n for n in f.specs if self.tensors[n][0] is f]) for f in self.files]


def compare_specs(ref: Mapping[str, TensorSpec], other: Mapping[str, TensorSpec], ref_name: str) -> list[str]:
    """Every reason `other` cannot be merged with `ref` (names, shapes, dtypes); [] if it can."""
    missing = [n for n in ref if n not in other]
    extra = [n for n in other if n not in ref]
    problems = []
    if missing or extra:
        problems.append(f"tensor names differ from {ref_name}: missing {missing[:5]}, unexpected {extra[:5]}"
                        + (f" ({len(missing)} missing, {len(extra)} unexpected in all)" if len(missing) > 5 or len(extra) > 5 else ""))
    for name, spec in ref.items():
        o = other.get(name)
        if o is not None and (o.shape != spec.shape or o.dtype != spec.dtype):
            problems.append(f"tensor {name} is {o.dtype}{list(o.shape)}, {ref_name} has {spec.dtype}{list(spec.shape)}")
    return problems


def split_url(url: str) -> tuple[str, str]:
    """('memory://a/b', 'c.safetensors') for 'memory://a/b/c.safetensors'."""
    proto, path = fsspec.core.split_protocol(url)
    path = path.rstrip("/")
    parent, name = posixpath.split(path)
    parent = parent or ("/" if path.startswith("/") else ".")
    return (f"{proto}://{parent}" if proto else parent), name


def open_file_model(storage: Storage, key: str, label: str, ident: Any = None, *, require_manifest: bool) -> Model:
    """A model stored as one safetensors file at `key` of `storage`: a checkpoint of a run
    (`require_manifest`) or a file from elsewhere, whose manifest is checked if it has one."""
    manifest = read_manifest(storage, key, label, plain=not require_manifest)
    if manifest is None and require_manifest:
        raise CheckpointError(f"{label}: no manifest, so the checkpoint is incomplete or absent")
    f = TensorFile(storage, key, manifest, label)
    return Model(label, ident, [f], {n: (f, s) for n, s in f.specs.items()}, storage)


def open_model(url: str, ident: Any = None, label: str | None = None) -> Model:
    """Open an input a person named: a `.safetensors` file or a Hugging Face model directory. Links
    are followed (a Hugging Face cache links its snapshots to blobs); FIFOs and devices are not read."""
    label = label or url
    storage = Storage(url, follow_links=True)
    try:
        kind = storage.kind()
        is_dir, exists = kind == "directory", kind is not None
    except OSError as exc:
        raise CheckpointError(f"{label}: cannot be read ({exc}); check the URL and credentials") from None
    if not exists:
        raise CheckpointError(f"{label}: no such file or directory")
    if not is_dir:
        parent, name = split_url(url)
        if not name.endswith(".safetensors"):
            raise CheckpointError(f"{label}: not a .safetensors file nor a model directory; merge .safetensors files, "
                                  "Hugging Face model directories or PEFT adapter directories")
        return open_file_model(Storage(parent, follow_links=True), name, label, ident, require_manifest=False)
    index, shards = _shards(storage, label)
    files: list[TensorFile] = []
    try:
        for s in shards:
            flabel = f"{label.rstrip('/')}/{s}"
            files.append(TensorFile(storage, s, read_manifest(storage, s, flabel, plain=True), flabel))
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


def _shards(storage: Storage, label: str) -> tuple[dict[str, Any] | None, list[str]]:
    """(the index, or None; the shard files to read) of a model directory."""
    names = storage.list("")
    if INDEX in names:
        try:
            index = storage.read_json(INDEX, limit=MAX_INDEX_BYTES)
        except (StorageError, CheckpointError) as exc:
            raise CheckpointError(f"{label}/{INDEX}: {exc}") from None
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(n, str) and isinstance(s, str) for n, s in wm.items()):
            raise CheckpointError(f"{label}/{INDEX}: has no weight_map of tensor names to shard files: not a Hugging "
                                  "Face safetensors index")
        if not isinstance(index.get("metadata", {}), dict):  # the merge's own index is written from it
            raise CheckpointError(f"{label}/{INDEX}: its metadata is not a JSON object: not a Hugging Face "
                                  "safetensors index; fix or delete that field")
        bad = sorted({s for s in wm.values() if not _SHARD.fullmatch(s)})
        if bad:
            raise CheckpointError(f"{label}/{INDEX} names shards {[b[:80] for b in bad[:3]]} that are not plain "
                                  ".safetensors file names in the model directory (no folders, no '..', no absolute "
                                  "paths): refused; fix the index")
        return index, sorted(set(wm.values()))
    if SINGLE in names:
        return None, [SINGLE]
    found = [n for n in names if n.endswith(".safetensors")]
    if len(found) != 1:
        raise CheckpointError(f"{label}: a model directory needs {SINGLE} or {INDEX}; found "
                              f"{found or 'no .safetensors files'}")
    return None, found
