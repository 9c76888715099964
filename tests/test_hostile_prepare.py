"""`orchestrate data prepare` on damaged, hostile or careless inputs: every failure is one error
naming the file (and the line where there is one), exit 2, no traceback, nothing of anyone else's
overwritten, memory bounded whatever the compression ratio, nothing that blocks. Real files and the
real CLI (in this process; in a child process where its peak memory is measured).
"""
from __future__ import annotations

import gzip
import io
import json
import os
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from orchestrator.cli import main
from worker.sources import RECORD_CAP

LINES = b"".join(json.dumps({"text": f"document number {i} " * 20}).encode() + b"\n" for i in range(50))


def _parquet() -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": [f"row {i} " * 20 for i in range(50)]}), buf)
    return buf.getvalue()


def _hf(folder: Path, state: bytes | None = None, arrow: bytes | None = None, link: str | None = None) -> Path:
    """A datasets save_to_disk folder (one Arrow stream file), or one whose state.json / Arrow file is `state` / `arrow`."""
    folder.mkdir()
    (folder / "state.json").write_bytes(state if state is not None else
                                        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}).encode())
    data = folder / "data-00000-of-00001.arrow"
    if link:
        os.symlink(link, data)
    else:
        data.write_bytes(arrow if arrow is not None else b"")
    return folder


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    (tmp_path / name).write_bytes(data)
    return tmp_path / name


CASES = {  # name -> (make the source under tmp_path, what the error must say besides the file's name)
    "gzip-truncated": (lambda t: _write(t, "c.jsonl.gz", gzip.compress(LINES)[:-40]), "c.jsonl.gz"),
    "gzip-not-gzip": (lambda t: _write(t, "c.jsonl.gz", LINES), "c.jsonl.gz"),
    "zstd-garbage": (lambda t: _write(t, "c.jsonl.zst", os.urandom(4096)), "c.jsonl.zst"),
    "parquet-garbage": (lambda t: _write(t, "c.parquet", os.urandom(4096)), "c.parquet"),
    "parquet-truncated": (lambda t: _write(t, "c.parquet", _parquet()[:-300]), "c.parquet"),
    "parquet-garbled": (lambda t: _write(t, "c.parquet", _parquet()[:200] + os.urandom(600) + _parquet()[800:]),
                        "c.parquet"),
    "hf-state-deep": (lambda t: _hf(t / "hf", state=b"[" * 100_000 + b"]" * 100_000), "state.json"),
    "hf-state-list": (lambda t: _hf(t / "hf", state=b"[1, 2]"), "state.json"),
    "hf-files-not-a-list": (lambda t: _hf(t / "hf", state=b'{"_data_files": "x.arrow"}'), "state.json"),
    "hf-dict-splits-int": (lambda t: _dict(t, b'{"splits": 7}'), "dataset_dict.json"),
    "hf-dict-deep": (lambda t: _dict(t, b"{" * 50_000), "dataset_dict.json"),
    "arrow-garbage": (lambda t: _hf(t / "hf", arrow=os.urandom(4096)), "data-00000-of-00001.arrow"),
    "arrow-link-to-passwd": (lambda t: _hf(t / "hf", link="/etc/passwd"), "data-00000-of-00001.arrow"),
    "lone-surrogate": (lambda t: _write(t, "c.jsonl", LINES + b'{"text": "a \\ud800 b"}\n'), "c.jsonl line 51"),
    "unknown-scheme": (lambda t: "nosuchscheme://bucket/corpus.jsonl", "nosuchscheme://bucket/corpus.jsonl"),
}


def _dict(t: Path, raw: bytes) -> Path:
    (t / "dd").mkdir()
    (t / "dd" / "dataset_dict.json").write_bytes(raw)
    return t / "dd"


