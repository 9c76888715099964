"""`orchestrate data prepare` (worker/prepare.py, worker/sources.py) and reading what it wrote.

Real files in every format (written here with the libraries users write them with: gzip, zstandard,
pyarrow, Hugging Face datasets), real processes for --procs and for a prepare killed mid-way.
"""
from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from core import dataset as fmt
from core.dataset import DatasetError
from orchestrator.cli import main
from worker.data import BatchSampler, Dataset, eval_batches
from worker.prepare import PrepareSpec, prepare
from worker.sources import Fields

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the of and to in is was for on that with by as at from his her an were are which this be or".split()


def _rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))), "source": f"s{i % 3}",
             "url": f"https://site{i % 4}.example.org/page/{i}"} for i in range(n)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    elif path.name.endswith(".zst"):
        import zstandard
        path.write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    else:
        path.write_text(text)
    return path


def _docs(url: str) -> list[bytes]:
    ds = Dataset(url)
    out = []
    for s in ds.index.shards:
        tokens, ends = ds.storage.read_bytes(s.key), np.frombuffer(ds.storage.read_bytes(s.docs_key), "<u8")
        out += [tokens[a:b - 1] for a, b in zip([0, *ends[:-1]], ends)]
    return sorted(out)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_every_format_gives_the_same_documents(tmp_path):
    rows = _rows(300)
    want = sorted(r["text"].encode() for r in rows)
    sources = {"jsonl": _jsonl(tmp_path / "a.jsonl", rows), "gz": _jsonl(tmp_path / "a.jsonl.gz", rows),
               "zst": _jsonl(tmp_path / "a.jsonl.zst", rows)}
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet", row_group_size=70)
    sources["parquet"] = tmp_path / "a.parquet"
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "hfdict"))
    sources.update(hf=tmp_path / "hf", hfdict=tmp_path / "hfdict")
    for name, src in sources.items():
        index = prepare(PrepareSpec((str(src),), str(tmp_path / f"out-{name}"), fields=Fields(group="source")))
        assert _docs(str(tmp_path / f"out-{name}")) == want, name
        assert {s.group for s in index.shards} == {"s0", "s1", "s2"} and index.documents == 300


def test_the_same_inputs_give_the_same_bytes_with_any_procs_and_after_a_kill(tmp_path):
    src = _jsonl(tmp_path / "big.jsonl", _rows(3000))
    script = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r})\n"
              "import worker.sources as S, worker.prepare as P\n"
              "S.UNIT_BYTES = 40_000\n"
              "real = P.prepare_unit\n"
              "def slow(*a, **k):\n    out = real(*a, **k); time.sleep(float(sys.argv[3])); return out\n"
              "P.prepare_unit = slow\n"
              "if __name__ == '__main__':\n"
              f"    P.prepare(P.PrepareSpec(({str(src)!r},), sys.argv[1], fields=P.Fields(group='url'), procs=int(sys.argv[2]),"
              " shard_tokens=30_000))\n")
    (tmp_path / "run.py").write_text(script)
    run = lambda out, procs, pause="0": subprocess.run([sys.executable, str(tmp_path / "run.py"), str(out), procs, pause],  # noqa: E731
                                                      check=True, capture_output=True, text=True)
    run(tmp_path / "one", "1")
    run(tmp_path / "two", "2")
    clean = _tree(tmp_path / "one")
    assert clean == _tree(tmp_path / "two") and len([k for k in clean if k.startswith("parts/")]) > 4
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(tmp_path / "run.py"), str(killed), "1", "0.3"])
    deadline = time.monotonic() + 60
    while not (killed / "parts" / "000002.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / fmt.INDEX).exists()
    first = (killed / "parts" / "000000.json").stat().st_mtime_ns
    run(killed, "1")
    assert _tree(killed) == clean and (killed / "parts" / "000000.json").stat().st_mtime_ns == first  # not redone


def test_a_bad_record_names_its_file_and_line_or_is_skipped_and_counted(tmp_path):
    lines = [json.dumps(r) for r in _rows(20)]
    lines[6] = '{"text": "cut off'
    lines[11] = json.dumps({"body": "no text field"})
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=r"bad.jsonl line 7: not a JSON object .*--skip-bad"):
        prepare(PrepareSpec((str(src),), str(tmp_path / "out")))
    index = prepare(PrepareSpec((str(src),), str(tmp_path / "skip"), skip_bad=True))
    assert index.skipped == 2 and index.documents == 18
    with pytest.raises(DatasetError, match=r"line 1: field 'content' is missing \(its fields: text, source, url\)"):
        prepare(PrepareSpec((str(src),), str(tmp_path / "field"), fields=Fields(text="content")))


