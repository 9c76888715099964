"""Files a buggy worker, a half-synced client or a co-tenant can plant in a run, against the live
merge service and against `orchestrate merge`: each is one rejection with its reason, never a
crash, a hang or a merge (the checkpoint contract: core.checkpoint, core.storage).

Live: the real Service (orchestrator.loop) and storage on local disk, with a fake executor whose "jobs" are
threads (tests/test_contributions.py's Scripted): worker 0 publishes the global weights - 0.5,
worker 1 plants the hostile file with a manifest whose digest matches its bytes, the quorum is 1.
The run finishes by itself; the new global is worker 0's alone (outer SGD at lr 1 makes it the mean
of what was merged); the reason is in the round's record and the file is moved to `rejected/`.
Offline: `orchestrate merge` of a good file and the hostile one exits non-zero with the reason
naming the file, no traceback, and writes nothing.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
import xxhash

from core.checkpoint import load_checkpoint, read_manifest
from core.checkpoint_writer import write_checkpoint
from core.errors import RunError
from core.layout import RunLayout, manifest_key
from core.storage import Storage
from orchestrator.cli import main
from service_support import WORK, Scripted, publish, scripted_run

L = RunLayout()
G0 = {"b": torch.tensor([0.5]), "w": torch.tensor([1.0, 2.0, 3.0])}
F32 = lambda shape, a, b: {"dtype": "F32", "shape": shape, "data_offsets": [a, b]}  # noqa: E731
DATA = struct.pack("<4f", 0.5, 1.0, 2.0, 3.0)


def _raw(header: object, data: bytes = DATA) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


# name -> (the planted file's bytes, or a callable planting it; what the reason must say)
HEADERS = {
    "dtype-list": (_raw({"b": {"dtype": [], "shape": [1], "data_offsets": [0, 4]}, "w": F32([3], 4, 16)}), "malformed"),
    "deep-header": (_raw(b"[" * 100_000 + b"]" * 100_000, b""), "not valid JSON"),
    "list-metadata": (_raw({"__metadata__": ["x"], "b": F32([1], 0, 4), "w": F32([3], 4, 16)}), "__metadata__"),
    "overlapping-offsets": (_raw({"b": F32([1], 0, 4), "w": F32([3], 0, 12)}, DATA[:12]), "overlap or leave gaps"),
    "float-shape": (_raw({"b": F32([1.0], 0, 4), "w": F32([3], 4, 16)}), "malformed"),
}


def _manifest(raw: bytes, r: int, w: int, base_digest: str, **extra) -> dict:
    return {"round": r, "worker": w, **WORK, "base_digest": base_digest, "hash": "xxh3_128",
            "digest": xxhash.xxh3_128(raw).hexdigest(), "bytes": len(raw), "file": f"worker_{w:03d}.safetensors",
            **extra}


def _plant_bytes(raw: bytes, **extra):
    def plant(s: Storage, t) -> None:
        key = L.contribution(t.round, t.worker)
        s.write_bytes(key, raw)
        s.write_json(manifest_key(key), _manifest(raw, t.round, t.worker, read_manifest(s, t.base_key)["digest"], **extra))
    return plant


def _plant_fifo(s: Storage, t) -> None:
    key = L.contribution(t.round, t.worker)
    os.makedirs(os.path.dirname(s.path(key)), exist_ok=True)
    os.mkfifo(s.path(key))  # opening it to read would block until someone writes: forever
    s.write_json(manifest_key(key), _manifest(b"", t.round, t.worker, read_manifest(s, t.base_key)["digest"]))


def _plant_symlink(s: Storage, t) -> None:
    """A link to a valid checkpoint outside the run (a co-tenant's), with its manifest beside the link."""
    outside = Storage(str(Path(s.root).parent / "elsewhere"))
    write_checkpoint(outside, "w.safetensors", {n: v + 100.0 for n, v in G0.items()})
    key = L.contribution(t.round, t.worker)
    os.makedirs(os.path.dirname(s.path(key)), exist_ok=True)
    os.symlink(outside.path("w.safetensors"), s.path(key))
    raw = Path(outside.path("w.safetensors")).read_bytes()
    s.write_json(manifest_key(key), _manifest(raw, t.round, t.worker, read_manifest(s, t.base_key)["digest"]))


def _plant_tokens(tokens: float):
    def plant(s: Storage, t) -> None:  # a valid all-zero checkpoint whose manifest claims `tokens`
        write_checkpoint(s, L.contribution(t.round, t.worker), {n: torch.zeros_like(v) for n, v in G0.items()},
                         manifest={"round": t.round, "worker": t.worker, **WORK, "tokens": tokens,
                                   "base_digest": read_manifest(s, t.base_key)["digest"]})
    return plant


LIVE = {
    **{name: (_plant_bytes(raw), why) for name, (raw, why) in HEADERS.items()},
    "fifo": (_plant_fifo, "named pipe (FIFO)"),
    "symlink-outside": (_plant_symlink, "symbolic link"),
    "tokens-1e30": (_plant_tokens(1e30), "claims 1e+30 tokens"),
    "tokens-0": (_plant_tokens(0), "claims 0 tokens"),
}


def _run(tmp_path, behaviour, workers: int = 2, quorum: int = 1) -> Storage:
    return scripted_run(tmp_path, Scripted(behaviour), [f"round.min_workers={quorum}", "round.poll_s=0.05",
                        "round.max_retries=0", "outer.optimizer=sgd", "outer.lr=1.0"], workers=workers, g0=G0)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(LIVE))
