"""Tests for worker/data.py on the real standard library and on small temp directories."""

from __future__ import annotations

import logging
import sysconfig
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker import data
from worker.data import (
    BatchSampler, Corpus, Document, eval_batches, estimate_loss, load_corpus, shard, split_heldout,
)
from worker.model import GPT


@pytest.fixture(scope="session")
def stdlib(tmp_path_factory) -> tuple[Corpus, Path]:
    cache = tmp_path_factory.mktemp("stdlib-cache")
    return load_corpus(cache_dir=cache), cache


def no_reads(monkeypatch) -> None:
    def fail(path):
        raise AssertionError(f"a warm load read {path}")
    monkeypatch.setattr(data, "_read_bytes", fail)


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)
    return root


def fake_corpus(sizes: list[int], groups: list[str]) -> Corpus:
    """A corpus built by hand: only document sizes and groups matter to shard()."""
    docs, offset = [], 0
    for i, (size, group) in enumerate(zip(sizes, groups)):
        docs.append(Document(f"{group}/d{i}.txt", group, offset, offset + size))
        offset += size + 1
    return Corpus(torch.zeros(offset, dtype=torch.uint8), tuple(docs), "fake")


# ----------------------------------------------------------------------------- load_corpus


def test_stdlib_corpus_contents(stdlib):
    corpus, _ = stdlib
    assert corpus.tokens.dtype == torch.uint8 and corpus.tokens.dim() == 1
    assert corpus.tokens.numel() > 5_000_000
    assert {"email", "asyncio", "json", "_toplevel"} <= {d.group for d in corpus.documents}
    names = [d.name for d in corpus.documents]
    assert names == sorted(names)
    skipped = ("test", "tests", "idle_test", "site-packages")
    assert not any(part in skipped for n in names for part in n.split("/")[:-1])
    doc = next(d for d in corpus.documents if d.name == "json/__init__.py")
    expected = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "__init__.py").read_bytes()
    assert bytes(corpus.tokens[doc.start : doc.end].numpy()) == expected
    assert next(d for d in corpus.documents if d.name == "os.py").group == "_toplevel"
    assert all(corpus.tokens[d.end] == ord("\n") for d in corpus.documents)


def test_stdlib_cache_is_reused_without_reading_files(stdlib, monkeypatch):
    corpus, cache = stdlib
    no_reads(monkeypatch)
    again = load_corpus(cache_dir=cache)
    assert again.fingerprint == corpus.fingerprint
    assert again.documents == corpus.documents and torch.equal(again.tokens, corpus.tokens)
    assert (cache / "data" / corpus.fingerprint / "tokens.safetensors").is_file()


def test_changed_source_is_rebuilt_and_unchanged_reused(tmp_path, monkeypatch):
    src = write_tree(tmp_path / "src", {"a.txt": b"alpha\n", "pkg/b.txt": b"beta\n"})
    first = load_corpus(str(src), cache_dir=tmp_path / "cache")
    (src / "a.txt").write_bytes(b"alpha, edited\n")
    second = load_corpus(str(src), cache_dir=tmp_path / "cache")
    assert second.fingerprint != first.fingerprint
    doc = second.documents[0]
    assert bytes(second.tokens[doc.start : doc.end].numpy()) == b"alpha, edited\n"
    no_reads(monkeypatch)
    assert load_corpus(str(src), cache_dir=tmp_path / "cache").fingerprint == second.fingerprint


def test_corrupt_cache_is_rebuilt_with_warning(tmp_path, caplog):
    src = write_tree(tmp_path / "src", {"a.txt": b"some text\n"})
    corpus = load_corpus(str(src), cache_dir=tmp_path / "cache")
    (tmp_path / "cache" / "data" / corpus.fingerprint / "tokens.safetensors").write_bytes(b"junk")
    with caplog.at_level(logging.WARNING, logger="worker.data"):
        again = load_corpus(str(src), cache_dir=tmp_path / "cache")
    assert "rebuilding" in caplog.text
    assert torch.equal(again.tokens, corpus.tokens)
    assert not [p for p in (tmp_path / "cache").rglob("*.tmp")]  # no temp files left behind


def test_cache_dir_defaults_to_env(tmp_path, monkeypatch):
    src = write_tree(tmp_path / "src", {"a.txt": b"text\n"})
    monkeypatch.setenv("ISLANDS_CACHE", str(tmp_path / "envcache"))
    corpus = load_corpus(str(src))
    assert (tmp_path / "envcache" / "data" / corpus.fingerprint / "index.json").is_file()


