"""Sources -> token shards + index (core/dataset.py), once, at any fsspec URL: `orchestrate data prepare`.

Each unit of work (worker/sources.py) is read, tokenized and written by one process on its own:
its documents go to the train or the eval split (by a hash of the document's id, or for a folder
of text files by name, decided up front so each side has at least one), and to the stream of
their group; a stream is cut into shards of at most `shard_tokens` tokens. The unit's record
(parts/NNNNNN.json) is written after its shards, and the index after every unit: a prepare killed
anywhere and run again redoes only the units without a record, and the same sources and settings
give the same bytes whatever the number of processes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import signal
from dataclasses import asdict, dataclass, field
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from core import dataset as fmt
from core.dataset import DatasetError, Index, Shard, Tokenizer
from core.errors import IslandsError, StorageError
from core.failpoints import slowpoint
from core.progress import human, progress
from core.storage import Storage
from worker.sources import BadRecord, Fields, Record, Unit, describe, plan_units, records

log = logging.getLogger(__name__)
_ENCODE_BATCH = 256  # documents handed to the tokenizer at once
_POLL_S = 0.5  # how often a pool's progress is read


@dataclass(frozen=True)
class PrepareSpec:
    sources: tuple[str, ...]
    """Files or folders (any fsspec URL) to read."""
    out: str
    """Where the dataset is written (any fsspec URL)."""
    tokenizer: str = "bytes"
    """`bytes` (vocabulary 256), or `hf:DIR`: the tokenizer saved in a Hugging Face model folder."""
    fields: Fields = field(default_factory=Fields)
    heldout: float = 0.05
    """Fraction of the documents held out as the eval split."""
    seed: int = 0
    """Decides which documents are held out."""
    procs: int = 1
    """Processes that prepare units at once."""
    shard_tokens: int = 1 << 25
    """Most tokens in one shard."""
    skip_bad: bool = False
    """Skip (and count) a bad record instead of stopping at it."""
    eval_names: frozenset[str] | None = None
    """The held-out documents by id, decided by the caller (a text corpus: see worker/data.py)."""

    def settings(self) -> dict[str, Any]:
        """What makes the bytes: a resume with other settings is refused."""
        return {"sources": list(self.sources), "tokenizer": self.tokenizer, "fields": asdict(self.fields),
                "heldout": self.heldout, "seed": self.seed, "shard_tokens": self.shard_tokens,
                "skip_bad": self.skip_bad, "eval_names": None if self.eval_names is None else
                hashlib.sha256("\n".join(sorted(self.eval_names)).encode()).hexdigest()}


# ----------------------------------------------------------------------------- tokenizers


class _Bytes:
    info = Tokenizer("bytes", 256, ord("\n"))

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


class _HF:
    def __init__(self, path: str) -> None:
        from worker.hf import load_tokenizer  # transformers: only for hf: tokenizers
        self.tok = load_tokenizer(path)
        self.info = Tokenizer(self.tok.name, len(self.tok.tok), self.tok.separator)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in self.tok.encode(texts)]

    def chat(self, turns: tuple[tuple[str, str], ...]) -> tuple[np.ndarray, np.ndarray] | None:
        """A conversation through the tokenizer's chat template: (tokens, mask), the mask 1 on the assistant's
        turns (not on the header the template puts before each); None if the template does not render a
        conversation's turns as prefixes of it (then no mask can be cut)."""
        render = lambda n, prompt: self.tok.tok.apply_chat_template(  # noqa: E731
            [{"role": r, "content": c} for r, c in turns[:n]], tokenize=False, add_generation_prompt=prompt)
        pieces, done = [], ""
        for i, (role, _) in enumerate(turns):
            cut = [render(i, True), render(i + 1, False)] if role == "assistant" else [render(i + 1, False)]
            for text, counts in zip(cut, (0, 1) if role == "assistant" else (0,)):
                if not text.startswith(done):
                    return None
                pieces.append((text[len(done):], counts))
                done = text
        ids = self.encode([t for t, _ in pieces])
        return np.concatenate(ids), np.concatenate([np.full(len(x), c, np.uint8) for x, (_, c) in zip(ids, pieces)])