def test_a_planted_contribution_is_one_rejection_and_the_run_finishes(tmp_path, case):
    plant, why = LIVE[case]
    s = _run(tmp_path, {1: plant})
    rec = s.read_json(L.round_record(0))
    assert rec["merged"] == [0] and rec["rejected"] == [1], rec
    assert why in rec["rejected_reasons"]["1"] and "worker_001" in rec["rejected_reasons"]["1"], rec["rejected_reasons"]
    got = load_checkpoint(s, L.global_weights(1))[0]
    assert all(torch.equal(got[n], G0[n] - 0.5) for n in G0)  # worker 0's alone
    assert s.list(L.contributions_dir(0)) == ["worker_000.json", "worker_000.safetensors"]  # set aside
    reason = s.read_json(L.rejected_reason(0, 1, 1))
    assert reason["worker"] == 1 and why in reason["reason"]


@pytest.mark.slow
def test_a_round_whose_every_manifest_says_zero_tokens_fails_cleanly_and_resume_is_not_poisoned(tmp_path):
    """Both workers' contributions are refused: the quorum cannot be met, so the run stops with
    the reasons (not a ValueError in the weighting), and the planted files are out of the round,
    so starting the service again does not die on them either."""
    with pytest.raises(RunError, match="round 0 cannot be merged") as info:
        _run(tmp_path, {0: _plant_tokens(0), 1: _plant_tokens(0)})
    assert "Traceback" not in str(info.value)
    s = Storage(str(tmp_path / "run"))
    assert s.list(L.contributions_dir(0)) == []
    jobs = s.read_json(L.round_jobs(0))
    assert all("claims 0 tokens" in e["failures"][0]["rejected"] for e in jobs["workers"].values())


# -- offline: orchestrate merge ------------------------------------------------------------------
def _good(tmp_path: Path) -> str:
    write_checkpoint(Storage(str(tmp_path)), "good.safetensors", G0)
    return str(tmp_path / "good.safetensors")


def _merge_cli(capsys, *args: str) -> tuple[int, str]:
    rc = main(["merge", *args])
    said = capsys.readouterr()
    return rc, said.out + said.err


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_orchestrate_merge_refuses_a_bad_header_naming_the_file_and_writes_nothing(tmp_path, capsys, case):
    raw, why = HEADERS[case]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(raw)
    rc, out = _merge_cli(capsys, _good(tmp_path), str(bad), "--out", str(tmp_path / "out.safetensors"))
    assert rc == 2 and "Traceback" not in out
    assert any(str(bad) in line and why in line for line in out.splitlines()), out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(("out", ".tmp"))]


def test_orchestrate_merge_refuses_a_fifo_at_once(tmp_path, capsys):
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    rc, out = _merge_cli(capsys, _good(tmp_path), str(fifo), "--out", str(tmp_path / "out.safetensors"))
    assert rc == 2 and any(str(fifo) in line and "named pipe (FIFO)" in line for line in out.splitlines()), out
    assert not (tmp_path / "out.safetensors").exists()


