"""What `orchestrate data prepare` reads: sources listed into units of work, units read as records.

A source is a file or a folder at any fsspec URL. Files are read by their names: `*.jsonl`,
`*.ndjson` (optionally `.gz` or `.zst`: fsspec's inferred compression, zstandard for zst) one JSON
object a line, parsed by the standard library's json; `*.parquet` through pyarrow (only the
columns asked for, a row group at a time); any other file is one plain-text document. A folder
saved by Hugging Face `datasets` (`save_to_disk`: state.json and Arrow stream files, or a
DatasetDict's dataset_dict.json, whose `train` split is read) is read with pyarrow's IPC reader,
so `datasets` itself is not needed. Hidden entries (.git, editor files) are skipped.

A unit is a piece one process prepares on its own: a batch of text files, a byte range of an
uncompressed JSON-lines file (a line belongs to the range its first byte is in), a whole compressed
file, a run of parquet row groups, or one Arrow file. Units are listed in a fixed order, so the
prepared bytes never depend on how many processes did the work.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import fsspec

from core.dataset import DatasetError

log = logging.getLogger(__name__)

UNIT_BYTES = 16 << 20
"""Input bytes of one unit of work (a progress step; a resumed prepare redoes at most one per process)."""
RECORD_CAP = 64 << 20
"""The most bytes one record may take (a JSON line, a text file): past it the record is bad, so that
memory stays bounded whatever the input (a 0.1 MB .zst can hold a 4 GB line)."""
_JSONL = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".jsonl.zst", ".ndjson.zst")
_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Fields:
    """Which record fields are read (JSON lines, parquet and Arrow rows; text files are whole documents)."""
    text: str = "text"
    prompt: str | None = None  # with `response`: fine-tuning pairs, the loss on the response only
    response: str | None = None
    group: str | None = None  # documents of one value form one group (non-iid sharding); a URL: its host
    messages: str | None = None  # chat: a list of {role, content}; the loss on the assistant's turns only

    @property
    def masked(self) -> bool:
        return self.response is not None or self.messages is not None

    def _names(self) -> list[str]:
        if self.messages:
            return [self.messages]
        return [self.prompt, self.response] if self.response else [self.text]  # type: ignore[list-item]

    def columns(self) -> list[str]:
        return self._names() + ([self.group] if self.group else [])


@dataclass(frozen=True)
class Unit:
    kind: str  # text | jsonl | parquet | arrow
    url: str  # the file (text: unused, see files)
    rel: str  # its name under the source, in ids and messages
    size: int  # input bytes, for progress
    start: int = 0  # jsonl: byte range (end 0: the whole file); parquet: row groups [start, end)
    end: int = 0
    files: tuple[tuple[str, str], ...] = field(default=())  # text: (rel, url) of each file


@dataclass(frozen=True)
class Record:
    id: str  # stable: the held-out split is decided by it
    where: str  # file and line or row, for messages
    group: str
    text: str = ""
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) of each turn
    read: int = 0  # input bytes of its unit read through this record, for progress (0: not known until the end)


class BadRecord(DatasetError):
    def __init__(self, where: str, why: str) -> None:
        self.where, self.why = where, why
        super().__init__(f"{where}: {why}")


def is_records(name: str) -> bool:
    """Does a file of this name hold records (JSON lines or parquet) rather than text?"""
    return _kind(name) != "text"


def _kind(name: str) -> str:
    lower = name.lower()
    if lower.endswith(_JSONL):
        return "jsonl"
    return "parquet" if lower.endswith(".parquet") else "text"


def _visible(rel: str) -> bool:
    return not any(part.startswith(".") for part in rel.split("/"))


def plan_units(sources: list[str], fields: Fields) -> list[Unit]:
    """Every source's units, in order; a DatasetError naming a source that is missing or empty."""
    units: list[Unit] = []
    for source in sources:
        try:
            fs, root = fsspec.core.url_to_fs(source)
            protocol = source.split("://", 1)[0] + "://" if "://" in source else ""
            if not fs.exists(root):
                raise DatasetError(f"source {source} does not exist; give a file or folder of text, JSON lines, parquet "
                                   "or a Hugging Face datasets folder")
            found = _units_of(fs, root.rstrip("/"), protocol)
        except DatasetError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever a source's reader raises, one error naming it
            raise DatasetError(f"source {source} cannot be read ({describe(exc)}); check that it is a file or folder of "
                               "text, JSON lines (.gz/.zst), parquet or a Hugging Face datasets folder") from None
        if not found:
            raise DatasetError(f"source {source} has no files to read (hidden entries are skipped)")
        units += found
    return units


