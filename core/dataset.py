"""The prepared-dataset format: token shards plus one JSON index, and its one checked reader.

A prepared dataset (`orchestrate data prepare`, worker/prepare.py) is a folder at any fsspec URL:

    index.json                       written last: without it there is no dataset
    parts/000003.json                one record per unit of work (the resumable steps of a prepare)
    shards/000003-0001-0000.bin      tokens, little-endian uint8 | uint16 | uint32 (see `dtype`)
    shards/000003-0001-0000.docs     uint64 end offset of every document in the shard
    shards/000003-0001-0000.mask     (fine-tuning data only) one uint8 per token: 1 = its loss counts

Each shard holds whole documents of one split (train | eval) and one group (a text file's top folder,
or the value of the record field named by --group-field), each followed by the tokenizer's separator.
Every byte of a dataset is untrusted, like a checkpoint: `parse_index` and `parse_part` check every
field (types, ranges, keys that stay inside the dataset, sizes that add up) and say everything that
is wrong at once; readers check each shard's size against the index before using it, and
`orchestrate data check` (`verify_shard`) checks every checksum.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import xxhash

from core.errors import IslandsError

FORMAT = "islands-dataset-v1"
INDEX = "index.json"
INDEX_LIMIT = 256 << 20  # bytes: an index lists shards, ~200 bytes each; past this it is not one
SPLITS = ("train", "eval")
DTYPES = {"uint8": 1, "uint16": 2, "uint32": 4}
MAX_GROUPS = 4096
"""More groups than this is a field that is not a group (a URL, an id): a prepare refuses it."""
_KEY = re.compile(r"shards/\d{6}-\d{4}-\d{4}\.bin")
PREPARED = re.compile(r"shards/\d{6}-\d{4}-\d{4}\.(bin|docs|mask)|parts/\d{6}\.json")
"""The files a prepare writes before its index: a folder holding one is a dataset, never text."""
_HEX = re.compile(r"[0-9a-f]{32}")


class DatasetError(IslandsError):
    """A prepared dataset (or a source being prepared) is unusable; the message says where and how to fix it."""


def checksum(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def dtype_for(vocab_size: int) -> str:
    """The smallest token type that holds every id of the vocabulary."""
    return next(name for name, width in DTYPES.items() if vocab_size <= 1 << (8 * width))


def part_key(unit: int) -> str:
    return f"parts/{unit:06d}.json"


def shard_key(unit: int, stream: int, n: int) -> str:
    return f"shards/{unit:06d}-{stream:04d}-{n:04d}.bin"


@dataclass(frozen=True)
class Shard:
    key: str  # shards/...bin; its documents' ends at key[:-4] + ".docs", its mask at ".mask"
    split: str  # train | eval
    group: str
    tokens: int
    documents: int
    sums: tuple[str, str, str | None]  # xxh3-128 of the tokens, the document ends, the mask (or None)

    @property
    def docs_key(self) -> str:
        return self.key[:-4] + ".docs"

    @property
    def mask_key(self) -> str | None:
        return self.key[:-4] + ".mask" if self.sums[2] is not None else None

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "split": self.split, "group": self.group, "tokens": self.tokens,
                "documents": self.documents, "sums": list(self.sums)}


@dataclass(frozen=True)
class Tokenizer:
    name: str  # "bytes", or worker.hf.HFTokenizer.name (a hash of the whole tokenizer)
    vocab_size: int
    separator: int  # the token after every document


@dataclass(frozen=True)
class Index:
    settings: dict[str, Any]  # what the prepare was asked (tokenizer, fields, held-out fraction, ...)
    tokenizer: Tokenizer
    dtype: str
    masked: bool  # fine-tuning data: a mask beside every shard
    shards: tuple[Shard, ...]
    documents: int
    skipped: int  # bad records skipped with --skip-bad
    empty: int = 0  # documents with no text, dropped (0 in an index written before they were counted)

    @property
    def width(self) -> int:
        return DTYPES[self.dtype]

    def split(self, name: str) -> list[Shard]:
        return [s for s in self.shards if s.split == name]

    def to_json(self) -> dict[str, Any]:
        t = self.tokenizer
        return {"format": FORMAT, "settings": self.settings, "dtype": self.dtype, "masked": self.masked,
                "tokenizer": {"name": t.name, "vocab_size": t.vocab_size, "separator": t.separator},
                "documents": self.documents, "skipped": self.skipped, "empty": self.empty,
                "tokens": {s: sum(x.tokens for x in self.split(s)) for s in SPLITS},
                "shards": [s.to_json() for s in self.shards]}


class _Problems:
    def __init__(self, where: str) -> None:
        self.where, self.items = where, []  # type: ignore[var-annotated]

    def need(self, ok: bool, what: str) -> bool:
        if not ok:
            self.items.append(what)
        return ok

    def integer(self, obj: dict, key: str, low: int = 0, high: int = 1 << 62) -> int | None:
        v = obj.get(key)
        ok = isinstance(v, int) and not isinstance(v, bool) and low <= v <= high
        return v if self.need(ok, f"{key} must be a whole number in [{low}, {high}], got {_short(v)}") else None

    def done(self, fix: str) -> None:
        if self.items:
            lines = "\n".join(f"  - {p}" for p in self.items[:20])
            more = f"\n  ... and {len(self.items) - 20} more" if len(self.items) > 20 else ""
            raise DatasetError(f"{self.where} is not a usable prepared dataset ({len(self.items)} problem(s)):\n"
                               f"{lines}{more}\n{fix}")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _shard(p: _Problems, obj: Any, i: int, masked: bool) -> Shard | None:
    if not p.need(isinstance(obj, dict), f"shards[{i}] must be an object, got {_short(obj)}"):
        return None
    key, split, group, sums = obj.get("key"), obj.get("split"), obj.get("group"), obj.get("sums")
    ok = p.need(isinstance(key, str) and _KEY.fullmatch(key) is not None,
                f"shards[{i}].key must name a file shards/NNNNNN-NNNN-NNNN.bin inside the dataset, got {_short(key)}")
    ok &= p.need(split in SPLITS, f"shards[{i}].split must be one of {', '.join(SPLITS)}, got {_short(split)}")
    ok &= p.need(isinstance(group, str) and 0 < len(group) <= 256, f"shards[{i}].group must be a short string")
    sums_ok = (isinstance(sums, list) and len(sums) == 3 and all(isinstance(s, str) and _HEX.fullmatch(s) for s in sums[:2])
               and (sums[2] is None if not masked else isinstance(sums[2], str) and _HEX.fullmatch(sums[2]) is not None))
    ok &= p.need(sums_ok, f"shards[{i}].sums must be 2 xxh3-128 hex digests and {'a third' if masked else 'null'}, "
                 f"got {_short(sums)}")
    tokens, documents = p.integer(obj, "tokens", 1), p.integer(obj, "documents", 1)
    if tokens is None or documents is None:
        return None
    ok &= p.need(documents <= tokens, f"shards[{i}] has more documents ({documents}) than tokens ({tokens})")
    return Shard(key, split, group, tokens, documents, tuple(sums)) if ok else None  # type: ignore[arg-type]


def parse_shards(p: _Problems, items: Any, masked: bool) -> list[Shard]:
    if not p.need(isinstance(items, list), f"shards must be a list, got {_short(items)}"):
        return []
    shards = [s for i, obj in enumerate(items) if (s := _shard(p, obj, i, masked)) is not None]
    keys = [s.key for s in shards]
    p.need(len(set(keys)) == len(keys), "two shards name the same file")
    p.need(len({s.group for s in shards}) <= MAX_GROUPS, f"more than {MAX_GROUPS} groups")
    return shards


def parse_index(obj: Any, where: str) -> Index:
    """The index of the dataset at `where`, checked whole; DatasetError listing every problem."""
    p = _Problems(where)
    fix = "Prepare it again (orchestrate data prepare ... --out URL) or point data.source at another dataset."
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise DatasetError(f"{where}/{INDEX} is not an islands dataset index (format {_short(found)}, expected "
                           f"{FORMAT!r}). {fix}")
    dtype, masked, tok, settings = obj.get("dtype"), obj.get("masked"), obj.get("tokenizer"), obj.get("settings")
    p.need(dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {_short(dtype)}")
    p.need(isinstance(masked, bool), f"masked must be true or false, got {_short(masked)}")
    p.need(isinstance(settings, dict), f"settings must be an object, got {_short(settings)}")
    tokenizer = None
    if p.need(isinstance(tok, dict) and isinstance(tok.get("name"), str), f"tokenizer must be an object with a name, got {_short(tok)}"):
        vocab = p.integer(tok, "vocab_size", 2, 1 << 32)
        separator = p.integer(tok, "separator", 0, (vocab or 2) - 1)
        tokenizer = Tokenizer(tok["name"], vocab or 2, separator or 0)
        p.need(dtype not in DTYPES or vocab is None or vocab <= 1 << (8 * DTYPES[dtype]),
               f"a vocabulary of {vocab} does not fit {dtype}")
    shards = parse_shards(p, obj.get("shards"), masked is True)
    documents = p.integer(obj, "documents", 1)
    skipped = p.integer(obj, "skipped", 0)
    empty = p.integer(obj, "empty", 0) if "empty" in obj else 0
    if documents is not None:
        p.need(documents == sum(s.documents for s in shards), "documents is not the sum of the shards' documents")
    p.need(any(s.split == "train" for s in shards), "no train shard")
    p.need(any(s.split == "eval" for s in shards), "no eval shard (the held-out split)")
    p.done(fix)
    return Index(settings, tokenizer, dtype, masked, tuple(shards), documents, skipped, empty)  # type: ignore[arg-type]


def parse_part(obj: Any, where: str, masked: bool) -> tuple[list[Shard], int, int] | None:
    """(shards, documents, skipped) of a unit's record, or None if it is not one (a resume redoes the unit)."""
    p = _Problems(where)
    if not isinstance(obj, dict):
        return None
    shards = parse_shards(p, obj.get("shards"), masked)
    documents, skipped = p.integer(obj, "documents", 0), p.integer(obj, "skipped", 0)
    if "empty" in obj:
        p.integer(obj, "empty", 0)
    p.need(documents == sum(s.documents for s in shards), "documents is not the sum of the shards' documents")
    return None if p.items else (shards, documents, skipped)  # type: ignore[return-value]