def load_tokenizer(spec: str) -> _Bytes | _HF:
    if spec == "bytes":
        return _Bytes()
    if spec.startswith("hf:") and len(spec) > 3:
        return _HF(spec[3:])
    raise DatasetError(f"--tokenizer {spec!r}: give `bytes` or `hf:DIR` (a Hugging Face model folder with its tokenizer)")


# ----------------------------------------------------------------------------- one unit


def unit_hash(*parts: object) -> float:
    """A stable uniform number in [0, 1) from its parts (Python's hash() is salted per process)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class _Stream:
    """One (split, group) of one unit: documents buffered until a shard's worth is written."""

    def __init__(self, number: int, split: str, group: str) -> None:
        self.number, self.split, self.group = number, split, group
        self.parts: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.ends: list[int] = []
        self.size = 0
        self.written = 0

    def add(self, tokens: np.ndarray, mask: np.ndarray | None) -> None:
        self.parts.append(tokens)
        if mask is not None:
            self.masks.append(mask)
        self.size += len(tokens)
        self.ends.append(self.size)


class _UnitWriter:
    def __init__(self, storage: Storage, number: int, spec: PrepareSpec, tok: Any) -> None:
        self.storage, self.number, self.spec, self.tok = storage, number, spec, tok
        self.dtype = fmt.dtype_for(tok.info.vocab_size)
        self.streams: dict[tuple[str, str], _Stream] = {}
        self.shards: list[Shard] = []
        self.documents = self.skipped = self.empty = self.tokens = 0

    def add(self, batch: list[Record]) -> None:
        sep = np.array([self.tok.info.separator])
        if self.spec.fields.messages:
            docs = [self._chat(r, sep) for r in batch]
        elif self.spec.fields.response:
            prompts, responses = self.tok.encode([r.prompt or "" for r in batch]), self.tok.encode([r.text for r in batch])
            docs = [(np.concatenate([p, r, sep]), np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(r) + 1, np.uint8)]))
                    for p, r in zip(prompts, responses)]
        else:
            docs = [(np.concatenate([t, sep]), None) for t in self.tok.encode([r.text for r in batch])]
        for record, doc in zip(batch, docs):
            if doc is None:  # a conversation the chat template cannot cut into turns
                self.skipped += 1
                continue
            tokens, mask = doc
            if len(tokens) == 1:  # an empty document adds nothing but a separator: dropped, counted
                self.empty += 1
                continue
            stream = self._stream(self._split(record), record.group)
            stream.add(tokens.astype(self.dtype), mask)
            self.documents += 1
            self.tokens += len(tokens)
            if stream.size >= self.spec.shard_tokens:
                self._flush(stream)

    def _chat(self, record: Record, sep: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        out = self.tok.chat(record.messages)
        if out is None:
            if not self.spec.skip_bad:
                raise DatasetError(f"{record.where}: the tokenizer's chat template does not render this conversation's "
                                   "turns as prefixes of it, so its assistant turns cannot be told apart (stopped: "
                                   "--skip-bad skips and counts such records)")
            return None
        return np.concatenate([out[0], sep]), np.concatenate([out[1], np.zeros(1, np.uint8)])

    def _split(self, record: Record) -> str:
        if self.spec.eval_names is not None:
            return "eval" if record.id in self.spec.eval_names else "train"
        return "eval" if unit_hash(self.spec.seed, record.id) < self.spec.heldout else "train"

    def _stream(self, split: str, group: str) -> _Stream:
        key = (split, group)
        if key not in self.streams:
            if len(self.streams) >= 2 * fmt.MAX_GROUPS:  # before thousands of buffers pile up
                raise DatasetError(f"--group-field {self.spec.fields.group!r} has more than {fmt.MAX_GROUPS} values: it "
                                   "is not a group; name a coarser field (a source, a domain)")
            self.streams[key] = _Stream(len(self.streams), split, group)
        return self.streams[key]

    def _flush(self, s: _Stream) -> None:
        if not s.size:
            return
        key = fmt.shard_key(self.number, s.number, s.written)
        tokens = np.concatenate(s.parts).astype(f"<{np.dtype(self.dtype).str[1:]}").tobytes()
        ends = np.asarray(s.ends, dtype="<u8").tobytes()
        mask = np.concatenate(s.masks).tobytes() if s.masks else None
        shard = Shard(key, s.split, s.group, s.size, len(s.ends),
                      (fmt.checksum(tokens), fmt.checksum(ends), None if mask is None else fmt.checksum(mask)))
        self.storage.write_bytes(shard.key, tokens)
        self.storage.write_bytes(shard.docs_key, ends)
        if mask is not None:
            self.storage.write_bytes(shard.key[:-4] + ".mask", mask)
        self.shards.append(shard)
        s.parts, s.masks, s.ends, s.size, s.written = [], [], [], 0, s.written + 1

    def finish(self, settings_digest: str) -> dict[str, Any]:
        for s in self.streams.values():
            self._flush(s)
        record = {"settings": settings_digest, "documents": self.documents, "skipped": self.skipped,
                  "empty": self.empty, "tokens": self.tokens, "shards": [s.to_json() for s in self.shards]}
        self.storage.write_json(fmt.part_key(self.number), record)  # last: the unit is done once it exists
        return record


_TOKENIZER: Any = None
_READ: Any = None  # a pool process's share of the parent's count of input bytes read (multiprocessing.Value)


def _init_process(tokenizer: str, read: Any) -> None:
    global _TOKENIZER, _READ
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the pool
    _TOKENIZER, _READ = load_tokenizer(tokenizer), read


def _count_read(n: int) -> None:
    with _READ.get_lock():
        _READ.value += n


def prepare_unit(number: int, unit: Unit, spec: PrepareSpec, digest: str, tok: Any = None,
                 moved: Callable[[int], None] | None = None) -> tuple[dict[str, Any], int]:
    """Read, tokenize and write one unit (in a pool process, or here with `tok`); its record, stamped
    with the settings' `digest`, and the input bytes it told `moved` of as it read (its progress)."""
    tok = tok or _TOKENIZER or load_tokenizer(spec.tokenizer)
    moved = moved or (_count_read if _READ is not None else lambda n: None)
    writer = _UnitWriter(Storage(spec.out, follow_links=True), number, spec, tok)
    batch: list[Record] = []
    last, told = "its start", 0
    try:
        for rec in records(unit, spec.fields):
            if isinstance(rec, BadRecord):
                if not spec.skip_bad:
                    raise DatasetError(f"{rec} (stopped: fix the record, or pass --skip-bad to skip and count such records)")
                writer.skipped += 1
                log.debug("skipped %s", rec)
                continue
            last = rec.where
            batch.append(rec)
            if len(batch) >= _ENCODE_BATCH:
                writer.add(batch)
                if (read := min(rec.read, unit.size)) > told:
                    moved(read - told)
                    told = read
                batch = []
                slowpoint("prepare.batch")  # tests: a unit slow enough for a pool's progress to be polled
    except DatasetError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt, truncated or vanished input is one error naming it
        raise DatasetError(f"{unit.rel} cannot be read past {last} ({describe(exc)}): the file is "
                           "damaged, truncated, not of the kind its name says, or was changed while it was read; "
                           "fix or remove it, and run the same command again (finished units are kept)") from None
    if batch:
        writer.add(batch)
    return writer.finish(digest), told


def _digest(spec: PrepareSpec, tok: Any) -> str:
    """The settings and the tokenizer itself (a folder's tokenizer may change under the same name)."""
    settings = {**spec.settings(), "tokenizer_identity": tok.info.name}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:32]


