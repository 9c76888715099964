"""A prepared dataset is as untrusted as a checkpoint: shards are read as regular files inside the
dataset (no link followed, no FIFO opened), token ids are checked against the vocabulary as they are
read and by `data check`, and a folder that is (or was) a prepared dataset is never prepared again as
text. Real prepared datasets on local disk, the real reader (worker.data) and the real CLI.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from core import dataset as fmt
from core.config import config_from_dict
from core.dataset import DatasetError
from orchestrator.cli import main
from test_data import write_tree
from worker.data import Dataset, dataset_for


@pytest.fixture
def prepared(tmp_path) -> Path:
    """A small prepared dataset (bytes), its own folder."""
    src = write_tree(tmp_path / "src", {f"d{i}.txt": b"some words %d " % i * 40 for i in range(6)})
    out = tmp_path / "ds"
    assert main(["data", "prepare", str(src), "--out", str(out), "--heldout", "0.3"]) == 0
    return out


def _train_shard(ds: Path) -> dict:
    index = json.loads((ds / "index.json").read_text())
    return next(s for s in index["shards"] if s["split"] == "train")


def _all_windows(path: Path) -> None:
    d = Dataset(str(path), check_sizes=False)  # the reads themselves: a size check first may refuse sooner
    for s in d.index.shards:
        d.windows([(s, 0)], block_size=min(8, s.tokens - 1))


def _forge_ids(ds: Path, bad_id: int) -> tuple[str, int]:
    """The train shard rewritten as uint16 with `bad_id` at token 5, the index made to agree
    (dtype, sizes, checksums): a dataset consistent in every way but its ids; (shard key, offset)."""
    index = json.loads((ds / "index.json").read_text())
    for s in index["shards"]:
        ids = np.frombuffer((ds / s["key"]).read_bytes(), dtype="<u1").astype("<u2")
        if s is _first_train(index):
            ids[5] = bad_id
        (ds / s["key"]).write_bytes(ids.tobytes())
        s["sums"][0] = fmt.checksum(ids.tobytes())
    index["dtype"] = "uint16"
    (ds / "index.json").write_text(json.dumps(index))
    return _first_train(index)["key"], 5


def _first_train(index: dict) -> dict:
    return next(s for s in index["shards"] if s["split"] == "train")


def test_token_ids_past_the_vocabulary_are_one_error_naming_shard_and_offset(prepared, capsys):
    key, at = _forge_ids(prepared, 40000)
    with pytest.raises(DatasetError, match=f"shard {key} holds token id 40000 at token {at}, past the vocabulary of 256"):
        _all_windows(prepared)
    assert main(["data", "check", str(prepared)]) == 2
    assert f"{key} holds token id 40000 at token {at}, past the vocabulary of 256" in capsys.readouterr().out


def test_ids_inside_the_vocabulary_pass_both_checks(prepared, capsys):
    _forge_ids(prepared, 255)
    _all_windows(prepared)
    assert main(["data", "check", str(prepared)]) == 0
    assert "every token id is inside the vocabulary" in capsys.readouterr().out


@pytest.mark.parametrize("target", ["/etc/passwd", "outside-copy"])
def test_a_shard_that_is_a_link_is_never_read(prepared, tmp_path, capsys, target):
    """A link to a file outside the dataset, even one of the right size and checksum, is refused."""
    key = _train_shard(prepared)["key"]
    shard = prepared / key
    if target == "outside-copy":
        outside = tmp_path / "copy.bin"
        outside.write_bytes(shard.read_bytes())
        target = str(outside)
    shard.unlink()
    os.symlink(target, shard)
    with pytest.raises(DatasetError, match=f"shard file {key} cannot be read .*symbolic link"):
        _all_windows(prepared)
    assert main(["data", "check", str(prepared)]) == 2
    out = capsys.readouterr().out
    assert f"{key} cannot be read" in out and "symbolic link" in out


def test_a_dataset_named_through_a_link_is_read(prepared, tmp_path):
    """The folder the user names may be a link (a shared project path); only what is inside is confined."""
    alias = tmp_path / "alias"
    os.symlink(prepared, alias)
    _all_windows(alias)


def _returns_within(fn, seconds: float = 20.0):
    """fn()'s exception (or None) if it returns within `seconds`; fails the test if it blocks."""
    out: list = []

    def call():
        try:
            fn()
            out.append(None)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out.append(exc)
    th = threading.Thread(target=call, daemon=True)
    th.start()
    th.join(seconds)
    assert out, f"{fn} blocked for {seconds}s (a FIFO opened for reading waits for a writer forever)"
    return out[0]


def test_a_shard_swapped_for_a_fifo_is_refused_without_blocking(prepared, capsys):
    key = _train_shard(prepared)["key"]
    (prepared / key).unlink()
    os.mkfifo(prepared / key)
    err = _returns_within(lambda: _all_windows(prepared))
    assert isinstance(err, DatasetError) and key in str(err) and "named pipe" in str(err)
    assert _returns_within(lambda: main(["data", "check", str(prepared)])) is None
    assert "named pipe" in capsys.readouterr().out


