"""The training data: a prepared dataset (core/dataset.py) read in place, per-worker shards, batches.

`data.source` is a prepared dataset (a folder with index.json, any fsspec URL, made by `orchestrate
data prepare`), or text files on this machine: null is the Python standard library's own source, so
every machine that runs this project has its data. Text is prepared once into the local cache
(cache_dir/data/<fingerprint>/, a dataset like any other) and read from there.

A worker never holds the corpus: it reads a window at a time, by position from a shard on a
filesystem (local or network), by a range request on an object store. Its share of the train split is a set of segments (16 windows
long) of the train shards: iid, every K-th segment of a seeded permutation of them all; non-iid,
the segments of whole groups (a text file's top folder, or the --group-field value), dealt
largest first. Everything a worker sees is a pure function of (dataset, seed, worker, step): a job
that is killed and requeued, or started fresh next round, reads exactly the batches it would have
read. The eval set is the dataset's held-out split.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import stat
import sysconfig
from dataclasses import dataclass
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from core import dataset as fmt
from core.dataset import DatasetError, Index, Shard
from core.errors import CheckpointError, StorageError
from core.layout import local_cache_root
from core.storage import Storage
from core.records import text
from core.trust import stranger
from worker.prepare import PrepareSpec, load_tokenizer, prepare, unit_hash
from worker.sources import Unit, is_records

if TYPE_CHECKING:
    from core.config import Config

logger = logging.getLogger(__name__)

SHARD_MODES = ("iid", "non-iid")
SEGMENT_WINDOWS = 16
"""A worker's share is dealt in segments of this many windows (block_size + 1 tokens each)."""
_TEXT_CACHE_FORMAT = "islands-text-cache-v1"
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_OPEN_FILES = 64