def describe(exc: BaseException) -> str:
    """An exception as one short clause of a message."""
    return f"{type(exc).__name__}: {str(exc)[:200]}" if str(exc) else type(exc).__name__


def _regular(info: dict) -> dict:
    """`info` of a regular file; DatasetError for a FIFO, a device or a socket (reading one would
    block or never end)."""
    if info.get("type") != "file":
        raise DatasetError(f"{info.get('name')} is not a regular file ({info.get('type')}: a named pipe, a device "
                           "or a socket); data prepare reads only files and folders")
    return info


def _units_of(fs: Any, root: str, protocol: str) -> list[Unit]:
    if not fs.isdir(root):
        return _file_units(fs, _regular(fs.info(root)), posixpath.basename(root), protocol)
    if fs.exists(f"{root}/dataset_dict.json") or fs.exists(f"{root}/state.json"):
        return _arrow_units(fs, root, protocol)
    found = fs.find(root, detail=True).values()
    for other in (i for i in found if i["type"] != "file" and _visible(i["name"][len(root) + 1:])):
        log.warning("%s is not a regular file (%s): skipped", other["name"], other["type"])
    infos = sorted((i for i in found if i["type"] == "file"), key=lambda i: i["name"])
    units, texts, size = [], [], 0
    for info in infos:
        rel = info["name"][len(root) + 1:]
        if not _visible(rel):
            continue
        if _kind(rel) != "text":
            units += _file_units(fs, info, rel, protocol)
            continue
        texts.append((rel, protocol + info["name"]))
        size += info["size"]
        if size >= UNIT_BYTES:
            units.append(Unit("text", "", texts[0][0], size, files=tuple(texts)))
            texts, size = [], 0
    if texts:
        units.append(Unit("text", "", texts[0][0], size, files=tuple(texts)))
    return units


def _file_units(fs: Any, info: dict, rel: str, protocol: str) -> list[Unit]:
    url, size, kind = protocol + info["name"], int(info["size"]), _kind(rel)
    if kind == "text":
        return [Unit("text", "", rel, size, files=((rel, url),))]
    if kind == "jsonl":
        if fsspec.utils.infer_compression(rel) is not None or size <= UNIT_BYTES:
            return [Unit("jsonl", url, rel, size)]  # end 0: to the end of the (decompressed) file
        return [Unit("jsonl", url, rel, min(UNIT_BYTES, size - a), a, min(a + UNIT_BYTES, size))
                for a in range(0, size, UNIT_BYTES)]
    import pyarrow.parquet as pq
    with fs.open(info["name"], "rb") as f:
        meta = pq.ParquetFile(f).metadata
    units, first, acc = [], 0, 0
    for g in range(meta.num_row_groups):
        acc += meta.row_group(g).total_byte_size
        if acc >= UNIT_BYTES or g == meta.num_row_groups - 1:
            units.append(Unit("parquet", url, rel, acc, first, g + 1))
            first, acc = g + 1, 0
    return units


