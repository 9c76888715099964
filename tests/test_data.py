"""worker/data.py: the text corpus prepared into the cache, a worker's share, its batches, the eval split.

On the real standard library and on small temporary folders; the prepare itself (formats, resume,
bad input) is tests/test_prepare.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from core.config import Config, config_from_dict, replace
from core.dataset import DatasetError
from worker import data
from worker.data import BatchSampler, Dataset, dataset_for, eval_batches
from worker.tasks.lm import LanguageModel
from worker.model import GPT


def _cfg(cache: Path, **data_keys) -> Config:
    return config_from_dict({"data": {"cache_dir": str(cache), **data_keys}})


@pytest.fixture(scope="session")
def stdlib(corpus_cache) -> Dataset:
    return dataset_for(_cfg(Path(corpus_cache)))


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)
    return root


def documents(ds: Dataset, split: str | None = None) -> list[bytes]:
    """Every document of the dataset (or of one split), its tokens as bytes, separator excluded."""
    out = []
    for s in ds.index.shards:
        if split is None or s.split == split:
            tokens = ds.storage.read_bytes(s.key)
            ends = np.frombuffer(ds.storage.read_bytes(s.docs_key), dtype="<u8")
            starts = [0, *ends[:-1]]
            out += [tokens[a:b - 1] for a, b in zip(starts, ends)]
    return out


# ----------------------------------------------------------------------------- the text corpus, prepared once


def test_the_stdlib_is_a_prepared_dataset_of_its_python_files(stdlib):
    idx = stdlib.index
    assert idx.dtype == "uint8" and idx.tokenizer.name == "bytes" and not idx.masked
    tokens = idx.to_json()["tokens"]
    assert tokens["train"] > 5_000_000 and 0.02 < tokens["eval"] / (tokens["train"] + tokens["eval"]) < 0.15
    assert {"email", "asyncio", "json", "_toplevel"} <= {s.group for s in idx.shards}
    assert "test" not in {s.group for s in idx.shards}  # data.include_tests is off


def test_a_text_folder_is_prepared_once_and_again_when_it_changes(tmp_path, monkeypatch):
    src = write_tree(tmp_path / "src", {f"pkg{i}/m{j}.py": f"x = {i * j}\n".encode() * 50 for i in range(3) for j in range(4)})
    cfg = _cfg(tmp_path / "cache", source=str(src))
    first = dataset_for(cfg)
    assert sorted(documents(first)) == sorted((src / f"pkg{i}/m{j}.py").read_bytes() for i in range(3) for j in range(4))
    assert {s.group for s in first.index.shards} == {"pkg0", "pkg1", "pkg2"}
    monkeypatch.setattr(data, "prepare", lambda *a, **k: pytest.fail("prepared again although nothing changed"))
    assert dataset_for(cfg).url == first.url
    monkeypatch.undo()
    (src / "pkg0/m0.py").write_bytes(b"y = 1\n" * 60)
    again = dataset_for(cfg)
    assert again.url != first.url and b"y = 1\n" * 60 in documents(again)


def test_text_folders_hold_out_at_least_one_document_and_skip_binaries(tmp_path):
    src = write_tree(tmp_path / "two", {"a.txt": b"alpha " * 50, "b.txt": b"beta " * 50})
    ds = dataset_for(_cfg(tmp_path / "cache", source=str(src), heldout_fraction=0.01))
    assert len(documents(ds, "eval")) == 1 and len(documents(ds, "train")) == 1
    texts = {f"t{i}.txt": b"text %d " % i * 40 for i in range(20)}
    src = write_tree(tmp_path / "mixed", {**texts, "c.bin": b"\xff\xfe\x00" * 9})
    ds = dataset_for(_cfg(tmp_path / "cache", source=str(src), heldout_fraction=0.3))
    assert sorted(documents(ds)) == sorted(texts.values()) and ds.index.skipped == 1


def test_a_missing_or_empty_source_is_one_clear_error(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        dataset_for(_cfg(tmp_path / "cache", source=str(tmp_path / "nowhere")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no files to read"):
        dataset_for(_cfg(tmp_path / "cache", source=str(tmp_path / "empty")))


# ----------------------------------------------------------------------------- a worker's share and its batches


def _segments(s: BatchSampler) -> set[int]:
    d = s.deal
    return {(d.a * (d.offset + i * d.stride) + d.b) % d.total for i in range(d.count)}


def test_iid_shares_deal_every_segment_to_exactly_one_worker(stdlib):
    shares = [_segments(BatchSampler(stdlib, 64, 4, seed=3, worker=w, num_workers=4)) for w in range(4)]
    total = BatchSampler(stdlib, 64, 4, seed=3, worker=0, num_workers=4).deal.total
    assert set().union(*shares) == set(range(total)) and sum(map(len, shares)) == total
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert _segments(BatchSampler(stdlib, 64, 4, seed=4, worker=0, num_workers=4)) != shares[0]  # the seed deals


def test_non_iid_shares_are_whole_groups(stdlib):
    samplers = [BatchSampler(stdlib, 64, 4, seed=0, worker=w, num_workers=3, mode="non-iid") for w in range(3)]
    groups = [{s.group for s in sm.shards} for sm in samplers]
    assert not (groups[0] & groups[1]) and not (groups[1] & groups[2]) and not (groups[0] & groups[2])
    assert set().union(*groups) == {s.group for s in stdlib.index.split("train")}


def test_the_run_says_which_data_and_groups_each_worker_reads(tmp_path):
    """The line `submit` prints: the dataset, its train tokens, and the deal; non-iid names each
    worker's groups as the samplers deal them, with their share of the tokens."""
    files = {f"{g}/{i}.txt": g.encode() * n for g, n in (("big", 500), ("mid", 100), ("low", 60)) for i in range(3)}
    src = write_tree(tmp_path / "src", files)
    cfg = config_from_dict({"workers": 2, "model": {"block_size": 16}, "data": {
        "cache_dir": str(tmp_path / "cache"), "source": str(src), "sharding": "non-iid"}})
    task = LanguageModel(cfg)
    train = [s for s in task.dataset.index.split("train") if s.tokens > 16]
    tokens = {g: sum(s.tokens for s in train if s.group == g) for g in ("big", "mid", "low")}
    dealt = [{s.group for s in task.sampler(w, 2, 2).shards} for w in (0, 1)]
    assert dealt == [{"big"}, {"mid", "low"}], tokens  # the largest group to worker 0, the others to the less loaded
    line = task.describe_data()
    share = round(100 * tokens["big"] / sum(tokens.values()))
    assert line == (f"data: {src}, {sum(tokens.values()):,} train tokens in {len(train)} "
                    f"shard(s); non-iid, 3 groups dealt whole: worker 0: big ({share}%); worker 1: mid, low "
                    f"({100 - share}%)"), line
    iid = LanguageModel(replace(cfg, data__sharding="iid"))
    assert iid.describe_data().endswith("; iid: each of the 2 workers draws windows from its own 1/2 of them "
                                        "(dealt at random by seed 0)")