def test_a_line_of_a_split_file_is_named_by_its_number(tmp_path, monkeypatch):
    import worker.sources as sources
    monkeypatch.setattr(sources, "UNIT_BYTES", 2_000)
    lines = [json.dumps(r) for r in _rows(60)]
    lines[40] = "[1, 2]"
    (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=r"big.jsonl line 41: a record must be a JSON object, got list"):
        prepare(PrepareSpec((str(tmp_path / "big.jsonl"),), str(tmp_path / "out")))


def test_sources_and_settings_that_cannot_be_prepared_are_clear_errors(tmp_path):
    src = _jsonl(tmp_path / "a.jsonl", _rows(50))
    with pytest.raises(DatasetError, match="does not exist"):
        prepare(PrepareSpec((str(tmp_path / "nope.jsonl"),), str(tmp_path / "o1")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no files to read"):
        prepare(PrepareSpec((str(tmp_path / "empty"),), str(tmp_path / "o2")))
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match="no document to train on"):
        prepare(PrepareSpec((str(tmp_path / "blank.jsonl"),), str(tmp_path / "o3")))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(DatasetError, match=r"p.parquet has no column 'text' \(its columns: body\)"):
        prepare(PrepareSpec((str(tmp_path / "p.parquet"),), str(tmp_path / "o4")))
    with pytest.raises(DatasetError, match="--tokenizer 'gpt2'"):
        prepare(PrepareSpec((str(src),), str(tmp_path / "o5"), tokenizer="gpt2"))
    prepare(PrepareSpec((str(src),), str(tmp_path / "o6")))
    with pytest.raises(DatasetError, match="prepared with other settings"):
        prepare(PrepareSpec((str(src),), str(tmp_path / "o6"), heldout=0.2))


def test_a_damaged_dataset_is_refused_before_use(tmp_path, capsys):
    out = tmp_path / "ds"
    prepare(PrepareSpec((str(_jsonl(tmp_path / "a.jsonl", _rows(200))),), str(out)))
    index = json.loads((out / fmt.INDEX).read_text())
    shard = out / index["shards"][0]["key"]
    data = bytearray(shard.read_bytes())
    data[5] ^= 1
    shard.write_bytes(bytes(data))
    assert main(["data", "check", str(out)]) == 2
    assert "checksum does not match the index" in capsys.readouterr().out
    shard.write_bytes(bytes(data[:-1]))
    with pytest.raises(DatasetError, match="does not match its index"):
        Dataset(str(out))
    for key, bad in (("../../etc/passwd", "inside the dataset"), ("shards/000000-0000-0000.bin", "two shards name")):
        forged = json.loads(json.dumps(index))
        forged["shards"][-1]["key"] = key
        (out / fmt.INDEX).write_text(json.dumps(forged))
        with pytest.raises(DatasetError, match=bad):
            Dataset(str(out))
    (out / fmt.INDEX).write_text(json.dumps({**index, "documents": "many", "dtype": "float64"}))
    with pytest.raises(DatasetError, match=r"(?s)problem\(s\).*dtype must be.*documents must be"):
        Dataset(str(out))


def test_fine_tuning_pairs_count_the_loss_of_the_response_only(tmp_path):
    pairs = [{"prompt": f"Q{i}: what is {i} + {i}? A:", "response": f" {2 * i}. Done."} for i in range(300)]
    src = _jsonl(tmp_path / "pairs.jsonl", pairs)
    prepare(PrepareSpec((str(src),), str(tmp_path / "sft"), fields=Fields(prompt="prompt", response="response")))
    ds = Dataset(str(tmp_path / "sft"))
    assert ds.index.masked
    sampler = BatchSampler(ds, 24, 8, seed=0, worker=0, num_workers=1)
    x, y = sampler.batch(3)
    assert bool((y >= 0).any(dim=1).all())  # a window whose targets are all prompt is drawn again
    assert bool((y == -1).any()) and torch.equal(x[:, 1:], torch.where(y[:, :-1] >= 0, y[:, :-1], x[:, 1:]))
    # the loss the model takes equals a hand-made masked cross-entropy
    logits = torch.randn(8, 24, 256, generator=torch.Generator().manual_seed(0))
    loss = F.cross_entropy(logits.view(-1, 256), y.reshape(-1), ignore_index=-1)
    keep = y.reshape(-1) >= 0
    picked = torch.log_softmax(logits.view(-1, 256), -1)[torch.arange(keep.numel()), y.reshape(-1).clamp(min=0)]
    assert torch.allclose(loss, -(picked[keep]).mean())


def test_response_masks_line_up_with_the_tokens(tmp_path):
    pairs = [{"prompt": "ab", "response": "XY"}, {"prompt": "cd", "response": "Z"}] * 40
    prepare(PrepareSpec((str(_jsonl(tmp_path / "p.jsonl", pairs)),), str(tmp_path / "sft"),
                        fields=Fields(prompt="prompt", response="response"), heldout=0.2))
    ds = Dataset(str(tmp_path / "sft"))
    for s in ds.index.shards:
        tokens, mask = ds.storage.read_bytes(s.key), ds.storage.read_bytes(s.mask_key)
        counted = bytes(t for t, m in zip(tokens, mask) if m)
        assert set(counted) <= set(b"XYZ\n") and bytes(t for t, m in zip(tokens, mask) if not m).strip(b"abcd") == b""


def test_a_dataset_reads_the_same_from_a_memory_map_and_from_an_object_store(tmp_path):
    out = tmp_path / "ds"
    prepare(PrepareSpec((str(_jsonl(tmp_path / "a.jsonl", _rows(400))),), str(out), fields=Fields(group="source")))
    import fsspec
    mem = fsspec.filesystem("memory")
    for p in out.rglob("*"):
        if p.is_file():
            mem.pipe_file(f"/ds-copy/{p.relative_to(out)}", p.read_bytes())
    local, remote = Dataset(str(out)), Dataset("memory://ds-copy")
    assert remote.storage.is_local is False
    for mode in ("iid", "non-iid"):
        a = BatchSampler(local, 32, 6, seed=5, worker=1, num_workers=2, mode=mode)
        b = BatchSampler(remote, 32, 6, seed=5, worker=1, num_workers=2, mode=mode)
        for step in (0, 9):
            assert all(torch.equal(p, q) for p, q in zip(a.batch(step), b.batch(step)))
    assert all(torch.equal(p[0], q[0]) for p, q in zip(eval_batches(local, 32, 4, 2, 0), eval_batches(remote, 32, 4, 2, 0)))


def test_the_cli_prepares_a_jsonl_corpus_that_a_run_trains_on(tmp_path, capsys):
    src = _jsonl(tmp_path / "a.jsonl.gz", _rows(600))
    out = tmp_path / "ds"
    assert main(["data", "prepare", str(src), "--out", str(out), "--group-field", "url", "--procs", "2"]) == 0
    said = capsys.readouterr().out
    assert "600 documents" in said and "4 group(s)" in said and f"data.source={out}" in said
    assert main(["data", "check", str(out)]) == 0
    run = tmp_path / "run"
    # 4 groups cannot be dealt whole to 5 workers: refused by submit, before a run or a job exists
    assert main(["submit", "--executor", "inline", "--run-dir", str(run), "--workers", "5", "--set", f"data.source={out}",
                 "--set", "data.sharding=non-iid"]) == 2
    said = "".join(capsys.readouterr())
    assert f"the 4 group(s) of {out}'s train split over 5 workers" in said and "--group-field" in said, said
    assert not run.exists() and "Traceback" not in said
    assert main(["submit", "--executor", "inline", "--run-dir", str(run), "--workers", "2", "--rounds", "2", "--inner-steps", "3",
                 "--set", f"data.source={out}", "--set", "data.sharding=non-iid", "--set", "model.n_layer=1",
                 "--set", "model.n_embd=32", "--set", "model.n_head=2", "--set", "model.block_size=32",
                 "--set", "inner.batch_size=4", "--set", "data.eval_batches=2", "--set", "round.poll_s=0.2"]) == 0
    assert "final eval loss" in capsys.readouterr().out


@pytest.mark.slow
def test_a_dataset_prepared_on_s3_is_trained_on_by_a_local_run(s3_server, tmp_path, monkeypatch, capsys):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{s3_server.bucket}/data/corpus"
    src = _jsonl(tmp_path / "a.jsonl.zst", _rows(400))
    assert main(["data", "prepare", str(src), "--out", url]) == 0
    run = tmp_path / "run"
    assert main(["submit", "--executor", "inline", "--run-dir", str(run), "--workers", "2", "--rounds", "1", "--inner-steps", "3",
                 "--set", f"data.source={url}", "--set", "model.n_layer=1", "--set", "model.n_embd=32",
                 "--set", "model.n_head=2", "--set", "model.block_size=32", "--set", "inner.batch_size=4",
                 "--set", "data.eval_batches=2", "--set", "round.poll_s=0.2"]) == 0
    assert "final eval loss" in capsys.readouterr().out
    assert os.path.exists(run / "final" / "model.safetensors")


def test_chat_messages_count_the_assistant_turns_only(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.test_hf import _tiny_hf
    model = _tiny_hf(tmp_path / "model")
    tok = transformers.AutoTokenizer.from_pretrained(model)
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok.save_pretrained(model)
    chats = [{"messages": [{"role": "user", "content": f"add {i} and {i}"}, {"role": "assistant", "content": f"it is {2 * i}"},
                           {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "you are welcome"}]}
             for i in range(60)]
    src = _jsonl(tmp_path / "chat.jsonl", chats)
    with pytest.raises(DatasetError, match="needs --tokenizer hf:DIR"):
        prepare(PrepareSpec((str(src),), str(tmp_path / "no"), fields=Fields(messages="messages")))
    prepare(PrepareSpec((str(src),), str(tmp_path / "chat"), tokenizer=f"hf:{model}", fields=Fields(messages="messages"),
                        heldout=0.2))
    ds = Dataset(str(tmp_path / "chat"))
    assert ds.index.masked and ds.index.documents == 60
    shard = ds.index.split("train")[0]
    tokens = np.frombuffer(ds.storage.read_bytes(shard.key), "<u2")
    mask = np.frombuffer(ds.storage.read_bytes(shard.mask_key), np.uint8)
    ends = np.frombuffer(ds.storage.read_bytes(shard.docs_key), "<u8")
    first = slice(0, int(ends[0]))
    counted = tok.decode(tokens[first][mask[first] == 1].tolist())
    assert counted.startswith("it is ") and counted.endswith("you are welcome")
    assert "<assistant>" not in counted and "add" not in counted and "thanks" not in counted
    assert tok.decode(tokens[first][:-1].tolist()) in {tok.apply_chat_template(c["messages"], tokenize=False) for c in chats}


def test_a_group_field_with_too_many_values_stops_the_unit_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(fmt, "MAX_GROUPS", 3)
    src = _jsonl(tmp_path / "a.jsonl", _rows(100))  # every text differs: 100 values
    with pytest.raises(DatasetError, match="--group-field 'text' has more than 3 values: it is not a group"):
        prepare(PrepareSpec((str(src),), str(tmp_path / "out"), fields=Fields(group="text")))
    assert not any((tmp_path / "out").rglob("*.json"))  # no unit record, no index


class _Recorder:
    """A progress renderer (core.progress) that keeps every advance: what a bar would be told."""

    def __init__(self) -> None:
        self.moves: list[float] = []
        self.total = None

    def __call__(self, total, desc, unit):
        self.total = total
        return self

    def advance(self, n: float = 1) -> None:
        if n:
            self.moves.append(n)

    def note(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("procs", [1, 2])
def test_progress_moves_within_a_unit_and_adds_up_to_the_input(tmp_path, monkeypatch, procs):
    """The bar hears of input bytes as they are read, not once per 16 MB unit: a unit of 1.5 MB
    moves it many times (one process) or at every poll while a pool works (a pause per batch keeps
    the pool busy for several polls), and the moves add up to the input's size."""
    from core import progress
    src = _jsonl(tmp_path / "in.jsonl", _rows(6000))
    monkeypatch.setattr("worker.sources.UNIT_BYTES", src.stat().st_size // 2 + 1)  # two units
    monkeypatch.setenv("ISLANDS_SLOWPOINT", "prepare.batch=0.2")  # each unit lasts several of the pool's polls
    rec = _Recorder()
    previous = progress.set_renderer(rec)
    try:
        prepare(PrepareSpec((str(src),), str(tmp_path / "out"), procs=procs))
    finally:
        progress.set_renderer(previous)
    assert sum(rec.moves) == pytest.approx(src.stat().st_size / 1e6) and rec.total == pytest.approx(sum(rec.moves))
    assert len(rec.moves) >= 6, rec.moves  # not one move per unit


def test_empty_documents_are_dropped_and_counted(tmp_path, capsys):
    rows = _rows(200)
    for i in (3, 50, 120):
        rows[i]["text"] = ""
    src = _jsonl(tmp_path / "in.jsonl", rows)
    assert main(["data", "prepare", str(src), "--out", str(tmp_path / "out")]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "197 documents (0 bad records skipped, 3 empty documents dropped)" in said, said
    index = fmt.parse_index(json.loads((tmp_path / "out" / fmt.INDEX).read_text()), "index")
    assert index.documents == 197 and index.empty == 3


def test_data_prepare_on_a_terminal_shows_the_bar_moving_within_a_unit(tmp_path):
    """The real command in an 80-column pty: one 16 MB unit's worth of input no longer sits at 0% until
    it ends; the bar passes through several percentages (each batch slowed by a slowpoint, as a
    tokenizer slower than the byte one would), and the last line counts the empty documents."""
    import re as _re
    from terminal_support import in_a_terminal
    rows = _rows(1500)
    rows[10]["text"] = ""
    src = _jsonl(tmp_path / "in.jsonl", rows)
    cmd = ["env", "ISLANDS_SLOWPOINT=prepare.batch=0.3", sys.executable, "-m", "orchestrator.cli", "data", "prepare",
           str(src), "--out", str(tmp_path / "out")]
    raw, lines = in_a_terminal(cmd, cols=80, rows=40)
    shown = {int(p) for p in _re.findall(r"preparing[^\r\n]*?\s(\d+)%", raw.decode(errors="replace"))}
    assert len({p for p in shown if 0 < p < 100}) >= 3, shown
    assert "1 empty documents dropped" in " ".join(lines), lines


def test_a_group_value_that_only_looks_like_a_url_is_its_own_group(tmp_path, capsys):
    """`http://[::1` is no URL (urlsplit refuses it): the record is kept, its value its group, not
    reported as `not a JSON object`."""
    rows = [{"text": f"doc {i} " * 30, "url": u} for i, u in enumerate(["http://[::1", "https://a.org/x", "http://[::1"])]
    src = _jsonl(tmp_path / "a.jsonl", rows)
    out = tmp_path / "ds"
    assert main(["data", "prepare", str(src), "--out", str(out), "--group-field", "url", "--heldout", "0.3"]) == 0
    said = capsys.readouterr().out
    assert "3 documents" in said and "2 group(s)" in said and "not a JSON object" not in said, said