def test_user_directory_skips_binary_and_hidden_files(tmp_path, caplog):
    src = write_tree(tmp_path / "src", {
        "readme.md": "héllo\n".encode(),
        "notes/day1.txt": b"one\n",
        "notes/deep/day2.txt": b"two\n",
        "blob.bin": bytes([0xFF, 0xFE, 0x00, 0x80]), ".git/HEAD": b"ref\n", "empty.txt": b"",
    })
    with caplog.at_level(logging.WARNING, logger="worker.data"):
        corpus = load_corpus(str(src), cache_dir=tmp_path / "cache")
    assert "blob.bin" in caplog.text
    assert [(d.name, d.group) for d in corpus.documents] == [
        ("notes/day1.txt", "notes"), ("notes/deep/day2.txt", "notes"), ("readme.md", "_toplevel")]
    assert bytes(corpus.tokens.numpy()) == "one\n\ntwo\n\nhéllo\n\n".encode()


def test_single_file_source(tmp_path):
    path = write_tree(tmp_path, {"book.txt": b"a whole book\n"}) / "book.txt"
    corpus = load_corpus(str(path), cache_dir=tmp_path / "cache")
    assert corpus.documents == (Document("book.txt", "_toplevel", 0, 13),)


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(str(tmp_path / "nowhere"), cache_dir=tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no files"):
        load_corpus(str(tmp_path / "empty"), cache_dir=tmp_path / "cache")
    write_tree(tmp_path / "binary", {"x.bin": b"\xff\xfe"})
    with pytest.raises(ValueError, match="no usable files"):
        load_corpus(str(tmp_path / "binary"), cache_dir=tmp_path / "cache")


# ----------------------------------------------------------------------------- split_heldout


def test_split_is_stable_when_a_file_is_added(tmp_path):
    src = write_tree(tmp_path / "src", {f"f{i:02d}.txt": f"file {i}\n".encode() for i in range(40)})
    before = load_corpus(str(src), cache_dir=tmp_path / "cache")
    write_tree(src, {"f99.txt": b"a new file\n"})
    after = load_corpus(str(src), cache_dir=tmp_path / "cache")

    def eval_names(corpus):
        train, held = split_heldout(corpus, 0.25, seed=7)
        assert sorted(train + held) == list(range(len(corpus.documents)))
        return {corpus.documents[i].name for i in held}

    assert eval_names(before) == eval_names(after) - {"f99.txt"}
    assert 3 <= len(eval_names(before)) <= 20


def test_split_keeps_one_of_each(stdlib):
    two = fake_corpus([5, 5], ["a", "b"])
    for fraction in (1e-9, 1 - 1e-9):
        train, held = split_heldout(two, fraction, seed=0)
        assert len(train) == 1 and len(held) == 1
    train, held = split_heldout(stdlib[0], 0.05, seed=0)
    assert 0.02 < len(held) / len(stdlib[0].documents) < 0.1
    with pytest.raises(ValueError, match="0 < fraction < 1"):
        split_heldout(two, 1.0, seed=0)


# ----------------------------------------------------------------------------- shard


def shard_bytes(corpus: Corpus, shards: list[list[int]]) -> list[int]:
    return [sum(corpus.documents[i].size for i in s) for s in shards]


def test_shard_stdlib_iid_and_non_iid(stdlib):
    corpus, _ = stdlib
    train, _ = split_heldout(corpus, 0.05, seed=0)
    iid = shard(corpus, train, 4, "iid", seed=0)
    assert sorted(i for s in iid for i in s) == train
    sizes = shard_bytes(corpus, iid)
    assert max(sizes) / min(sizes) < 1.1
    assert iid != shard(corpus, train, 4, "iid", seed=1)  # the seed changes the mix
    non_iid = shard(corpus, train, 4, "non-iid", seed=0)
    assert sorted(i for s in non_iid for i in s) == train
    owners = {}
    for w, s in enumerate(non_iid):
        for i in s:
            owners.setdefault(corpus.documents[i].group, set()).add(w)
    assert all(len(ws) == 1 for ws in owners.values())


@settings(max_examples=150, deadline=None)
@given(
    docs=st.lists(st.tuples(st.integers(1, 1000), st.sampled_from("abcdefgh")),
                  min_size=1, max_size=40),
    num_workers=st.integers(1, 10),
    mode=st.sampled_from(["iid", "non-iid"]),
    seed=st.integers(0, 2**32),
)
def test_shard_properties(docs, num_workers, mode, seed):
    corpus = fake_corpus([s for s, _ in docs], [g for _, g in docs])
    ids = list(range(len(docs)))
    units = len(ids) if mode == "iid" else len({g for _, g in docs})
    if units < num_workers:
        with pytest.raises(ValueError, match=f"{units} .* {num_workers} workers"):
            shard(corpus, ids, num_workers, mode, seed)
        return
    shards = shard(corpus, ids, num_workers, mode, seed)
    assert len(shards) == num_workers and all(shards)
    assert sorted(i for s in shards for i in s) == ids
    assert shards == shard(corpus, ids, num_workers, mode, seed)
    # greedy dealing to the lightest worker keeps the spread below the largest unit dealt
    group_size = {g: sum(s for s, gg in docs if gg == g) for _, g in docs}
    largest = max(s for s, _ in docs) if mode == "iid" else max(group_size.values())
    sizes = shard_bytes(corpus, shards)
    assert max(sizes) - min(sizes) <= largest
    if mode == "non-iid":
        groups = [{corpus.documents[i].group for i in s} for s in shards]
        assert sum(len(g) for g in groups) == len(group_size)  # no group on two workers


def test_shard_errors():
    corpus = fake_corpus([10, 20, 30], ["a", "a", "b"])
    with pytest.raises(ValueError, match="valid modes are iid, non-iid"):
        shard(corpus, [0, 1, 2], 2, "random", seed=0)
    with pytest.raises(ValueError, match="3 documents over 4 workers"):
        shard(corpus, [0, 1, 2], 4, "iid", seed=0)
    with pytest.raises(ValueError, match="2 groups over 3 workers"):
        shard(corpus, [0, 1, 2], 3, "non-iid", seed=0)
    with pytest.raises(ValueError, match="duplicates or outside"):
        shard(corpus, [0, 0, 5], 1, "iid", seed=0)


# ----------------------------------------------------------------------------- batches


def test_batch_sampler_is_a_pure_function_of_seed_worker_step(stdlib):
    corpus, _ = stdlib
    ids = list(range(0, len(corpus.documents), 7))
    a = BatchSampler(corpus, ids, block_size=64, batch_size=4, seed=1, worker=0)
    b = BatchSampler(corpus, ids, block_size=64, batch_size=4, seed=1, worker=0)
    x, y = a.batch(3)
    assert x.shape == y.shape == (4, 64) and x.dtype == torch.long
    assert a.tokens_per_batch == 256
    a.batch(0), a.batch(1)  # a sampler's history must not matter: a resumed worker starts cold
    assert all(torch.equal(p, q) for p, q in zip(a.batch(3), b.batch(3)))
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, a.batch(4)[0])
    other = BatchSampler(corpus, ids, block_size=64, batch_size=4, seed=1, worker=1)
    assert not torch.equal(x, other.batch(3)[0])
    stream = bytes(a.stream.numpy())
    assert bytes(x[0].tolist()) + bytes([int(y[0, -1])]) in stream