def _arrow_units(fs: Any, root: str, protocol: str) -> list[Unit]:
    folder = root
    if fs.exists(f"{root}/dataset_dict.json"):
        splits = _json(fs, f"{root}/dataset_dict.json").get("splits", [])
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise DatasetError(f"{root}/dataset_dict.json: its splits must be a list of names, got {str(splits)[:80]}")
        if "train" not in splits:
            raise DatasetError(f"{root} is a Hugging Face DatasetDict without a train split (splits: {splits}); "
                               f"give the folder of the split to prepare, e.g. {root}/{splits[0] if splits else 'SPLIT'}")
        folder = f"{root}/train"
    files = _json(fs, f"{folder}/state.json").get("_data_files", [])
    names = [f.get("filename") for f in files if isinstance(f, dict)] if isinstance(files, list) else []
    if not names or not all(isinstance(n, str) and "/" not in n and _visible(n) for n in names):
        raise DatasetError(f"{folder}/state.json lists no usable Arrow files ({names!r}); save the dataset again "
                           "with save_to_disk")
    return [Unit("arrow", f"{protocol}{folder}/{n}", posixpath.relpath(f"{folder}/{n}", root),
                 int(_regular(fs.info(f"{folder}/{n}"))["size"])) for n in names]


def _json(fs: Any, path: str) -> dict:
    try:
        info = _regular(fs.info(path))
        if info["size"] > 1 << 20:  # a few hundred bytes when datasets writes it
            raise ValueError(f"{info['size']} bytes, more than a datasets folder's JSON holds")
        obj = json.loads(fs.cat_file(path))
    except (OSError, ValueError, RecursionError) as exc:
        raise DatasetError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{path} is not a JSON object")
    return obj


# ----------------------------------------------------------------------------- reading a unit


def records(unit: Unit, fields: Fields) -> Iterator[Record | BadRecord]:
    """The unit's records in order; a bad one is yielded as a BadRecord (the caller stops or skips)."""
    if unit.kind == "text":
        yield from _text_records(unit)
    elif unit.kind == "jsonl":
        yield from _jsonl_records(unit, fields)
    else:
        yield from _table_records(unit, fields)


def _text_records(unit: Unit) -> Iterator[Record | BadRecord]:
    read = 0
    for rel, url in unit.files:
        with fsspec.open(url, "rb") as f:
            data = f.read(RECORD_CAP + 1)
        read += len(data)
        if len(data) > RECORD_CAP:
            yield BadRecord(rel, f"larger than {RECORD_CAP >> 20} MB, the cap on one document")
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield BadRecord(rel, f"not UTF-8 text (byte {exc.start})")
            continue
        parts = rel.split("/")
        yield Record(rel, rel, parts[0] if len(parts) > 1 else "_toplevel", text, read=read)


def _jsonl_records(unit: Unit, fields: Fields) -> Iterator[Record | BadRecord]:
    with fsspec.open(unit.url, "rb", compression="infer") as raw:
        # zstandard's reader has no readline: a buffer over it gives one
        f = io.BufferedReader(raw, 1 << 20) if fsspec.utils.infer_compression(unit.rel) == "zstd" else raw
        plain = fsspec.utils.infer_compression(unit.rel) is None  # a compressed file's position is not its size's
        pos, line_no = 0, 0
        if unit.start:
            f.seek(unit.start - 1)
            pos, line_no = unit.start - 1 + len(f.readline()), None  # that line is the previous range's
        while not unit.end or pos < unit.end:
            line = f.readline(RECORD_CAP + 1)
            if not line:
                break
            if line_no is not None:
                line_no += 1
            at, pos = pos, pos + len(line)
            if len(line) > RECORD_CAP and not line.endswith(b"\n"):  # never held whole: skipped in pieces
                yield BadRecord(f"{unit.rel} line {line_no if line_no is not None else _line_at(unit.url, at)}",
                                f"longer than {RECORD_CAP >> 20} MB, the cap on one record")
                while line and not line.endswith(b"\n"):
                    line = f.readline(1 << 20)
                    pos += len(line)
                continue
            if not line.strip():
                continue
            where = f"{unit.rel} line {line_no}" if line_no is not None else f"{unit.rel} at byte {at}"
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError) as exc:
                rec = BadRecord("", f"not a JSON object ({str(exc)[:120]})")
            else:
                rec = _record(obj, f"{unit.rel}@{at}", where, fields)
            if isinstance(rec, BadRecord):  # only now is the line's number worth counting
                rec = BadRecord(f"{unit.rel} line {line_no if line_no is not None else _line_at(unit.url, at)}", rec.why)
            elif plain:
                rec = replace(rec, read=pos - unit.start)
            yield rec


