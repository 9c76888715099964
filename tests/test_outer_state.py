"""The round merge's outer state: written beside the new global before the round is committed,
never half; and rebuilt, bit for bit, when a committed round's state is missing, or refused with
the reason when the round's inputs changed (orchestrator.outer_state). A full disk is real: a
small tmpfs, as root.
"""
from __future__ import annotations

import os

import pytest
import torch

from core.checkpoint import load_checkpoint, read_manifest
from core.checkpoint_writer import write_checkpoint
from core.config import OuterConfig
from core.errors import RunError, StorageError
from core.layout import RunLayout
from core.storage import Storage
from merge.rounds import Contribution, RunningSum, merge_round
from merge.round_spec import RoundSpec
from orchestrator.cli import main
from core.records import RecordedInput, recorded_inputs
from orchestrator.outer_state import ensure_outer_state
from orchestrator.runstate import load_run
from worker.weights import model_metadata

L = RunLayout()
NESTEROV = OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9)
ADAM = OuterConfig(optimizer="adam", lr=0.1)
TINY = ["--executor", "inline", "--workers", "3", "--rounds", "2", "--inner-steps", "2",
        "--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2", "--set", "model.block_size=32",
        "--set", "inner.batch_size=4", "--set", "data.eval_batches=1", "--set", "round.poll_s=0.1"]


def _inputs(s: Storage, n: int = 3, size: int = 1000) -> list[Contribution]:
    g = torch.Generator().manual_seed(1)
    write_checkpoint(s, "g1.safetensors", {"a": torch.randn(size, generator=g), "b": torch.randn(7, 3, generator=g)},
                     manifest={"round": 1})
    write_checkpoint(s, "s1.safetensors", {"a::momentum_buffer": torch.randn(size, generator=g),
                                           "b::momentum_buffer": torch.randn(7, 3, generator=g)}, manifest={})
    out = []
    for i in range(n):
        write_checkpoint(s, f"w{i}.safetensors", {"a": torch.randn(size, generator=g), "b": torch.randn(7, 3, generator=g)},
                         manifest={"round": 1, "worker": i})
        out.append(Contribution(i, f"w{i}.safetensors", 1.0 + i))
    return out


@pytest.mark.parametrize("outer, state_in", [(NESTEROV, "s1.safetensors"), (ADAM, None)])
def test_a_streamed_merge_over_held_copies_writes_the_bytes_of_one_over_files(tmp_path, outer, state_in):
    files, held = Storage(str(tmp_path / "files")), Storage(str(tmp_path / "held"))
    contribs = _inputs(files)
    _inputs(held)
    merge_round(files,
                RoundSpec(base="g1.safetensors", out="g2.safetensors", outer=outer, state_in=state_in,
                          state_out="s2.safetensors"), contribs)
    acc = RunningSum(held, "g1.safetensors", state_key=state_in, preload=True)  # as the service does
    for c in contribs[:-1]:  # all but the last folded while it waits
        assert acc.add(c)
    merge_round(held,
                RoundSpec(base="g1.safetensors", out="g2.safetensors", outer=outer, state_in=state_in,
                          state_out="s2.safetensors"), contribs, acc)
    for name in ("g2", "s2"):
        assert (tmp_path / "held" / f"{name}.safetensors").read_bytes() == \
            (tmp_path / "files" / f"{name}.safetensors").read_bytes()
        assert read_manifest(held, f"{name}.safetensors")["digest"] == read_manifest(files, f"{name}.safetensors")["digest"]


@pytest.fixture
def full_outer_dir(tmp_path, mount_tmpfs):
    """run/outer on a 1 MiB tmpfs (needs root), the rest of the run on the normal disk."""
    return mount_tmpfs(tmp_path / "run" / "outer")


def test_a_state_that_does_not_fit_publishes_nothing_not_even_the_global(tmp_path, full_outer_dir):
    s = Storage(str(tmp_path / "run"))
    contribs = _inputs(s, size=400_000)  # a 1.6 MB state for a 1 MiB disk
    with pytest.raises(StorageError, match=r"outer/s2\.safetensors.*No space left on device"):
        merge_round(s,
                    RoundSpec(base="g1.safetensors", out="global/g2.safetensors", outer=NESTEROV,
                              state_in="s1.safetensors", state_out="outer/s2.safetensors"), contribs)
    assert os.listdir(full_outer_dir) == []  # no temporary, no file, no manifest
    assert not s.exists("global/g2.safetensors") and s.list("global") == []