def test_batch_sampler_errors():
    corpus = fake_corpus([5, 5], ["a", "b"])
    with pytest.raises(ValueError, match="12 tokens, fewer than block_size \\+ 1 = 17"):
        BatchSampler(corpus, [0, 1], block_size=16, batch_size=2, seed=0, worker=3)
    sampler = BatchSampler(corpus, [0, 1], block_size=11, batch_size=2, seed=0, worker=0)
    assert sampler.batch(0)[0].shape == (2, 11)  # exactly block_size + 1 tokens is enough
    with pytest.raises(ValueError, match="step >= 0"):
        sampler.batch(-1)


def test_eval_batches_and_estimate_loss(stdlib):
    corpus, _ = stdlib
    _, held = split_heldout(corpus, 0.05, seed=0)
    batches = eval_batches(corpus, held, block_size=32, batch_size=4, num_batches=3, seed=0)
    again = eval_batches(corpus, held, block_size=32, batch_size=4, num_batches=3, seed=0)
    assert len(batches) == 3 and batches[0][0].shape == (4, 32)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(batches, again))
    reshuffled = eval_batches(corpus, held, block_size=32, batch_size=4, num_batches=3, seed=1)
    rows = lambda bs: sorted(tuple(r.tolist()) for x, _ in bs for r in x)  # noqa: E731
    assert rows(batches) == rows(reshuffled)  # the seed deals the same windows differently
    torch.manual_seed(0)
    model = GPT(n_layer=1, n_head=2, n_embd=16, block_size=32).train()
    loss = estimate_loss(model, batches)
    assert model.training and abs(loss - 5.545) < 0.3
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="no batches"):
        estimate_loss(model, [])