def _hf_dir(tmp_path: Path, shard: str) -> Path:
    d = tmp_path / "hf"
    d.mkdir()
    write_checkpoint(Storage(str(d)), "model-00001.safetensors", G0)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {"b": shard, "w": shard}}))
    return d


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_an_index_naming_a_shard_outside_its_directory_is_refused_and_nothing_outside_out_is_written(
        tmp_path, capsys, where):
    victim = tmp_path / "victim.safetensors"
    write_checkpoint(Storage(str(tmp_path)), "victim.safetensors", G0)
    before = victim.read_bytes()
    shard = str(victim) if where == "absolute" else "../victim.safetensors"
    hf = _hf_dir(tmp_path, shard)
    other = tmp_path / "other"
    other.mkdir()
    write_checkpoint(Storage(str(other)), "model.safetensors", G0)
    rc, out = _merge_cli(capsys, str(hf), str(other), "--out", str(tmp_path / "out"))
    assert rc == 2 and "not plain .safetensors file names in the model directory" in out and "Traceback" not in out
    assert victim.read_bytes() == before and not (tmp_path / "out").exists()


def test_an_index_whose_metadata_is_not_an_object_is_refused(tmp_path, capsys):
    hf = _hf_dir(tmp_path, "model-00001.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": [""], "weight_map": {"b": "model-00001.safetensors", "w": "model-00001.safetensors"}}))
    rc, out = _merge_cli(capsys, str(hf), _good(tmp_path), "--out", str(tmp_path / "out"))
    assert rc == 2 and "its metadata is not a JSON object" in out and "Traceback" not in out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_an_output_that_is_an_input_by_another_name_is_refused(tmp_path, capsys, how):
    good = _good(tmp_path)
    write_checkpoint(Storage(str(tmp_path)), "b.safetensors", {n: v + 1 for n, v in G0.items()})
    alias = tmp_path / "alias.safetensors"
    (os.symlink if how == "symlink" else os.link)(good, alias)
    before = Path(good).read_bytes()
    rc, out = _merge_cli(capsys, good, str(tmp_path / "b.safetensors"), "--out", str(alias))
    assert rc == 2 and "(the same file)" in out
    assert Path(good).read_bytes() == before


# -- fuzzing the manual merge's inputs ---------------------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20)
_fuzz_dirs = iter(range(10**9))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.dictionaries(st.sampled_from(["b", "w", "__metadata__", "x"]), JSON, max_size=3) | JSON,
       data=st.binary(max_size=32))
def test_fuzzed_headers_through_orchestrate_merge_give_a_merge_error(tmp_path, header, data):
    """Any header and data section where an input should be: the merge succeeds or raises the
    project's own MergeError, nothing else, and writes nothing when it fails."""
    from merge.manual import ManualMerge, MergeError, manual_merge
    d = tmp_path / f"f{next(_fuzz_dirs)}"
    d.mkdir()
    write_checkpoint(Storage(str(d)), "good.safetensors", G0)
    (d / "bad.safetensors").write_bytes(_raw(header, data))
    try:
        manual_merge(ManualMerge([str(d / "good.safetensors"), str(d / "bad.safetensors")], str(d / "out.safetensors")))
    except MergeError:
        assert not (d / "out.safetensors").exists()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(index=st.dictionaries(st.sampled_from(["weight_map", "metadata"]), JSON | st.dictionaries(
    st.sampled_from(["b", "w", "x"]), st.sampled_from(["model-00001.safetensors", "../x.safetensors", "/etc/passwd",
                                                     "a/b.safetensors", "", "model-00001.json"]) | JSON), max_size=2) | JSON)