# ----------------------------------------------------------------------------- the whole prepare


def prepare(spec: PrepareSpec, units: list[Unit] | None = None) -> Index:
    """Prepare `spec.sources` (or the `units` given) into `spec.out`, resuming a killed prepare; the
    checked index."""
    if not 0.0 < spec.heldout < 1.0:
        raise DatasetError(f"--heldout must be in (0, 1), got {spec.heldout}")
    if spec.procs < 1 or spec.shard_tokens < 1:
        raise DatasetError(f"--procs and --shard-tokens must be >= 1, got {spec.procs} and {spec.shard_tokens}")
    tok = load_tokenizer(spec.tokenizer)
    if spec.fields.messages and not isinstance(tok, _HF):
        raise DatasetError("--messages-field needs --tokenizer hf:DIR: a Hugging Face tokenizer with a chat template")
    if spec.fields.messages and not getattr(tok.tok.tok, "chat_template", None):
        raise DatasetError(f"--messages-field: the tokenizer of {spec.tokenizer} has no chat template; save one with "
                           "it (tokenizer.chat_template = ...; tokenizer.save_pretrained(DIR))")
    storage = Storage(spec.out, follow_links=True)
    _refuse_foreign(storage)
    digest = _digest(spec, tok)
    try:
        existing = storage.read_json(fmt.INDEX, limit=fmt.INDEX_LIMIT)
    except StorageError as exc:
        raise DatasetError(f"{storage.display(fmt.INDEX)} is damaged ({exc}); remove {storage.display()} or give "
                           "another --out") from None
    if existing is not None:
        index = fmt.parse_index(existing, storage.display())
        if index.settings.get("digest") == digest:
            log.info("%s is already prepared with these settings", storage.display())
            return index
        raise DatasetError(f"{storage.display()} already holds a dataset prepared with other settings; give another "
                           "--out, or remove it first")
    units = units if units is not None else plan_units(list(spec.sources), spec.fields)
    masked = spec.fields.masked
    width, sizes = fmt.DTYPES[fmt.dtype_for(tok.info.vocab_size)], fmt.listed_sizes(storage)
    done = {i: rec for i in range(len(units)) if (rec := _finished(storage, i, digest, masked, (width, sizes))) is not None}
    if done:
        log.info("resuming: %d of %d units already prepared", len(done), len(units))
    todo = [i for i in range(len(units)) if i not in done]
    procs = max(1, min(spec.procs, len(todo), os.cpu_count() or 1))
    if procs < spec.procs:
        log.info("--procs %d: %d processes (%d unit(s) to prepare, %d cores)", spec.procs, procs, len(todo),
                 os.cpu_count() or 1)
    _prepare_units(dataclasses.replace(spec, procs=procs), units, todo, done, (digest, tok))
    return _write_index(storage, spec, tok, [done[i] for i in range(len(units))], digest, masked)