def test_batches_are_a_pure_function_of_seed_worker_and_step(stdlib):
    a = BatchSampler(stdlib, 64, 4, seed=1, worker=0, num_workers=2)
    b = BatchSampler(stdlib, 64, 4, seed=1, worker=0, num_workers=2)
    x, y = a.batch(7)
    assert x.shape == y.shape == (4, 64) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    assert torch.equal(x, b.batch(7)[0]) and not torch.equal(x, a.batch(8)[0])
    assert not torch.equal(x, BatchSampler(stdlib, 64, 4, seed=1, worker=1, num_workers=2).batch(7)[0])


def test_a_window_is_a_slice_of_one_shard(stdlib):
    s = BatchSampler(stdlib, 32, 8, seed=0, worker=1, num_workers=2)
    for r in range(20):
        shard, start = s._pick(r * 7919, r * 104729)
        assert shard in s.shards and 0 <= start <= shard.tokens - 33
    x, y = s.batch(0)
    assert all(bytes(row.tolist()) in b"".join(stdlib.storage.read_bytes(sh.key) for sh in s.shards) for row in x[:2])


def test_too_many_workers_or_groups_are_clear_errors(tmp_path):
    src = write_tree(tmp_path / "src", {"a/x.txt": b"a" * 300, "b/y.txt": b"b" * 300, "c/z.txt": b"c" * 300})
    ds = dataset_for(_cfg(tmp_path / "cache", source=str(src), heldout_fraction=0.3))
    with pytest.raises(DatasetError, match=r"the 2 group\(s\) of .*'s train split over 5 workers"):
        BatchSampler(ds, 16, 2, seed=0, worker=0, num_workers=5, mode="non-iid")
    with pytest.raises(DatasetError, match="over 500 workers"):
        BatchSampler(ds, 16, 2, seed=0, worker=0, num_workers=500)
    with pytest.raises(DatasetError, match="eval split"):
        eval_batches(ds, 400, 2, 1, seed=0)


