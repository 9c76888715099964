"""The training text: a corpus of tokens, held-out split, per-worker shards and samplers.

The built-in corpus is the Python standard library's own source, so every machine that can run
this project also has its data, with no download. Tokens are raw bytes (vocab 256, uint8), or,
for a Hugging Face model (model.hf), the ids of its own tokenizer (int32; worker/hf.py).

Layout of `Corpus.tokens`: every document's tokens, each followed by one separator (b"\\n" for
bytes, the tokenizer's end-of-text token otherwise). A document's slice [start, end) excludes its
separator, so `tokens[start:end]` is exactly the file, tokenized.

Everything a worker sees is a pure function of (corpus, seed, worker, step): a job that is killed
and requeued, or started fresh next round, reads exactly the batches it would have read.
"""

from __future__ import annotations

import array
import hashlib
import json
import logging
import os
import random
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from core.layout import local_cache_root
from core.progress import progress
from worker.corpus_cache import FORMAT_VERSION, load_cache, save_cache

if TYPE_CHECKING:
    from core.config import Config

logger = logging.getLogger(__name__)

SHARD_MODES = ("iid", "non-iid")
_SEPARATOR = b"\n"
_ENCODE_BATCH = 64  # documents handed to the tokenizer at once
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


@dataclass(frozen=True)
class Document:
    name: str  # path relative to the source root, '/'-separated
    group: str  # first path component, or '_toplevel' for a file directly under the root
    start: int  # slice of Corpus.tokens, separator excluded
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


# eq=False: a generated __eq__ would compare tensors, which has no single truth value
@dataclass(frozen=True, eq=False)
class Corpus:
    tokens: torch.Tensor  # 1-D uint8, documents concatenated, each followed by one b"\n"
    documents: tuple[Document, ...]
    fingerprint: str  # sha256 hex of format version + source + file list (path, size, mtime_ns) + tokenizer


class Tokenizer(Protocol):
    """What the corpus needs of a tokenizer other than raw bytes (worker.hf.HFTokenizer)."""

    name: str
    """Identifies the vocabulary and the tokenization: part of the corpus cache key."""
    separator: int
    """The token placed after every document."""

    def encode(self, texts: list[str]) -> list[list[int]]: ...


def corpus_for(cfg: Config, cache_dir: str | os.PathLike | None = None) -> Corpus:
    """The corpus a run trains and evaluates on: its data.* keys, tokenized for its model."""
    tokenizer = None
    if cfg.model.hf is not None:
        from worker.hf import load_tokenizer  # transformers only when a Hugging Face model is used
        tokenizer = load_tokenizer(cfg.model.hf)
    return load_corpus(cfg.data.source, include_tests=cfg.data.include_tests,
                       cache_dir=cache_dir or cfg.data.cache_dir, tokenizer=tokenizer)


# ----------------------------------------------------------------------------- loading and cache


def _read_bytes(path: Path) -> bytes:
    # the one place that reads source files, so tests can prove a warm load never calls it
    return path.read_bytes()


def _group_of(rel: str) -> str:
    parts = rel.split("/")
    return parts[0] if len(parts) > 1 else "_toplevel"


def _walk(root: Path, keep_dir: Callable[[str], bool], keep_file: Callable[[str], bool]) -> list[tuple[str, Path, int, int]]:
    """[(relative '/' path, path, size, mtime_ns)] of regular files under root, unsorted.

    os.scandir hands back each entry's stat with the listing, so a warm start (fingerprint only,
    no content read) costs one directory walk: it runs at the start of every worker round."""
    out, stack = [], [(root, "")]
    while stack:
        directory, prefix = stack.pop()
        with os.scandir(directory) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):  # as os.walk: no symlink loops
                    if keep_dir(e.name):
                        stack.append((Path(e.path), f"{prefix}{e.name}/"))
                elif keep_file(e.name) and e.is_file(follow_symlinks=True):
                    st = e.stat(follow_symlinks=True)
                    out.append((prefix + e.name, Path(e.path), st.st_size, st.st_mtime_ns))
    return out


