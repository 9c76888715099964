"""What only object storage can get wrong, on moto's S3 server + s3fs (the contract suite in
test_storage.py runs there too, through the `storage` fixture's "s3" param).

S3 has no rename (fsspec's `mv` is copy + delete) and no folders; s3fs caches listings. These tests
pin down how the storage layer copes: writes go straight to their key and are aborted on error,
create_exclusive is a conditional PUT, listings are never cached, and a whole run works on s3://.
"""
from __future__ import annotations

import json
import threading

import pytest
import torch

from core.checkpoint import load_checkpoint
from core.checkpoint_writer import write_checkpoint
from core.storage import Storage

# Every test here takes the `s3_server` fixture (tests/conftest.py), which skips with the reason
# when moto[server] or s3fs is not installed.


@pytest.fixture
def s3(s3_server, request) -> Storage:
    s = s3_server.storage(request.node.name)
    yield s
    if s.fs.exists(s.root):
        s.fs.rm(s.root, recursive=True)


@pytest.fixture
def s3_small_parts(s3_server, request) -> Storage:
    """Like `s3`, with 5 MiB parts (S3's smallest) so that writes of 11 MiB are multipart uploads."""
    s = Storage(f"s3://{s3_server.bucket}/{request.node.name}", key=s3_server.key, secret=s3_server.secret,
                default_block_size=5 << 20,
                client_kwargs={"endpoint_url": s3_server.endpoint_url, "region_name": "us-east-1"})
    yield s
    if s.fs.exists(s.root):
        s.fs.rm(s.root, recursive=True)


def test_writes_go_straight_to_the_key_no_temporary_no_copy(s3_server, s3):
    assert s3.atomic_put
    with s3.open_atomic("z/f.bin") as f:
        f.write(b"data")
        assert s3_server.objects(s3) == []  # nothing visible until the upload completes
    assert s3_server.objects(s3) == ["z/f.bin"]


def test_failed_write_leaves_no_object_and_no_upload(s3_server, s3_small_parts):
    s = s3_small_parts
    with pytest.raises(RuntimeError):
        with s.open_atomic("y/big.bin") as f:
            f.write(b"x" * (11 << 20))  # two 5 MiB parts go up as a multipart upload
            raise RuntimeError("killed mid-write")
    assert s3_server.objects(s) == []  # the upload was aborted, not completed
    assert s.list("y") == [] and not s.exists("y/big.bin")


