"""Every write, rename, folder creation and removal of a local run directory stays inside it
(core/storage.py Storage.confine), as its reads do: a co-tenant who replaces `final/`, `metrics/` or
a round's `rejected/` by a link to a folder elsewhere receives nothing. Real links, real files."""
from __future__ import annotations

import os
import stat
import time

import pytest
import torch

from core.checkpoint_writer import write_checkpoint
from core.errors import IslandsError, NotARegularFile
from core.storage import Storage


@pytest.fixture
def run_and_outside(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir(mode=0o700)
    outside.mkdir()
    return Storage(str(run)), outside


@pytest.mark.parametrize("folder", ["final", "metrics", "rounds/00000/rejected"])
def test_nothing_is_written_through_a_planted_link(run_and_outside, folder):
    s, outside = run_and_outside
    os.makedirs(os.path.dirname(s.path(folder)), exist_ok=True)
    os.symlink(outside, os.path.join(s.root, folder))
    with pytest.raises(NotARegularFile, match="outside the run directory"):
        s.write_bytes(f"{folder}/file.json", b"{}")
    with pytest.raises(NotARegularFile):
        write_checkpoint(s, f"{folder}/model.safetensors", {"w": torch.ones(2)})
    s.write_bytes("rounds/00000/contrib/worker_001.safetensors", b"x")
    with pytest.raises(NotARegularFile):
        s.move("rounds/00000/contrib/worker_001.safetensors", f"{folder}/worker_001.safetensors")
    with pytest.raises(NotARegularFile):
        s.makedirs_path(s.path(f"{folder}/deeper"))
    (outside / "victim").write_bytes(b"keep")
    with pytest.raises(NotARegularFile):
        s.remove(f"{folder}/victim")
    assert sorted(os.listdir(outside)) == ["victim"] and (outside / "victim").read_bytes() == b"keep"
    assert s.exists("rounds/00000/contrib/worker_001.safetensors")  # not moved either


def test_the_sweep_of_temporaries_does_not_follow_a_link_out(run_and_outside):
    s, outside = run_and_outside
    old = outside / ".tmp-0123456789ab-someone-elses"
    old.write_bytes(b"x")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    os.symlink(outside, os.path.join(s.root, "metrics"))
    s.sweep_temporaries(3600)
    assert old.exists()


def test_a_link_inside_the_run_is_no_escape_and_links_a_user_names_are_followed(tmp_path):
    run = tmp_path / "run"
    (run / "real").mkdir(parents=True)
    os.symlink(run / "real", run / "alias")
    s = Storage(str(run))
    s.write_bytes("alias/x.json", b"{}")  # resolves inside the run: allowed
    assert (run / "real" / "x.json").exists()
    os.symlink(tmp_path, run / "up")
    Storage(str(run), follow_links=True).write_bytes("up/mine.json", b"{}")  # a path the user named
    assert (tmp_path / "mine.json").exists()


def test_the_run_log_is_private_and_never_written_through_a_link(tmp_path):
    import logging

    from orchestrator.console import log_to_file
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        log_to_file(tmp_path / "orchestrator.log")
        assert stat.S_IMODE(os.stat(tmp_path / "orchestrator.log").st_mode) == 0o600
        (tmp_path / "elsewhere.txt").write_text("keep")
        os.symlink(tmp_path / "elsewhere.txt", tmp_path / "linked.log")
        with pytest.raises(IslandsError, match="cannot open the run's log"):
            log_to_file(tmp_path / "linked.log")
        assert (tmp_path / "elsewhere.txt").read_text() == "keep"
    finally:
        for h in root.handlers[len(before):]:
            root.removeHandler(h)
