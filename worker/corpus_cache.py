"""The prepared-corpus cache on local disk: tokens.safetensors, then index.json (the manifest).

A cache directory is named by the corpus fingerprint (worker/data.py), which covers the source
files and the tokenizer, so a byte-level corpus and a Hugging Face tokenizer's corpus of the same
files never share one. Everything here is derived data: an unreadable cache is rebuilt.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from core.checkpoint import TensorFile, write_checkpoint
from core.storage import Storage

if TYPE_CHECKING:
    from worker.data import Corpus

# Bump when the token layout or index.json changes: old caches then simply stop matching.
FORMAT_VERSION = "islands-corpus-v2"  # v2: index.json records the tokens file size and mtime
TOKEN_DTYPES = {"uint8": torch.uint8, "int32": torch.int32}
"""Token dtypes a cache may hold: bytes (vocab 256), or a tokenizer's ids (any vocabulary < 2**31)."""


def tokens_sha256(tokens: torch.Tensor) -> str:
    return hashlib.sha256(tokens.numpy().tobytes()).hexdigest()


def _storage(directory: Path) -> Storage:
    return Storage(str(directory), follow_links=True)  # the user's cache folder, wherever it links


def save_cache(corpus: Corpus, directory: Path, tokenizer: str | None) -> None:
    """Written through the storage's atomic writes: readers see the old state or the whole new file."""
    storage = _storage(directory)
    write_checkpoint(storage, "tokens.safetensors", {"tokens": corpus.tokens})
    st = (directory / "tokens.safetensors").stat()
    index = {
        "format": FORMAT_VERSION,
        "fingerprint": corpus.fingerprint,
        "tokenizer": tokenizer,
        "num_tokens": int(corpus.tokens.numel()),
        "tokens_sha256": tokens_sha256(corpus.tokens),
        "tokens_file": [st.st_size, st.st_mtime_ns],
        "documents": [[d.name, d.group, d.start, d.end] for d in corpus.documents],
    }
    # index.json is written last and is the manifest: without it the tokens are not trusted
    storage.write_bytes("index.json", json.dumps(index, separators=(",", ":")).encode())


def load_cache(directory: Path, fingerprint: str, dtype: torch.dtype) -> tuple[torch.Tensor, list[list]]:
    """(tokens, [[name, group, start, end], ...]) of a cache written by save_cache, checked."""
    index = json.loads((directory / "index.json").read_text())
    with TensorFile(_storage(directory), "tokens.safetensors") as f:
        tokens = f.read("tokens")
    if index.get("format") != FORMAT_VERSION or index.get("fingerprint") != fingerprint:
        raise ValueError("index.json belongs to another corpus format or fingerprint")
    if tokens.dtype != dtype or tokens.dim() != 1 or tokens.numel() != index["num_tokens"]:
        raise ValueError(f"tokens tensor is {tokens.dtype} {tuple(tokens.shape)}, "
                         f"expected {dtype} ({index['num_tokens']},)")
    # Hashing the tokens costs more than the rest of a warm start; every worker round starts
    # warm, so the hash is checked only when the file is not the one index.json was written for.
    st = (directory / "tokens.safetensors").stat()
    if index.get("tokens_file") != [st.st_size, st.st_mtime_ns] and tokens_sha256(tokens) != index["tokens_sha256"]:
        raise ValueError("tokens checksum does not match index.json")
    return tokens, index["documents"]