def test_eval_batches_and_estimate_loss(stdlib):
    batches = eval_batches(stdlib, 32, 4, 3, seed=0)
    again = eval_batches(stdlib, 32, 4, 3, seed=0)
    assert len(batches) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    reshuffled = eval_batches(stdlib, 32, 4, 3, seed=1)  # the same windows, dealt to other batches
    rows = lambda bs: sorted(tuple(r.tolist()) for x, _ in bs for r in x)  # noqa: E731
    assert rows(batches) == rows(reshuffled) and not torch.equal(batches[0][0], reshuffled[0][0])
    model = GPT(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=16)
    model.train()
    loss = LanguageModel(Config()).evaluate(model, batches)["loss"]  # the service's eval of task lm
    assert 4.0 < loss < 7.0 and model.training  # ~ln(256) for an untrained model; mode restored


def test_a_damaged_cache_is_prepared_again(tmp_path):
    src = write_tree(tmp_path / "src", {f"d{i}.txt": b"words %d " % i * 30 for i in range(10)})
    cfg = _cfg(tmp_path / "cache", source=str(src), heldout_fraction=0.3)
    first = dataset_for(cfg)
    for damage in (b"{not json", json.dumps({"format": "islands-dataset-v1"}).encode()):
        (Path(first.url) / "index.json").write_bytes(damage)
        again = dataset_for(cfg)
        assert again.url == first.url and sorted(documents(again)) == sorted(documents(first))


def test_a_json_lines_source_is_prepared_on_first_use_and_a_failed_one_leaves_nothing(tmp_path, caplog, capsys):
    """A raw .jsonl as data.source (as a user names their corpus): prepared once into the cache like
    a text folder, each record's text a document, saying so (a line of the log, not a warning: it
    is the documented path) and where; a second run reuses it. One whose records have no `text` is
    one error through `submit`, naming the `data prepare` command, and the cache keeps nothing of it."""
    caplog.set_level("INFO", logger="worker.data")
    from orchestrator.cli import main
    good = tmp_path / "corpus.jsonl"
    good.write_text("".join(json.dumps({"text": f"document {i} " + "words " * 40, "id": i}) + "\n" for i in range(60)))
    cache = tmp_path / "cache"
    ds = dataset_for(_cfg(cache, source=str(good)))
    assert len(documents(ds)) == 60 and len(documents(ds, "eval")) >= 1
    assert documents(ds)[0].startswith(b"document ")
    assert "holds records (JSON lines or parquet): preparing them once" in caplog.text and str(cache) in caplog.text
    caplog.clear()
    assert dataset_for(_cfg(cache, source=str(good))).url == ds.url and "preparing" not in caplog.text
    bad = tmp_path / "other.jsonl"
    bad.write_text("".join(json.dumps({"body": "x" * 300}) + "\n" for _ in range(20)))
    before = sorted(p.name for p in (cache / "data").iterdir())
    assert main(["submit", "--executor", "inline", "--run-dir", str(tmp_path / "run"), "--set", f"data.source={bad}",
                 "--set", f"data.cache_dir={cache}"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert f"data.source {bad} could not be prepared" in out and f"orchestrate data prepare {bad} --out DIR" in out, out
    assert sorted(p.name for p in (cache / "data").iterdir()) == before and not (tmp_path / "run").exists()