def _prepare(capsys, *args: str) -> tuple[int, str]:
    rc = main(["data", "prepare", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_input_is_one_error_naming_it(tmp_path, capsys, case):
    make, where = CASES[case]
    rc, text = _prepare(capsys, make(tmp_path), "--out", tmp_path / "out")
    assert rc == 2 and "Traceback" not in text, text
    assert where in text and text.startswith("error:"), text
    assert not (tmp_path / "out" / "index.json").exists()


def test_a_lone_surrogate_is_a_bad_record_that_skip_bad_counts(tmp_path, capsys):
    src = _write(tmp_path, "c.jsonl", LINES + b'{"text": "a \\ud800 b"}\n')
    rc, text = _prepare(capsys, src, "--out", tmp_path / "out", "--skip-bad")
    assert rc == 0 and "(1 bad records skipped)" in text, text


def test_a_file_deleted_after_planning_is_one_error_naming_it(tmp_path):
    from core.dataset import DatasetError
    from worker.prepare import PrepareSpec, prepare
    from worker.sources import Fields, plan_units
    for i in range(2):
        _write(tmp_path, f"c{i}.jsonl", LINES)
    spec = PrepareSpec((str(tmp_path),), str(tmp_path / "out"), "bytes", Fields(), 0.2)
    units = plan_units(list(spec.sources), spec.fields)
    (tmp_path / "c1.jsonl").unlink()  # gone between the listing and the read
    with pytest.raises(DatasetError, match=r"c1.jsonl cannot be read past its start \(FileNotFoundError"):
        prepare(spec, units)


def _blocks_not(fn, seconds: float = 30.0):
    out: list = []
    th = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    th.start()
    th.join(seconds)
    assert out, f"blocked for {seconds}s on a named pipe"
    return out[0]


def test_a_fifo_as_a_source_or_in_a_folder_never_blocks(tmp_path, capsys):
    os.mkfifo(tmp_path / "pipe.jsonl")
    rc = _blocks_not(lambda: main(["data", "prepare", str(tmp_path / "pipe.jsonl"), "--out", str(tmp_path / "o1")]))
    assert rc == 2 and "not a regular file" in capsys.readouterr().out
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(LINES)
    os.mkfifo(folder / "b.jsonl")
    rc = _blocks_not(lambda: main(["data", "prepare", str(folder), "--out", str(tmp_path / "o2")]))
    assert rc == 0, capsys.readouterr().out  # the pipe is skipped, with a warning
    hf = _hf(tmp_path / "hf")
    (hf / "state.json").unlink()
    os.mkfifo(hf / "state.json")
    rc = _blocks_not(lambda: main(["data", "prepare", str(hf), "--out", str(tmp_path / "o3")]))
    assert rc == 2 and "state.json" in capsys.readouterr().out


def test_out_at_a_folder_of_other_files_is_refused_and_they_are_untouched(tmp_path, capsys):
    src = _write(tmp_path, "c.jsonl", LINES)
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    (out / "shards").mkdir()
    rc, text = _prepare(capsys, src, "--out", out)
    assert rc == 2 and "already holds other files (thesis.tex)" in text, text
    assert sorted(p.name for p in out.iterdir()) == ["shards", "thesis.tex"] and not any((out / "shards").iterdir())
    rc, text = _prepare(capsys, src, "--out", out / "thesis.tex")
    assert rc == 2 and "is a file, not a folder" in text, text
    rc, text = _prepare(capsys, src, "--out", tmp_path / "mine")  # and its own dataset, again: already prepared
    assert rc == 0 and _prepare(capsys, src, "--out", tmp_path / "mine")[0] == 0


def test_procs_are_capped_at_the_work_and_the_cores(tmp_path, caplog):
    from worker.prepare import PrepareSpec, prepare
    from worker.sources import Fields
    for i in range(3):
        _write(tmp_path, f"c{i}.parquet", _parquet())  # a unit each
    spec = PrepareSpec((str(tmp_path),), str(tmp_path / "out"), "bytes", Fields(), 0.2, procs=10000)
    with caplog.at_level("INFO", logger="worker.prepare"):
        assert prepare(spec).documents == 150
    cores = os.cpu_count() or 1
    assert f"--procs 10000: {min(3, cores)} processes (3 unit(s) to prepare, {cores} cores)" in caplog.text


@pytest.mark.slow
def test_a_huge_line_in_a_tiny_zst_is_one_bad_record_in_bounded_memory(tmp_path, capsys):
    """512 MB of one line in about 16 KB of zstd: refused as longer than the cap, read in pieces,
    the other records prepared. The line is never held whole: the peak of Python's allocations
    (tracemalloc, which counts every bytes object) stays near the cap, far below the line."""
    import tracemalloc
    src = tmp_path / "bomb.jsonl.zst"
    with open(src, "wb") as f, zstandard.ZstdCompressor().stream_writer(f) as z:
        z.write(LINES)
        z.write(b'{"text": "')
        block = b"a" * (1 << 20)
        for _ in range(512):
            z.write(block)
        z.write(b'"}\n')
        z.write(LINES)
    assert src.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        rc, text = _prepare(capsys, src, "--out", tmp_path / "out", "--skip-bad")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rc == 0 and "(1 bad records skipped)" in text, text
    assert peak < 3 * RECORD_CAP, f"{peak / 2**20:.0f} MB"  # the line is 512 MB
    rc, text = _prepare(capsys, src, "--out", tmp_path / "out2")
    assert rc == 2 and "bomb.jsonl.zst line 51: longer than 64 MB" in text, text