def expected_sizes(shard: Shard, width: int) -> dict[str, int]:
    """Bytes of each file of `shard`."""
    sizes = {shard.key: shard.tokens * width, shard.docs_key: shard.documents * 8}
    if shard.mask_key is not None:
        sizes[shard.mask_key] = shard.tokens
    return sizes


def listed_sizes(storage: Any) -> dict[str, int]:
    """{key: bytes} of every file under shards/ of the dataset at `storage`, from one listing (on an
    object store asking each file its size is a request); {} when it cannot be listed."""
    try:
        return {key: int(info["size"]) for key, info in storage.find("shards").items()}
    except OSError:
        return {}


def size_problems(shards: list[Shard] | tuple[Shard, ...], width: int, sizes: dict[str, int]) -> list[str]:
    """Each file of `shards` whose size in `sizes` (listed_sizes) is not the index's."""
    bad = []
    for shard in shards:
        for key, size in expected_sizes(shard, width).items():
            got = sizes.get(key)
            if got != size:
                bad.append(f"{key}: {'missing' if got is None else f'{got} bytes'}, the index says {size}")
    return bad


def verify_shard(shard: Shard, read: Any, width: int, vocab_size: int = 1 << 32) -> list[str]:
    """What is wrong with `shard`'s files (`read(key) -> bytes`, which refuses links and FIFOs):
    whether each can be read, sizes, checksums, document ends, token ids inside the vocabulary."""
    import numpy as np
    problems, sizes = [], expected_sizes(shard, width)
    for key, digest in zip((shard.key, shard.docs_key, shard.mask_key), shard.sums):
        if key is None:
            continue
        try:
            data = read(key)
        except (IslandsError, OSError) as exc:  # a link, a FIFO, a folder, missing: named, never followed
            problems.append(f"{key} cannot be read: {exc}")
            continue
        if key == shard.key and len(data) == sizes[key] and data:
            ids = np.frombuffer(data, dtype=f"<u{width}")
            if int(ids.max()) >= vocab_size:
                at = int(np.flatnonzero(ids >= vocab_size)[0])
                problems.append(f"{key} holds token id {int(ids[at])} at token {at}, past the vocabulary of {vocab_size}")
        if len(data) != sizes[key]:
            problems.append(f"{key} has {len(data)} bytes, the index says {sizes[key]}")
        elif checksum(data) != digest:
            problems.append(f"{key}: checksum does not match the index (damaged or replaced)")
        elif key == shard.docs_key:
            ends = np.frombuffer(data, dtype="<u8")
            if ends.size and (ends[-1] != shard.tokens or bool(np.any(np.diff(ends.astype(np.int64)) <= 0))):
                problems.append(f"{key}: document ends are not increasing up to the shard's {shard.tokens} tokens")
    return problems