def _list_files(source: str | None, include_tests: bool) -> tuple[Path, list[tuple[str, Path, int, int]]]:
    """(root, sorted [(relative '/' path, absolute path, size, mtime_ns)]) without reading any content."""
    if source is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        skip = _STDLIB_SKIP_DIRS | (frozenset() if include_tests else _TEST_DIRS)
        return root, sorted(_walk(root, lambda d: d not in skip, lambda f: f.endswith(".py")))
    path = Path(source).expanduser().resolve()
    if path.is_file():
        st = path.stat()
        return path.parent, [(path.name, path, st.st_size, st.st_mtime_ns)]
    if not path.is_dir():
        raise ValueError(
            f"Corpus source {source!r} does not exist (resolved to {path}); pass an existing "
            "text file or directory, or no source to use the Python standard library."
        )
    # hidden entries (.git, .venv, editor files) are tooling, not text to learn from
    visible = lambda name: not name.startswith(".")  # noqa: E731
    return path, sorted(_walk(path, visible, visible))


def _fingerprint(root: Path, source: str | None, include_tests: bool,
                 files: list[tuple[str, Path, int, int]], tokenizer: Tokenizer | None = None) -> str:
    h = hashlib.sha256()
    head = {"format": FORMAT_VERSION, "root": str(root), "stdlib": source is None,
            "include_tests": include_tests}
    if tokenizer is not None:  # absent for bytes: their fingerprints (and caches) stay as they were
        head["tokenizer"] = tokenizer.name
    h.update(json.dumps(head, sort_keys=True).encode())
    for rel, _, size, mtime_ns in files:
        h.update(json.dumps([rel, size, mtime_ns]).encode() + b"\n")
    return h.hexdigest()


def _build(root: Path, files: list[tuple[str, Path, int, int]], fingerprint: str,
           tokenizer: Tokenizer | None = None) -> Corpus:
    chunks, documents, offset, skipped = [], [], 0, []
    sep = _SEPARATOR if tokenizer is None else [tokenizer.separator]
    with progress(len(files), f"preparing the corpus of {root}", unit="files") as bar:
        for i in range(0, len(files), _ENCODE_BATCH):
            texts = []
            for rel, path, _, _ in files[i:i + _ENCODE_BATCH]:
                data = _read_bytes(path)
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError:
                    skipped.append(rel)
                    continue
                if data:  # an empty file adds nothing but a lone separator
                    texts.append((rel, data, text))
            ids = [d for _, d, _ in texts] if tokenizer is None else tokenizer.encode([t for *_, t in texts])
            for (rel, _, _), toks in zip(texts, ids):
                documents.append(Document(rel, _group_of(rel), offset, offset + len(toks)))
                chunks += [toks, sep]
                offset += len(toks) + len(sep)
            bar.advance(len(files[i:i + _ENCODE_BATCH]))
    if skipped:
        logger.warning("skipped %d file(s) under %s that are not UTF-8 text: %s%s", len(skipped),
                       root, ", ".join(skipped[:5]), " ..." if len(skipped) > 5 else "")
    if not documents:
        raise ValueError(
            f"Corpus source {root} has no usable files ({len(files)} listed, {len(skipped)} not "
            "UTF-8, the rest empty); point the source at a directory of non-empty text files."
        )
    if tokenizer is None:
        tokens = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    else:  # ids past 255: 4 bytes each (array "i" is a C int, 32 bits on every platform torch runs on)
        ids32 = array.array("i")
        for chunk in chunks:
            ids32.extend(chunk)
        tokens = torch.frombuffer(ids32, dtype=torch.int32) if ids32 else torch.empty(0, dtype=torch.int32)
    return Corpus(tokens, tuple(documents), fingerprint)