def _prepare_units(spec: PrepareSpec, units: list[Unit], todo: list[int], done: dict[int, dict[str, Any]],
                   how: tuple[str, Any]) -> None:
    """Units `todo` prepared into `done` under one progress bar (the units `done` already hold count
    as read); `how`: the settings' digest and the tokenizer."""
    docs, tokens = sum(r["documents"] for r in done.values()), sum(r["tokens"] for r in done.values())
    with progress(sum(u.size for u in units) / 1e6, "preparing", unit="MB") as bar:
        bar.advance(sum(units[i].size for i in done) / 1e6)
        if done:  # said on the bar until the next unit ends: a resume does not look stalled
            bar.note(f"{len(done)} of {len(units)} units kept")
        for i, rec, told in _run(todo, units, spec, *how, lambda n: bar.advance(n / 1e6)):
            done[i] = rec
            docs, tokens = docs + rec["documents"], tokens + rec["tokens"]
            bar.note(f"{human(docs)} docs, {human(tokens)} tok")
            bar.advance((units[i].size - told) / 1e6)  # the rest of the unit (all of it, where reads are not told)


OWN = (fmt.INDEX, "parts", "shards")
"""What a prepared dataset's folder holds: `--out` must be empty or hold only these."""


def _refuse_foreign(storage: Storage) -> None:
    """DatasetError when `--out` is a file, or a folder holding anything but a dataset's own files
    (another dataset's parts are the prepare's to resume or refuse): nobody's files are overwritten."""
    try:
        kind = storage.kind()
        if kind is None:
            return
        if kind != "directory":
            raise DatasetError(f"--out {storage.display()} is a file, not a folder; give a new or empty folder")
        names = sorted(n for n in storage.list("") if n not in OWN)
    except OSError as exc:
        raise DatasetError(f"--out {storage.display()} cannot be listed ({exc}); give a new or empty folder") from None
    if names:
        raise DatasetError(f"--out {storage.display()} already holds other files ({', '.join(names[:5])}"
                           f"{', ...' if len(names) > 5 else ''}): data prepare writes only into a new or empty folder, "
                           "or one of its own datasets (to resume it); give another --out")