class Dataset:
    """A prepared dataset, opened: its checked index and windows read from its shards."""

    def __init__(self, url: str, check_sizes: bool = True) -> None:
        # the folder the user names, wherever it links; nothing inside it through a link, regular files only
        self.storage = Storage(_resolved(url))
        try:
            obj = self.storage.read_json(fmt.INDEX, limit=fmt.INDEX_LIMIT)
        except (CheckpointError, StorageError) as exc:  # a link, a FIFO, not JSON: never opened past that
            raise DatasetError(f"{self.storage.display(fmt.INDEX)} cannot be read as a dataset index: {exc}. Restore it, "
                               f"or prepare the dataset again (orchestrate data prepare SOURCE... --out {url})") from None
        if obj is None:
            raise DatasetError(f"{self.storage.display()} is not a prepared dataset (no {fmt.INDEX}); prepare it with "
                               f"`orchestrate data prepare SOURCE... --out {url}`")
        self.index: Index = fmt.parse_index(obj, self.storage.display())
        self.dtype = np.dtype(self.index.dtype).newbyteorder("<")
        self._fds: dict[str, int] = {}
        if check_sizes:
            self._check_sizes()

    @property
    def vocab_size(self) -> int:
        return self.index.tokenizer.vocab_size

    @property
    def url(self) -> str:
        return self.storage.display()

    def _check_sizes(self) -> None:
        bad = fmt.size_problems(self.index.shards, self.index.width, fmt.listed_sizes(self.storage))
        if bad:
            raise DatasetError(f"{self.url} does not match its index ({len(bad)} file(s)): " + "; ".join(bad[:5])
                               + ". Prepare it again, or restore the files")

    def _fd(self, key: str) -> int:
        if key not in self._fds:
            if len(self._fds) >= _OPEN_FILES:
                os.close(self._fds.pop(next(iter(self._fds))))
            try:  # a regular file inside the dataset, never a link or a FIFO (which would block): core.storage
                self._fds[key] = self.storage.open_fd(key)
            except (CheckpointError, OSError) as exc:
                raise DatasetError(f"{self.url}: shard file {key} cannot be read ({exc}); prepare the dataset again, "
                                   "or restore the file") from None
        return self._fds[key]

    def _read(self, picks: Sequence[tuple[str, int, int]], dtype: np.dtype) -> list[np.ndarray]:
        """The [start, end) element ranges of files, each a separate array: positional reads of a local
        (or network) file, range requests to an object store. Not a memory map: its read-ahead put every
        page it touched into the worker's resident memory, which then grew with the steps taken."""
        w = dtype.itemsize
        if self.storage.is_local:
            return [np.frombuffer(os.pread(self._fd(key), (b - a) * w, a * w), dtype=dtype) for key, a, b in picks]
        blobs = self.storage.read_ranges([(key, a * w, b * w) for key, a, b in picks])
        return [np.frombuffer(b, dtype=dtype) for b in blobs]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def windows(self, picks: Sequence[tuple[Shard, int]], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y of shape (len(picks), block_size), int64, from `block_size + 1` tokens at each (shard, start):
        y[:, t] is the token after x[:, t], or -1 where fine-tuning data does not count its loss."""
        ranges = [(s.key, a, a + block_size + 1) for s, a in picks]
        tokens = self._read(ranges, self.dtype)
        if any(len(t) != block_size + 1 for t in tokens):
            raise DatasetError(f"{self.url}: a shard is shorter than its index says; prepare it again")
        chunk = torch.from_numpy(np.stack(tokens).astype(np.int64))
        if chunk.numel() and int(chunk.max()) >= self.vocab_size:  # one max a batch: an id past the vocabulary
            self._bad_ids(picks, tokens)
        x, y = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
        if self.index.masked:
            masks = self._read([(s.mask_key, a + 1, a + block_size + 1) for s, a in picks], np.dtype(np.uint8))
            y[torch.from_numpy(np.stack(masks) == 0)] = -1
        return x, y

    def _bad_ids(self, picks: Sequence[tuple[Shard, int]], tokens: list[np.ndarray]) -> None:
        """DatasetError naming the first window's shard and offset holding a token id past the vocabulary."""
        for (shard, start), t in zip(picks, tokens):
            over = np.flatnonzero(t >= self.vocab_size)
            if over.size:
                raise DatasetError(f"{self.url}: shard {shard.key} holds token id {int(t[over[0]])} at token "
                                   f"{start + int(over[0])}, past the vocabulary of {self.vocab_size} (its index's "
                                   "tokenizer): the shard is damaged or was not written for this index; `orchestrate "
                                   "data check` lists every damaged shard; prepare the dataset again")

    def counted_targets(self, shard: Shard, start: int, block_size: int) -> bool:
        """Whether a window has a target whose loss counts (always, but for fine-tuning data)."""
        if not self.index.masked:
            return True
        (mask,) = self._read([(shard.mask_key, start + 1, start + block_size + 1)], np.dtype(np.uint8))
        return bool(mask.any())


# ----------------------------------------------------------------------------- which dataset a run reads


def dataset_for(cfg: Config, cache_dir: str | os.PathLike | None = None) -> Dataset:
    """The dataset a run trains and evaluates on: data.source prepared, or the text it names prepared
    once into the cache; its tokenizer must be the model's."""
    tokenizer = "bytes" if cfg.model.hf is None else f"hf:{cfg.model.hf}"
    source = cfg.data.source
    if source is not None and (("://" in source and not source.startswith("file://")) or _has_index(source)):
        ds = Dataset(source)
        _check_tokenizer(ds, tokenizer, cfg)
        return ds
    return _text_dataset(source, cfg.data.include_tests, cache_dir or cfg.data.cache_dir, tokenizer,
                         cfg.data.heldout_fraction)


def _has_index(source: str) -> bool:
    """Is `source` a prepared dataset (it has, or had, an index: an index.json of whatever kind, or a
    prepare's shard or part files)? Such a folder is never prepared again as text: a lost or damaged
    index is an error. (A text corpus may have folders named shards/ or parts/ of its own.)"""
    folder = Path(source.removeprefix("file://")).expanduser()
    if not folder.is_dir():
        return False
    if os.path.lexists(folder / fmt.INDEX):
        return True
    return any(fmt.PREPARED.fullmatch(f"{d}/{n}") for d in ("shards", "parts") if (folder / d).is_dir()
               for n in os.listdir(folder / d)[:64])


def _resolved(url: str) -> str:
    """A local dataset's real folder (the user may name it through links); any other URL as it is."""
    if "://" in url and not url.startswith("file://"):
        return url
    return os.path.realpath(Path(url.removeprefix("file://")).expanduser())


def _check_tokenizer(ds: Dataset, tokenizer: str, cfg: Config) -> None:
    if tokenizer == "bytes":
        want, model = "bytes", "the built-in byte-level model"
    else:
        want, model = load_tokenizer(tokenizer).info.name, f"the model at {cfg.model.hf}"
    if ds.index.tokenizer.name != want:
        raise DatasetError(f"data.source {ds.url} was prepared with tokenizer {text(ds.index.tokenizer.name, 200)}, but {model} "
                           f"reads {want}: prepare it again with --tokenizer {tokenizer}, or train the model it was "
                           "prepared for")


def _text_dataset(source: str | None, include_tests: bool, cache_dir: str | os.PathLike | None, tokenizer: str,
                  heldout: float) -> Dataset:
    root, files = _list_files(source, include_tests)
    if not files:
        raise DatasetError(f"Corpus source {root} has no files to read; point the source at a directory that "
                           "contains text files.")
    head = {"format": _TEXT_CACHE_FORMAT, "root": str(root), "stdlib": source is None, "include_tests": include_tests,
            "tokenizer": load_tokenizer(tokenizer).info.name, "heldout": heldout}
    h = hashlib.sha256(json.dumps(head, sort_keys=True).encode())
    for rel, _, size, mtime_ns in files:
        h.update(json.dumps([rel, size, mtime_ns]).encode() + b"\n")
    directory = Path(cache_dir or local_cache_root()) / "data" / h.hexdigest()
    _check_cache_folder(directory.parent)
    if os.path.lexists(directory):
        try:
            why = _untrusted(directory)
            if why is None:
                return Dataset(str(directory))
        except (DatasetError, StorageError, OSError, ValueError) as exc:  # derived data: prepared again
            why = f"it is unusable ({exc})"
        logger.warning("the prepared corpus in %s: %s; preparing it again from %s", directory, why, root)
        _remove_entry(directory)
    if any(is_records(rel) for rel, _, _, _ in files):  # JSON lines or parquet: records, as `data prepare` reads them
        given = str(Path(source.removeprefix("file://")).expanduser().resolve())  # type: ignore[union-attr]
        logger.info("data.source %s holds records (JSON lines or parquet): preparing them once, each record's "
                       "'text' field a document, into %s; `orchestrate data prepare` names other fields", given, directory)
        spec, units = PrepareSpec(sources=(given,), out=str(directory), tokenizer=tokenizer, heldout=heldout,
                                  skip_bad=True), None
    else:
        names = [rel for rel, _, size, _ in files if size > 0]
        spec = PrepareSpec(sources=(str(root),), out=str(directory), tokenizer=tokenizer, heldout=heldout,
                           skip_bad=True, eval_names=frozenset(_heldout_names(names, heldout, seed=0)))
        units = [Unit("text", "", batch[0][0], sum(s for _, _, s, _ in batch), files=tuple((r, str(p)) for r, p, _, _ in batch))
                 for batch in _batches(files)]
    try:
        prepare(spec, units)
    except DatasetError as exc:  # nothing half-prepared is left in the cache
        shutil.rmtree(directory, ignore_errors=True)
        raise DatasetError(f"data.source {source or root} could not be prepared: {exc}. To choose how it is read, "
                           f"prepare it yourself: `orchestrate data prepare {source or root} --out DIR` (--text-field, "
                           "--heldout, ...) and set data.source=DIR") from None
    return Dataset(str(directory))


def _check_cache_folder(folder: Path) -> None:
    """The cache's data/ folder, once made, is the user's and closed to others (core/trust.py), as a
    run directory is: else DatasetError, since no entry in it could be trusted."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return
    if (who := stranger(st, allow_group=True)) is not None or stat.S_ISLNK(st.st_mode):
        raise DatasetError(f"data.cache_dir's folder {folder} {who or 'is a link'}: someone else could put a corpus "
                           f"there for you to train on; chmod o-w {folder} (or replace the link with a folder), or set "
                           "data.cache_dir to a folder of your own")


def _untrusted(entry: Path) -> str | None:
    """Why a cache entry cannot be trained on, trusted like a run directory: the entry and
    everything in it a folder or regular file of the user's that others cannot write, never a link
    (which could lead anywhere). None: it can be."""
    for path in [entry, *(Path(d) / n for d, dirs, files in os.walk(entry) for n in dirs + files)]:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return f"{path} is a link, not what islands prepared"
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            return f"{path} is not a regular file"
        if (who := stranger(st, allow_group=True)) is not None:
            return f"{path} {who}"
    return None


def _remove_entry(entry: Path) -> None:
    """A cache entry removed (a link itself, not where it leads), or DatasetError naming it."""
    try:
        if entry.is_symlink() or not entry.is_dir():
            entry.unlink()
        else:
            shutil.rmtree(entry)
    except OSError as exc:
        raise DatasetError(f"the prepared corpus {entry} cannot be trusted or used and cannot be removed ({exc}): "
                           "remove it, or set data.cache_dir to a folder of your own") from None


def _batches(files: list[tuple[str, Path, int, int]], limit: int = 32 << 20) -> list[list]:
    out, cur, size = [], [], 0
    for f in files:
        cur.append(f)
        size += f[2]
        if size >= limit:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


def _heldout_names(names: list[str], fraction: float, seed: int) -> set[str]:
    """Each document decided by a hash of (seed, name) alone, so adding or removing files never moves
    the others; at least one document on each side when there are two."""
    u = {n: unit_hash(seed, n) for n in names}
    held = {n for n, x in u.items() if x < fraction}
    if len(u) >= 2 and not held:
        held = {min(u, key=u.__getitem__)}
    if len(u) >= 2 and len(held) == len(u):
        held.discard(max(u, key=u.__getitem__))
    return held


def _walk(root: Path, keep_dir: Callable[[str], bool], keep_file: Callable[[str], bool]) -> list[tuple[str, Path, int, int]]:
    """[(relative '/' path, path, size, mtime_ns)] of regular files under root, unsorted (os.scandir
    hands back each entry's stat with the listing: a warm start costs one directory walk)."""
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
    path = Path(source.removeprefix("file://")).expanduser().resolve()
    if path.is_file():
        st = path.stat()
        return path.parent, [(path.name, path, st.st_size, st.st_mtime_ns)]
    if not path.is_dir():
        raise DatasetError(f"Corpus source {source!r} does not exist (resolved to {path}); pass an existing text file "
                           "or directory, a prepared dataset, or no source to use the Python standard library.")
    visible = lambda name: not name.startswith(".")  # noqa: E731  hidden entries are tooling, not text
    return path, sorted(_walk(path, visible, visible))


# ----------------------------------------------------------------------------- a worker's share and its batches


def affine(n: int, seed: int) -> tuple[int, int]:
    """(a, b) with gcd(a, n) = 1: i -> (a * i + b) mod n is a seeded permutation of range(n)."""
    a = 1 + int(unit_hash(seed, "deal-a") * n) % n if n > 1 else 1
    while math.gcd(a, n) != 1:
        a += 1
    return a, int(unit_hash(seed, "deal-b") * n)


@dataclass(frozen=True)
class Deal:
    """A worker's share of range(total), and where a draw lands in it: every stride-th position from
    `offset` of a seeded affine permutation (disjoint, covering shares, balanced to one item), or
    all of range(total) in order (stride 1: a non-iid worker owns its groups whole). The one deal of
    token segments (BatchSampler) and of a task's examples (worker.tasks.ExampleSampler)."""
    total: int
    count: int
    stride: int = 1
    offset: int = 0
    a: int = 1
    b: int = 0

    @classmethod
    def share(cls, total: int, seed: int, worker: int, num_workers: int) -> Deal:
        a, b = affine(total, seed)
        return cls(total, len(range(worker, total, num_workers)), num_workers, worker, a, b)

    def item(self, r: int) -> int:
        """The item of range(total) that draw `r` (any natural number) lands on, in this share."""
        return (self.a * (self.offset + (r % self.count) * self.stride) + self.b) % self.total


def step_generator(seed: int, worker: int, step: int) -> torch.Generator:
    """The generator of one step's draws, seeded by (seed, worker, step) alone: a fresh one per step
    instead of one advancing generator is what makes a resumed or replayed worker's batches identical
    without saving any sampler state."""
    return torch.Generator().manual_seed(int(unit_hash(seed, worker, step) * 2**63))


def group_tokens(shards: list[Shard]) -> dict[str, int]:
    """Each group's train tokens."""
    sizes: dict[str, int] = {}
    for s in shards:
        sizes[s.group] = sizes.get(s.group, 0) + s.tokens
    return sizes


def deal_groups(shards: list[Shard], num_workers: int, url: str) -> list[list[str]]:
    """Non-iid: each worker's whole groups, the largest first to the least loaded worker."""
    sizes = group_tokens(shards)
    if len(sizes) < num_workers:
        raise DatasetError(f"Cannot shard the {len(sizes)} group(s) of {url}'s train split over {num_workers} workers "
                           "(data.sharding non-iid): each worker needs at least one whole group; use fewer workers, "
                           "data.sharding iid, or a corpus of more groups (prepared with a --group-field of more values; "
                           "text files: more top-level folders).")
    load, out = [0] * num_workers, [[] for _ in range(num_workers)]  # type: ignore[var-annotated]
    for name in sorted(sizes, key=lambda g: (-sizes[g], g)):
        w = min(range(num_workers), key=lambda i: (load[i], len(out[i]), i))
        load[w] += sizes[name]
        out[w].append(name)
    return out


class BatchSampler:
    """Random windows over one worker's share of the train split; batch(step) depends only on
    (dataset, seed, worker, step)."""

    def __init__(self, ds: Dataset, block_size: int, batch_size: int, seed: int, worker: int, num_workers: int,
                 mode: str = "iid", groups: Collection[str] | None = None) -> None:
        """`groups`: only the train shards of these groups (all by default)."""
        if block_size < 1 or batch_size < 1 or num_workers < 1:
            raise ValueError(f"BatchSampler needs block_size, batch_size and num_workers >= 1, got {block_size}, "
                             f"{batch_size} and {num_workers}.")
        if mode not in SHARD_MODES:
            raise ValueError(f"Unknown shard mode {mode!r}; valid modes are {', '.join(SHARD_MODES)}.")
        self.ds, self.block_size, self.batch_size, self.seed, self.worker = ds, block_size, batch_size, seed, worker
        shards = [s for s in ds.index.split("train") if s.tokens > block_size and (groups is None or s.group in groups)]
        self.segment = SEGMENT_WINDOWS * (block_size + 1)
        worker %= num_workers
        if mode == "non-iid":
            mine = set(deal_groups(shards, num_workers, ds.url)[worker])
            shards = [s for s in shards if s.group in mine]
        self.shards = shards
        self.cum = np.cumsum([math.ceil(s.tokens / self.segment) for s in shards]) if shards else np.zeros(0, np.int64)
        total = int(self.cum[-1]) if shards else 0
        if mode == "iid" and total < num_workers:
            raise DatasetError(f"Cannot shard the train split of {ds.url} ({total} segments of {self.segment} "
                               f"tokens) over {num_workers} workers (iid); use fewer workers, a smaller "
                               "model.block_size or more data.")
        self.deal = Deal.share(total, seed, worker, num_workers) if mode == "iid" else Deal(total, total)
        if self.deal.count == 0:
            raise DatasetError(f"Worker {worker}'s share of {ds.url} is empty (no train shard of more than "
                               f"{block_size} tokens); use a smaller model.block_size or more data.")

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.block_size

    def _pick(self, r_seg: int, r_pos: int) -> tuple[Shard, int]:
        g = self.deal.item(r_seg)
        i = int(np.searchsorted(self.cum, g, side="right"))
        shard = self.shards[i]
        first = (g - (int(self.cum[i - 1]) if i else 0)) * self.segment
        length = min(self.segment, shard.tokens - first)
        return shard, min(first + r_pos % length, shard.tokens - self.block_size - 1)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y of shape (batch_size, block_size), int64, y[:, t] = x[:, t + 1] in the shard (-1: no loss)."""
        if step < 0:
            raise ValueError(f"BatchSampler.batch needs step >= 0, got {step}.")
        g = step_generator(self.seed, self.worker, step)
        picks = []
        for _ in range(self.batch_size):
            for _attempt in range(8):  # fine-tuning data: a window whose targets are all prompt is drawn again
                r = torch.randint(0, 2**62, (2,), generator=g).tolist()
                pick = self._pick(r[0], r[1])
                if self.ds.counted_targets(pick[0], pick[1], self.block_size):
                    break
            picks.append(pick)
        return self.ds.windows(picks, self.block_size)


def eval_batches(ds: Dataset, block_size: int, batch_size: int, num_batches: int, seed: int,
                 groups: Collection[str] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed held-out batches: num_batches * batch_size windows evenly spaced over the eval split. The
    seed only deals windows to batches, so each batch is a cross-section of the eval documents."""
    if block_size < 1 or batch_size < 1 or num_batches < 1:
        raise ValueError(f"eval_batches needs block_size, batch_size and num_batches >= 1, got "
                         f"{block_size}, {batch_size} and {num_batches}.")
    shards = [s for s in ds.index.split("eval") if s.tokens > block_size and (groups is None or s.group in groups)]
    if not shards:
        tokens = sum(s.tokens for s in ds.index.split("eval"))
        raise DatasetError(f"The eval split of {ds.url} ({tokens} tokens) has no shard longer than block_size + 1 = "
                           f"{block_size + 1} tokens; hold out more documents (data.heldout_fraction, --heldout) or "
                           "use a smaller block_size.")
    starts = np.cumsum([0] + [s.tokens - block_size for s in shards])
    n = batch_size * num_batches
    points = np.linspace(0, starts[-1] - 1, n).round().astype(np.int64)
    picks = []
    for p in points:
        i = int(np.searchsorted(starts, p, side="right")) - 1
        picks.append((shards[i], int(p - starts[i])))
    order = list(range(n))
    random.Random(seed).shuffle(order)
    picks = [picks[j] for j in order]
    return [ds.windows(picks[b * batch_size:(b + 1) * batch_size], block_size) for b in range(num_batches)]