def load_corpus(
    source: str | None = None,
    *,
    include_tests: bool = False,
    cache_dir: str | os.PathLike | None = None,
    tokenizer: Tokenizer | None = None,
) -> Corpus:
    """Load a corpus of bytes (or of `tokenizer`'s ids), preparing it once and caching it under
    cache_dir/data/<fingerprint>/.

    source None is the standard library's *.py files (tests excluded unless include_tests);
    otherwise a text file or a directory of text files (hidden entries and non-UTF-8 files skipped).
    The fingerprint covers file names, sizes and mtimes, so an edited source gets a fresh cache
    and an unchanged one is reused without reading any file content. The tokenizer's name is part
    of the fingerprint: byte-level and tokenizer caches never mix.
    """
    root, files = _list_files(source, include_tests)
    if not files:
        raise ValueError(f"Corpus source {root} has no files to read; point the source at a "
                         "directory that contains text files.")
    fingerprint = _fingerprint(root, source, include_tests, files, tokenizer)
    directory = Path(cache_dir or local_cache_root()) / "data" / fingerprint
    if (directory / "index.json").exists():
        try:
            tokens, docs = load_cache(directory, fingerprint, torch.uint8 if tokenizer is None else torch.int32)
            corpus = Corpus(tokens, tuple(Document(n, g, int(s), int(e)) for n, g, s, e in docs), fingerprint)
            logger.info("corpus %s loaded from cache %s", fingerprint[:12], directory)
            return corpus
        except Exception as e:  # any unreadable cache is rebuilt: it is derived data
            logger.warning("corpus cache %s is unreadable (%s: %s); rebuilding it from %s",
                           directory, type(e).__name__, e, root)
    corpus = _build(root, files, fingerprint, tokenizer)
    save_cache(corpus, directory, tokenizer.name if tokenizer is not None else None)
    logger.info("corpus %s prepared from %s: %d documents, %d tokens, cached in %s",
                fingerprint[:12], root, len(corpus.documents), corpus.tokens.numel(), directory)
    return corpus


# ----------------------------------------------------------------------------- splits and shards