def _run(todo: list[int], units: list[Unit], spec: PrepareSpec, digest: str, tok: Any,
         moved: Callable[[int], None]) -> Iterator[tuple[int, dict[str, Any], int]]:
    """(unit, record, input bytes told to `moved`) of each unit in `todo` as it finishes; `moved` hears
    of input bytes read while units are under way (every _POLL_S from a pool)."""
    if spec.procs == 1 or len(todo) <= 1:
        for i in todo:
            yield i, *prepare_unit(i, units[i], spec, digest, tok, moved)
        return
    # spawn: a fresh interpreter per process (a fork would copy this one's threads and tokenizer state)
    ctx = multiprocessing.get_context("spawn")
    read, told = ctx.Value("q", 0), 0
    pool = ctx.Pool(spec.procs, initializer=_init_process, initargs=(spec.tokenizer, read))
    try:
        results = pool.imap_unordered(_prepare_job, [(i, units[i], spec, digest) for i in todo])
        for _ in todo:
            while True:
                try:
                    got = results.next(timeout=_POLL_S)
                    break
                except multiprocessing.TimeoutError:
                    pass
                finally:
                    moved(read.value - told)
                    told = read.value
            yield got
    finally:  # Ctrl-C or a bad record: stop every unit at once; the finished ones stay for a re-run
        pool.terminate()
        pool.join()


def _prepare_job(job: tuple[int, Unit, PrepareSpec, str]) -> tuple[int, dict[str, Any], int]:
    return job[0], *prepare_unit(*job)


def _finished(storage: Storage, i: int, digest: str, masked: bool, files: tuple[int, dict[str, int]]
              ) -> dict[str, Any] | None:
    """Unit i's record if a previous prepare with the same settings finished it: its files, of `files`'
    (token width, listed sizes), have the sizes it says."""
    try:
        rec = storage.read_json(fmt.part_key(i), limit=fmt.INDEX_LIMIT)
    except IslandsError:  # a damaged record: the unit is prepared again
        return None
    if not isinstance(rec, dict) or rec.get("settings") != digest:
        if rec is not None:
            raise DatasetError(f"{storage.display(fmt.part_key(i))} was written by a prepare with other settings; give "
                               "another --out, or remove it first")
        return None
    parsed = fmt.parse_part(rec, storage.display(fmt.part_key(i)), masked)
    if parsed is None or not isinstance(rec.get("tokens"), int) or fmt.size_problems(parsed[0], *files):
        return None
    return rec


def _write_index(storage: Storage, spec: PrepareSpec, tok: Any, parts: list[dict[str, Any]], digest: str,
                 masked: bool) -> Index:
    shards = [s for rec in parts for s in rec["shards"]]
    documents, skipped = sum(r["documents"] for r in parts), sum(r["skipped"] for r in parts)
    empty = sum(r.get("empty", 0) for r in parts)  # checked by parse_part when present
    splits = {s["split"] for s in shards}
    if documents == 0:
        raise DatasetError(f"the sources hold no document to train on ({skipped} bad record(s) skipped, {empty} "
                           "empty); check --text-field and the files")
    if len({s["group"] for s in shards}) > fmt.MAX_GROUPS:
        raise DatasetError(f"--group-field {spec.fields.group!r} has more than {fmt.MAX_GROUPS} values: it is not a "
                           "group; name a coarser field (a source, a domain)")
    for split in ("train", "eval"):
        if split not in splits:
            raise DatasetError(f"no document went to the {split} split ({documents} documents, --heldout "
                               f"{spec.heldout}): {'raise' if split == 'eval' else 'lower'} --heldout, or add documents")
    settings = {**spec.settings(), "digest": digest}
    obj = {"format": fmt.FORMAT, "settings": settings, "dtype": fmt.dtype_for(tok.info.vocab_size), "masked": masked,
           "tokenizer": asdict(tok.info), "documents": documents, "skipped": skipped, "empty": empty, "shards": shards}
    index = fmt.parse_index(obj, storage.display())  # what a reader will check, checked before it is written
    storage.write_bytes(fmt.INDEX, json.dumps(index.to_json(), indent=1, sort_keys=True).encode())
    log.info("prepared %s: %d documents (%d skipped, %d empty dropped), %d train + %d eval tokens in %d shards",
             storage.display(), documents, skipped, empty, sum(s.tokens for s in index.split("train")), sum(s.tokens for s in index.split("eval")),
             len(index.shards))
    return index