def _line_at(url: str, offset: int) -> int:
    """The line number of the byte at `offset` (for a message: counts the lines before it)."""
    n, done = 1, 0
    with fsspec.open(url, "rb") as f:
        while done < offset:
            chunk = f.read(min(1 << 24, offset - done))
            if not chunk:
                break
            n, done = n + chunk.count(b"\n"), done + len(chunk)
    return n


def _table_records(unit: Unit, fields: Fields) -> Iterator[Record | BadRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    with fsspec.open(unit.url, "rb") as f:
        if unit.kind == "parquet":
            pf = pq.ParquetFile(f)
            names = pf.schema_arrow.names
            row = sum(pf.metadata.row_group(g).num_rows for g in range(unit.start))
            first, rows = row, max(1, sum(pf.metadata.row_group(g).num_rows for g in range(unit.start, unit.end)))
            read = lambda: unit.size * (row - first) // rows  # noqa: E731 -- rows read, as a share of its bytes
            _need_columns(unit, names, fields)
            batches = pf.iter_batches(batch_size=_BATCH_ROWS, row_groups=range(unit.start, unit.end), columns=fields.columns())
        else:
            reader = pa.ipc.open_stream(f)
            names, row = reader.schema.names, 0
            read = f.tell  # a stream read front to back
            _need_columns(unit, names, fields)
            batches = reader
        for batch in batches:
            cols = {name: batch.column(name).to_pylist() for name in fields.columns()}
            for i in range(batch.num_rows):
                rec = _record({k: v[i] for k, v in cols.items()}, f"{unit.rel}#{row}", f"{unit.rel} row {row}", fields)
                row += 1
                yield rec if isinstance(rec, BadRecord) else replace(rec, read=read())


def _need_columns(unit: Unit, names: list[str], fields: Fields) -> None:
    missing = [c for c in fields.columns() if c not in names]
    if missing:
        raise DatasetError(f"{unit.rel} has no column {', '.join(map(repr, missing))} (its columns: {', '.join(names)}); "
                           "name the right one with --text-field, --prompt-field/--response-field or --group-field")


def _record(obj: Any, rid: str, where: str, fields: Fields) -> Record | BadRecord:
    if not isinstance(obj, dict):
        return BadRecord(where, f"a record must be a JSON object, got {type(obj).__name__}")
    group = "_all"
    if fields.group:
        value = obj.get(fields.group)
        if value is None or isinstance(value, (dict, list)):
            return BadRecord(where, f"field {fields.group!r} (--group-field) is missing or not a single value")
        group = str(value)
        if group.startswith(("http://", "https://")):
            with contextlib.suppress(ValueError):  # not a URL after all (`http://[`): the value is the group
                group = urlsplit(group).hostname or group
        group = group[:256] or "_empty"
    if fields.messages:
        return _chat(obj.get(fields.messages), rid, where, group, fields.messages)
    names = fields._names()
    values = [obj.get(n) for n in names]
    for n, v in zip(names, values):
        if not isinstance(v, str):
            what = "missing" if n not in obj else f"a {type(v).__name__}, not a string"
            return BadRecord(where, f"field {n!r} is {what} (its fields: {', '.join(list(obj)[:10])})")
        if not _utf8(v):
            return BadRecord(where, f"field {n!r} holds a lone surrogate (a \\ud800-\\udfff escape not in a pair): "
                                    "not text")
    if fields.response:
        return Record(rid, where, group, values[1], prompt=values[0])
    return Record(rid, where, group, values[0])


def _utf8(text: str) -> bool:
    """Can `text` be written as UTF-8 (JSON may decode a lone surrogate, which cannot)?"""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _chat(value: Any, rid: str, where: str, group: str, name: str) -> Record | BadRecord:
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        and _utf8(m["role"]) and _utf8(m["content"]) for m in value)
    if not ok:
        return BadRecord(where, f"field {name!r} must be a list of {{role, content}} messages (strings), got "
                                f"{str(value)[:80]}")
    return Record(rid, where, group, messages=tuple((m["role"], m["content"]) for m in value))