def _unit_hash(*parts: object) -> float:
    """A stable uniform number in [0, 1) from its parts (Python's hash() is salted per process)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_heldout(corpus: Corpus, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train doc indices, eval doc indices). Each document is decided by a hash of (seed, name)
    alone, so adding or removing files never moves the others across the split."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"split_heldout needs 0 < fraction < 1, got {fraction}; "
                         "e.g. 0.05 holds out about 5% of the documents.")
    u = [_unit_hash(seed, d.name) for d in corpus.documents]
    eval_ids = {i for i, x in enumerate(u) if x < fraction}
    if len(u) >= 2 and not eval_ids:  # too few docs for the fraction: hold out the likeliest one
        eval_ids = {min(range(len(u)), key=u.__getitem__)}
    if len(u) >= 2 and len(eval_ids) == len(u):
        eval_ids.discard(max(range(len(u)), key=u.__getitem__))
    train_ids = [i for i in range(len(u)) if i not in eval_ids]
    return train_ids, sorted(eval_ids)


def _deal(items: list[tuple[int, list[int]]], num_workers: int) -> list[list[int]]:
    """Give each (size, doc ids) item to the worker with the fewest bytes so far (then fewest
    items, then lowest index, so zero-byte items still reach every worker)."""
    load = [(0, 0)] * num_workers
    shards: list[list[int]] = [[] for _ in range(num_workers)]
    for size, ids in items:
        w = min(range(num_workers), key=lambda i: (load[i], i))
        load[w] = (load[w][0] + size, load[w][1] + 1)
        shards[w] += ids
    return [sorted(s) for s in shards]


def shard(
    corpus: Corpus, doc_ids: Sequence[int], num_workers: int, mode: str, seed: int
) -> list[list[int]]:
    """Partition doc_ids into num_workers shards of sorted doc indices.

    iid: shuffled documents dealt greedily by bytes, so every worker sees a balanced random mix.
    non-iid: whole groups (packages) dealt largest first, so workers see different distributions.
    """
    if mode not in SHARD_MODES:
        raise ValueError(f"Unknown shard mode {mode!r}; valid modes are {', '.join(SHARD_MODES)}.")
    if num_workers < 1:
        raise ValueError(f"shard needs num_workers >= 1, got {num_workers}.")
    ids = list(doc_ids)
    if len(set(ids)) != len(ids) or any(not 0 <= i < len(corpus.documents) for i in ids):
        raise ValueError(f"shard got doc_ids with duplicates or outside 0.."
                         f"{len(corpus.documents) - 1}; pass indices from split_heldout.")
    docs = corpus.documents
    if mode == "iid":
        if len(ids) < num_workers:
            raise ValueError(f"Cannot shard {len(ids)} documents over {num_workers} workers (iid); "
                             "use fewer workers or a larger corpus.")
        random.Random(seed).shuffle(ids)
        return _deal([(docs[i].size, [i]) for i in ids], num_workers)
    groups: dict[str, list[int]] = {}
    for i in ids:
        groups.setdefault(docs[i].group, []).append(i)
    if len(groups) < num_workers:
        raise ValueError(f"Cannot shard {len(groups)} groups over {num_workers} workers "
                         "(non-iid): each worker needs at least one whole group; use fewer "
                         "workers or mode 'iid'.")
    sized = [(sum(docs[i].size for i in g), name, g) for name, g in groups.items()]
    sized.sort(key=lambda t: (-t[0], t[1]))
    return _deal([(size, g) for size, _, g in sized], num_workers)


# ----------------------------------------------------------------------------- batches


def _stream(corpus: Corpus, doc_ids: Sequence[int]) -> torch.Tensor:
    """The docs' tokens concatenated, each with its separator, in the corpus's compact dtype."""
    parts = [corpus.tokens[d.start : d.end + 1] for d in (corpus.documents[i] for i in doc_ids)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=corpus.tokens.dtype)


def _windows(
    stream: torch.Tensor, starts: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    chunk = stream[starts[:, None] + torch.arange(block_size + 1)].long()
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def _check_stream(stream: torch.Tensor, block_size: int, what: str) -> None:
    if stream.numel() < block_size + 1:
        raise ValueError(f"{what} has {stream.numel()} tokens, fewer than block_size + 1 = "
                         f"{block_size + 1}; give it more documents or use a smaller block_size.")


class BatchSampler:
    """Random windows over one worker's shard; batch(step) depends only on (seed, worker, step)."""

    def __init__(self, corpus: Corpus, doc_ids: Sequence[int], block_size: int,
                 batch_size: int, seed: int, worker: int):
        if block_size < 1 or batch_size < 1:
            raise ValueError(f"BatchSampler needs block_size >= 1 and batch_size >= 1, got "
                             f"{block_size} and {batch_size}.")
        self.stream = _stream(corpus, doc_ids)
        what = f"Worker {worker}'s shard ({len(doc_ids)} documents)"
        _check_stream(self.stream, block_size, what)
        self.block_size, self.batch_size = block_size, batch_size
        self.seed, self.worker = seed, worker

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.block_size

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y of shape (batch_size, block_size), int64, y[:, t] = x[:, t + 1] in the stream."""
        if step < 0:
            raise ValueError(f"BatchSampler.batch needs step >= 0, got {step}.")
        # a fresh generator per step, instead of one advancing generator, is what makes a
        # resumed worker's batches identical without saving any sampler state
        g = torch.Generator().manual_seed(int(_unit_hash(self.seed, self.worker, step) * 2**63))
        high = self.stream.numel() - self.block_size
        starts = torch.randint(0, high, (self.batch_size,), generator=g)
        return _windows(self.stream, starts, self.block_size)


def eval_batches(corpus: Corpus, doc_ids: Sequence[int], block_size: int, batch_size: int,
                 num_batches: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed held-out batches: num_batches * batch_size windows evenly spaced over the eval
    stream. The seed only deals windows to batches, so each batch is a cross-section of all
    eval documents rather than one package, while the set of windows stays the same."""
    if block_size < 1 or batch_size < 1 or num_batches < 1:
        raise ValueError(f"eval_batches needs block_size, batch_size and num_batches >= 1, got "
                         f"{block_size}, {batch_size} and {num_batches}.")
    stream = _stream(corpus, doc_ids)
    _check_stream(stream, block_size, f"The eval set ({len(doc_ids)} documents)")
    n = batch_size * num_batches
    starts = torch.linspace(0, stream.numel() - block_size - 1, n).round().long()
    order = list(range(n))
    random.Random(seed).shuffle(order)
    starts = starts[torch.tensor(order)]
    return [_windows(stream, starts[b * batch_size : (b + 1) * batch_size], block_size)
            for b in range(num_batches)]


def estimate_loss(
    model: torch.nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> float:
    """Mean loss over batches in eval mode without gradients; the caller's mode is restored."""
    if not batches:
        raise ValueError("estimate_loss got no batches; build them with eval_batches "
                         "(num_batches >= 1).")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            losses = [model(x.to(device), y.to(device))[1].item() for x, y in batches]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)