def test_large_write_round_trips_through_multipart(s3_server, s3_small_parts):
    s = s3_small_parts
    data = bytes(range(256)) * ((11 << 20) // 256)
    s.write_bytes("big.bin", data)
    assert s.read_bytes("big.bin") == data and s3_server.objects(s) == ["big.bin"]


def test_create_exclusive_is_a_conditional_put(s3, monkeypatch):
    # Make check-then-write impossible: if create_exclusive relied on exists(), both would win.
    monkeypatch.setattr(s3.fs, "exists", lambda *a, **k: False)
    assert s3.create_exclusive("lock.json", b"first")
    assert not s3.create_exclusive("lock.json", b"second")
    assert s3.read_bytes("lock.json") == b"first"


def test_create_exclusive_race_has_one_winner(s3):
    barrier = threading.Barrier(6)
    won: dict[int, bool] = {}

    def contend(i: int) -> None:
        barrier.wait()
        won[i] = s3.create_exclusive("lock.json", json.dumps({"pid": i}).encode())
    threads = [threading.Thread(target=contend, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, w in won.items() if w]
    assert len(won) == 6 and len(winners) == 1
    assert json.loads(s3.read_bytes("lock.json"))["pid"] == winners[0]


def test_listings_are_never_cached(s3_server, s3):
    # Another process publishes between two polls; s3fs's default listing cache would hide it.
    other = Storage(s3.url, key=s3_server.key, secret=s3_server.secret, skip_instance_cache=True,
                    client_kwargs={"endpoint_url": s3_server.endpoint_url, "region_name": "us-east-1"})
    s3.write_bytes("c/a.json", b"{}")
    assert s3.list("c") == ["a.json"] and not s3.exists("c/b.json")
    other.write_bytes("c/b.json", b"{}")
    assert s3.list("c") == ["a.json", "b.json"] and s3.exists("c/b.json")


def test_checkpoint_is_data_then_manifest_and_nothing_else(s3_server, s3):
    write_checkpoint(s3, "ck/w.safetensors", {"a": torch.ones(3)})
    assert s3_server.objects(s3) == ["ck/w.json", "ck/w.safetensors"]  # data and manifest, nothing else
    assert torch.equal(load_checkpoint(s3, "ck/w.safetensors")[0]["a"], torch.ones(3))


@pytest.mark.slow
def test_whole_run_on_s3(s3_server, corpus_cache, tmp_path, monkeypatch, capsys):
    # Workers are separate processes: they find the server through the standard AWS variables,
    # which botocore (under s3fs) reads and child processes inherit (docs/reliability.md).
    from orchestrator.cli import main
    from worker.weights import load_model
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HOME", str(tmp_path))  # submitit's job folder for a remote run: ~/.cache/islands/jobs
    url = f"s3://{s3_server.bucket}/whole-run"
    tiny = ["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2",
            "--set", "model.block_size=32", "--set", "inner.batch_size=4", "--set", "data.eval_batches=2",
            "--set", "round.poll_s=0.2", "--set", f"data.cache_dir={corpus_cache}"]
    assert main(["submit", "--executor", "inline", "--run-dir", url, "--workers", "2", "--rounds", "2",
                 "--inner-steps", "3", *tiny]) == 0
    capsys.readouterr()
    assert main(["status", url, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["state"] == "done" and [r["merged"] for r in st["rounds"]] == [[0, 1], [0, 1]]
    assert st["final_model"] == f"{url}/final/model.safetensors"
    assert load_model(st["final_model"]).transformer.wte.weight.shape == (256, 32)
    s = s3_server.storage("whole-run")
    objects = s3_server.objects(s)
    assert not [k for k in objects if ".tmp-" in k or "upload in progress" in k], objects
    assert "rounds/00001/contrib/worker_001.json" in objects and not s.exists("lock.json")


def test_merge_outputs_on_s3_are_whole_or_absent(s3_server, s3_small_parts, tmp_path, monkeypatch):
    """`orchestrate merge` into s3:// writes through the storage's staged writes: the output and
    its manifest appear once the merge succeeded; a merge that fails half way (a NaN in the last
    tensor of an input, after several 5 MiB parts of the output went up) leaves no object, no
    temporary and no upload in progress."""
    import fsspec

    from merge.manual import ManualMerge, MergeError, manual_merge
    for k, v in s3_server.env().items():  # the merge opens the URL itself: credentials from the environment
        monkeypatch.setenv(k, v)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"default_block_size": 5 << 20, "skip_instance_cache": True})
    s = s3_small_parts
    url = f"s3://{s.root}"
    local = Storage(str(tmp_path))
    write_checkpoint(local, "g.safetensors", {"a": torch.ones(3 << 20), "z": torch.ones(4)})
    write_checkpoint(local, "b.safetensors", {"a": torch.ones(3 << 20), "z": torch.tensor([1.0, float("nan"), 1.0, 1.0])})
    with pytest.raises(MergeError, match="NaN"):
        manual_merge(ManualMerge([str(tmp_path / "g.safetensors"), str(tmp_path / "b.safetensors")],
                                 f"{url}/out.safetensors"))
    assert s3_server.objects(s) == []
    manual_merge(ManualMerge([str(tmp_path / "g.safetensors"), str(tmp_path / "g.safetensors")],
                             f"{url}/out.safetensors"))
    assert s3_server.objects(s) == ["out.json", "out.safetensors"]
    assert torch.equal(load_checkpoint(s, "out.safetensors")[0]["a"], torch.ones(3 << 20))