def test_fuzzed_hf_indexes_give_a_merge_error_and_write_nothing_outside_out(tmp_path, index):
    from merge.manual import ManualMerge, MergeError, manual_merge
    d = tmp_path / f"i{next(_fuzz_dirs)}"
    (d / "hf").mkdir(parents=True)
    write_checkpoint(Storage(str(d / "hf")), "model-00001.safetensors", G0)
    (d / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    write_checkpoint(Storage(str(d)), "other.safetensors", G0)
    try:
        manual_merge(ManualMerge([str(d / "hf"), str(d / "other.safetensors")], str(d / "out")))
    except MergeError:
        assert not (d / "out").exists()
    assert sorted(p.name for p in d.iterdir()) in (["hf", "other.json", "other.safetensors"],
                                                    ["hf", "other.json", "other.safetensors", "out"])


@pytest.mark.slow
def test_a_valid_contribution_landing_during_the_merge_is_not_set_aside_as_the_refused_one(tmp_path, monkeypatch):
    """Worker 1's key holds a refused file when the merge reads it; its real, valid contribution lands
    after that, before the refused one is set aside (seen live 44 and 80 ms into a merge). The valid
    file stays at its key, nothing is moved to rejected/ under the old reason, and jobs.json says why."""
    from orchestrator.round_merge import RoundMerger
    real_commit = RoundMerger.commit

    def commit_after_a_valid_one_landed(self, jobs, record):
        key = L.contribution(0, 1)
        write_checkpoint(self.storage, key, {n: v - 0.25 for n, v in G0.items()},
                         manifest={"round": 0, "worker": 1, **WORK, "base_digest": read_manifest(self.storage, L.global_weights(0))["digest"]})
        return real_commit(self, jobs, record)

    monkeypatch.setattr(RoundMerger, "commit", commit_after_a_valid_one_landed)
    s = _run(tmp_path, {1: _plant_tokens(1e30)})
    rec = s.read_json(L.round_record(0))
    assert rec["merged"] == [0] and rec["rejected"] == [1]
    assert read_manifest(s, L.contribution(0, 1))["tokens"] == WORK["tokens"]  # the valid one, still at its key
    assert not s.exists(L.rejected_reason(0, 1, 1)) and not s.exists(L.rejected_contribution(0, 1, 1))
    failure = s.read_json(L.round_jobs(0))["workers"]["1"]["failures"][-1]
    assert "claims 1e+30 tokens" in failure["rejected"] and "not set aside" in failure["left_in_place"]


@pytest.mark.slow
@pytest.mark.parametrize("what", ["link", "file"])
def test_a_planted_rejected_folder_is_one_refusal_and_the_run_goes_on(tmp_path, what):
    """rounds/r/rejected/ planted as a link (outside the run) or a file: the refused contribution cannot
    be set aside there, so it is removed (its reason stays in jobs.json and the record); nothing is
    written through the link, the planted thing is left where it is, and the round commits."""
    raw, why = HEADERS["dtype-list"]
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    def planting(s: Storage, t) -> None:
        at = Path(s.path(L.round_dir(t.round))) / "rejected"
        os.symlink(outside, at) if what == "link" else at.write_text("not a folder")
        _plant_bytes(raw)(s, t)
    s = _run(tmp_path, {1: planting})
    rec = s.read_json(L.round_record(0))
    assert rec["merged"] == [0] and rec["rejected"] == [1] and why in rec["rejected_reasons"]["1"], rec
    assert list(outside.iterdir()) == []
    at = Path(s.path(L.round_dir(0))) / "rejected"
    assert at.is_symlink() if what == "link" else at.read_text() == "not a folder"
    assert s.list(L.contributions_dir(0)) == ["worker_000.json", "worker_000.safetensors"]
    failure = s.read_json(L.round_jobs(0))["workers"]["1"]["failures"][-1]
    assert "could not be set aside" in failure["not_set_aside"] and "so it was removed" in failure["not_set_aside"]


@pytest.mark.slow
def test_a_refused_contribution_that_cannot_be_set_aside_still_lets_its_worker_run_again(tmp_path):
    """Quorum 2: the refusal takes the round below its quorum, so the worker reruns; with rejected/ a
    link the refused file is removed, and the rerun's contribution is merged."""
    raw, _ = HEADERS["dtype-list"]
    tries = []

    def first_bad(s: Storage, t) -> None:
        tries.append(t.round)
        if len(tries) == 1:
            os.symlink(tmp_path, Path(s.path(L.round_dir(t.round))) / "rejected")
            _plant_bytes(raw)(s, t)
        else:
            publish(s, t.round, t.worker, t.base_key, -0.5)
    s = scripted_run(tmp_path, Scripted({1: first_bad}), [
        "round.min_workers=2", "round.poll_s=0.05", "round.max_retries=1", "outer.optimizer=sgd", "outer.lr=1.0"], g0=G0)
    rec = s.read_json(L.round_record(0))
    assert rec["merged"] == [0, 1] and len(tries) == 2, rec