@pytest.mark.parametrize("how", ["deleted", "fifo", "link"])
def test_a_dataset_whose_index_is_lost_is_an_error_not_a_text_folder_prepared_again(prepared, tmp_path, how):
    index = prepared / "index.json"
    index.unlink()
    if how == "fifo":
        os.mkfifo(index)
    elif how == "link":
        os.symlink("/etc/passwd", index)
    cfg = config_from_dict({"data": {"source": str(prepared), "cache_dir": str(tmp_path / "cache")}})
    err = _returns_within(lambda: dataset_for(cfg))
    assert isinstance(err, DatasetError), err
    assert "index.json" in str(err) and "prepare" in str(err)
    assert not (tmp_path / "cache").exists()  # nothing was prepared from it


def test_a_text_corpus_with_folders_named_shards_and_parts_is_still_text(tmp_path):
    src = write_tree(tmp_path / "book", {"parts/one.txt": b"chapter one " * 80, "parts/two.txt": b"chapter two " * 80,
                                         "shards/glass.txt": b"broken glass " * 80})
    cfg = config_from_dict({"data": {"source": str(src), "cache_dir": str(tmp_path / "cache"), "heldout_fraction": 0.3}})
    ds = dataset_for(cfg)
    assert ds.index.documents == 3 and str(tmp_path / "cache") in ds.url


# -- the data cache: data.source a raw corpus, prepared on first use into data.cache_dir/data/<fingerprint>

def _cached(tmp_path: Path, cache: Path, words: bytes = b"ours") -> tuple[dict, Path]:
    src = write_tree(tmp_path / f"src-{words.decode()}", {f"d{i}.txt": words + b" %d " % i * 40 for i in range(6)})
    cfg = config_from_dict({"data": {"source": str(src), "cache_dir": str(cache)}})
    return cfg, Path(dataset_for(cfg).url)


def _tokens(ds_url) -> bytes:
    d = Dataset(str(ds_url))
    return b"".join(bytes(d.storage.read_bytes(s.key)) for s in d.index.shards)


def _link_to_other(entry: Path, other: Path) -> None:
    import shutil
    shutil.rmtree(entry)
    entry.symlink_to(other, target_is_directory=True)


def _damaged_link(entry: Path, other: Path) -> None:
    _link_to_other(entry, other)
    (other / "index.json").write_bytes(b"\xff\xfe{not json")


def _open_to_all(entry: Path, other: Path) -> None:
    import shutil
    shutil.rmtree(entry)
    shutil.copytree(other, entry)  # another corpus, under our entry's name
    os.chmod(entry / "index.json", 0o666)


def _someone_elses(entry: Path, other: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    _open_to_all(entry, other)
    os.chmod(entry / "index.json", 0o644)
    os.chown(entry, 4321, 4321)


@pytest.mark.parametrize("tamper, says", [
    (_link_to_other, "is a link"), (_damaged_link, "is a link"), (_open_to_all, "writable by other users"),
    (_someone_elses, "belongs to uid 4321")])
def test_a_cache_entry_that_cannot_be_trusted_is_prepared_again_from_the_source(tmp_path, tamper, says, caplog):
    cache = tmp_path / "cache"
    cfg, entry = _cached(tmp_path, cache)
    ours = _tokens(entry)
    _, other = _cached(tmp_path, tmp_path / "elsewhere", b"theirs")
    tamper(entry, other)
    with caplog.at_level("WARNING"):
        again = Path(dataset_for(cfg).url)
    assert again == entry and not entry.is_symlink() and _tokens(entry) == ours
    assert says in caplog.text and "preparing it again" in caplog.text
    assert other.exists()  # where a link led is never touched


def test_a_cache_folder_open_to_others_is_refused_with_the_fix(tmp_path):
    cache = tmp_path / "cache"
    cfg, entry = _cached(tmp_path, cache)
    os.chmod(entry.parent, 0o777)
    with pytest.raises(DatasetError, match=r"writable by other users .*chmod o-w .*data.cache_dir to a folder of your own"):
        dataset_for(cfg)


def test_a_tokenizer_name_with_escape_sequences_is_named_without_them(prepared):
    index = json.loads((prepared / "index.json").read_text())
    index["tokenizer"]["name"] = "\x1b]0;owned\x07\x1b[2Jother"
    (prepared / "index.json").write_text(json.dumps(index))
    with pytest.raises(DatasetError, match="prepared with tokenizer ]0;owned\\[2Jother, but") as err:
        dataset_for(config_from_dict({"data": {"source": str(prepared)}}))
    assert "\x1b" not in str(err.value) and "\x07" not in str(err.value)