# -- rebuilding a committed round's state --------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, corpus_cache):
    """A real 3-worker, 2-round run (local executor), its outer states' bytes kept aside; every
    round's tensors kept (round.keep_last 0), so that both rounds' states can be rebuilt."""
    run = tmp_path_factory.mktemp("outer") / "run"
    assert main(["submit", "--run-dir", str(run), "--set", f"data.cache_dir={corpus_cache}", *TINY,
                 "--set", "round.keep_last=0"]) == 0
    return run, {r: (run / "outer" / f"state_{r:05d}.safetensors").read_bytes() for r in (1, 2)}


@pytest.fixture
def run_copy(tmp_path, finished_run):
    import shutil
    run, states = finished_run
    shutil.copytree(run, tmp_path / "run")
    s = Storage(str(tmp_path / "run"))
    return s, load_run(s), states


def test_recorded_inputs_are_in_the_order_summed(run_copy):
    s, _, _ = run_copy
    rec = s.read_json(L.round_record(1))
    contribs, problem = recorded_inputs(rec)
    assert problem is None
    assert [c.worker for c in contribs] == rec["merge_order"] and sorted(rec["merge_order"]) == [0, 1, 2]
    assert [c.weight for c in contribs] == [rec["weights"][str(w)] for w in rec["merge_order"]]
    _, problem = recorded_inputs({**rec, "merge_order": [0, 1]})
    assert "does not name the merged inputs [0, 1, 2]" in problem


def test_recorded_folds_keep_their_ids_when_an_earlier_fold_was_refused():
    """The service numbers every prepared fold -1, -2, ... (orchestrator.late.fold_inputs); when
    fold -1 was refused, the record lists only fold -2, under its id."""
    fold = {"id": -2, "key": "rounds/00003/folded/worker_002_from_00001.safetensors", "weight": 0.25}
    rec = {"round": 3, "merged": [0, 1], "weights": {"0": 1.0, "1": 2.0}, "folded": [fold], "merge_order": [1, -2, 0]}
    contribs, problem = recorded_inputs(rec)
    assert problem is None
    assert contribs == [RecordedInput(1, L.contribution(3, 1), 2.0), RecordedInput(-2, fold["key"], 0.25),
                        RecordedInput(0, L.contribution(3, 0), 1.0)]


@pytest.mark.parametrize("damage", ["missing", "no manifest", "bad manifest"])
def test_a_missing_state_of_a_committed_round_is_rebuilt_bit_for_bit(run_copy, damage):
    s, cfg, states = run_copy
    key = L.outer_state(2)
    if damage == "missing":
        s.remove(key)
    if damage in ("missing", "no manifest"):
        s.remove(key.replace(".safetensors", ".json"))
    else:
        s.write_bytes(key.replace(".safetensors", ".json"), b"{not json")
    ensure_outer_state(s, cfg, 2, model_metadata(cfg.model))
    assert s.read_bytes(key) == states[2]
    assert load_checkpoint(s, key)[0]  # manifest written and its digest right
    assert not s.exists(L.rebuild_dir(1))  # the redone global is not left behind


def test_two_missing_states_are_rebuilt_in_order(run_copy):
    s, cfg, states = run_copy
    for r in (1, 2):
        s.remove(L.outer_state(r).replace(".safetensors", ".json"))
    ensure_outer_state(s, cfg, 2, model_metadata(cfg.model))
    assert [s.read_bytes(L.outer_state(r)) for r in (1, 2)] == [states[1], states[2]]


def test_a_state_is_not_rebuilt_from_changed_inputs(run_copy):
    s, cfg, _ = run_copy
    s.remove(L.outer_state(2))
    s.remove(L.outer_state(2).replace(".safetensors", ".json"))
    key = L.contribution(1, 2)
    tensors = load_checkpoint(s, key)[0]
    write_checkpoint(s, key, {n: t + 1 if t.is_floating_point() else t for n, t in tensors.items()},
                     manifest={"round": 1, "worker": 2})
    with pytest.raises(RunError, match=r"cannot rebuild .*state_00002.*contributions of workers \[2\] changed.*"
                                       r"delete .*rounds/00001/record\.json"):
        ensure_outer_state(s, cfg, 2, model_metadata(cfg.model))
    assert not s.exists(L.outer_state(2)) and not s.exists(L.rebuild_dir(1))


def test_a_damaged_record_is_named_and_nothing_is_written(run_copy):
    s, cfg, _ = run_copy
    s.remove(L.outer_state(2).replace(".safetensors", ".json"))
    rec = s.read_json(L.round_record(1))
    del rec["contrib_digest"]
    s.write_json(L.round_record(1), rec)
    with pytest.raises(RunError, match=r"cannot rebuild .*state_00002.*rounds/00001/record\.json is not a record "
                                       r"islands wrote: no 'contrib_digest'; restore"):
        ensure_outer_state(s, cfg, 2, model_metadata(cfg.model))
    assert read_manifest(s, L.outer_state(2)) is None


def test_a_rebuild_that_gives_another_global_writes_nothing(run_copy):
    s, cfg, _ = run_copy
    s.remove(L.outer_state(2))
    s.remove(L.outer_state(2).replace(".safetensors", ".json"))
    rec = s.read_json(L.round_record(1))
    s.write_json(L.round_record(1), {**rec, "merge_order": [], "weights": {**rec["weights"], "0": 5.0}})
    with pytest.raises(RunError, match=r"does not give the published .*round_00002\.safetensors"):
        ensure_outer_state(s, cfg, 2, model_metadata(cfg.model))
    assert not s.exists(L.outer_state(2)) and not s.exists(L.rebuild_dir(1))


def test_a_state_write_that_fails_in_the_service_commits_nothing_and_resume_finishes(tmp_path, mount_tmpfs,
                                                                                   corpus_cache, capsys):
    """Round 0's outer state does not fit its disk (a real 1 MiB tmpfs at run/outer, filled up to
    4 KiB): the merge publishes nothing, the round is not committed, and the run stops with the
    error and what to do. Once space is freed, `orchestrate resume` merges round 0 again and
    finishes; its weights and states are, bit for bit, those of a clean run of the same config
    (contributions summed in worker order, round.stream_merge off, so the two runs sum alike). The
    stopped service stopped its local jobs: per-round jobs here, which write their state before their
    contribution, so the resumed run's round 1 starts from the state the clean run's does."""
    args = ["--set", f"data.cache_dir={corpus_cache}", "--set", "round.stream_merge=false", *TINY,
            "--set", "round.worker_mode=per_round"]
    outer = mount_tmpfs(tmp_path / "run" / "outer")
    st = os.statvfs(outer)
    filler = outer / "filler"
    filler.write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 4096))
    assert main(["submit", "--run-dir", str(tmp_path / "run"), *args]) != 0
    said = capsys.readouterr()
    assert "disk is full" in said.out and "orchestrate resume" in said.out and "Traceback" not in said.out + said.err
    s = Storage(str(tmp_path / "run"))
    assert not s.exists(L.round_record(0)) and read_manifest(s, L.global_weights(1)) is None
    filler.unlink()
    assert main(["resume", str(tmp_path / "run")]) == 0
    assert main(["submit", "--run-dir", str(tmp_path / "clean"), *args]) == 0
    clean = Storage(str(tmp_path / "clean"))
    for r in (1, 2):
        assert s.read_bytes(L.outer_state(r)) == clean.read_bytes(L.outer_state(r))
        assert s.read_bytes(L.global_weights(r)) == clean.read_bytes(L.global_weights(r))
    assert sorted(p.name for p in outer.iterdir()) == ["state_00001.json", "state_00001.safetensors",
                                                       "state_00002.json", "state_00002.safetensors"]


def test_a_forged_record_of_an_uncommitted_round_writes_nothing(run_copy):
    """Round 1's record is there (real digests, as a forger would copy them) but its global is not: the
    round was never committed, so its state is not rebuilt from it; one clear error, nothing written."""
    s, cfg, _ = run_copy
    for key in ("global/round_00002.safetensors", "global/round_00002.json", "outer/state_00002.safetensors",
                "outer/state_00002.json"):
        s.remove(key)
    with pytest.raises(RunError, match=r"round 1's record names global/round_00002.safetensors, which is not there"):
        ensure_outer_state(s, cfg, 2, model_metadata(cfg.model))
    assert not s.exists("outer/state_00002.safetensors") and not s.exists("outer/state_00002.json")
