"""Every write, rename, folder creation and removal of a local run directory stays inside it
(core/local_files.py: done by name in a folder descriptor reached from the root without following a
link), as its reads do: a co-tenant who replaces `final/`, `metrics/` or a round's
`rejected/` by a link to a folder elsewhere, before a write or while it runs, receives nothing.
Real links, real files, a real second process swapping them."""
from __future__ import annotations

import ctypes
import errno
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from core.checkpoint_writer import write_checkpoint
from core.errors import IslandsError, NotARegularFile, StorageError
from core.local_files import LocalFiles
from core.storage import Storage, sweep_temporaries


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
        s.files.makedirs(s.path(f"{folder}/deeper"))
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
    sweep_temporaries(s, 3600)
    assert old.exists()


def test_no_link_is_followed_inside_the_run_and_links_a_user_names_are(tmp_path):
    run = tmp_path / "run"
    (run / "real").mkdir(parents=True)
    os.symlink(run / "real", run / "alias")
    s = Storage(str(run))
    with pytest.raises(NotARegularFile, match="alias is a symbolic link"):
        s.write_bytes("alias/x.json", b"{}")  # inside the run or not: what it leads to can change
    assert not (run / "real" / "x.json").exists()
    os.symlink(tmp_path, run / "up")
    Storage(str(run), follow_links=True).write_bytes("up/mine.json", b"{}")  # a path the user named
    assert (tmp_path / "mine.json").exists()
    linked_root = tmp_path / "linked-run"
    os.symlink(run, linked_root)
    Storage(str(linked_root)).write_bytes("real/y.json", b"{}")  # the root itself: the user's path
    assert (run / "real" / "y.json").read_bytes() == b"{}"


SWAPPER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b, stop = (p.encode() for p in sys.argv[1:])
n = 0
while not os.path.exists(stop):
    for _ in range(1000):
        if libc.renameat2(-100, a, -100, b, 2) != 0:  # AT_FDCWD, RENAME_EXCHANGE: `a` always exists
            sys.exit(f"renameat2: errno {ctypes.get_errno()}")
        n += 1
print(n)
"""


def test_a_link_swapped_in_while_files_are_written_receives_nothing(run_and_outside, tmp_path):
    """Another process swaps `final/` with a link to a folder outside the run and back, as fast as
    it can, while files are written and moved there: whatever is refused, nothing lands outside
    (a check of the path before the write loses this race now and then)."""
    if not hasattr(ctypes.CDLL(None), "renameat2"):
        pytest.skip("no renameat2 in this C library")
    s, outside = run_and_outside
    final, link, stop = s.path("final"), s.path("final-link"), tmp_path / "stop"
    os.mkdir(final)
    os.symlink(outside, link)
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, final, link, str(stop)], stdout=subprocess.PIPE, text=True)
    try:
        for i in range(5000):
            try:
                s.write_bytes(f"final/{i}.json", b"{}")
                s.move(f"final/{i}.json", f"final/moved-{i}.json")
            except (IslandsError, OSError):
                pass  # refused as a link: what matters is where nothing went
    finally:
        stop.touch()
        out, _ = swapper.communicate(timeout=60)
    assert swapper.returncode == 0 and int(out) > 5000
    assert os.listdir(outside) == []


def test_a_link_swapped_in_after_the_walk_changes_nothing(run_and_outside, monkeypatch):
    """The deterministic form of the race above: `final/` is swapped for a link to outside right
    after the last folder an operation needs was reached, before the file is created and published,
    moved or removed; each still acts in the folders it reached, inside the run."""
    s, outside = run_and_outside
    final, aside = s.path("final"), s.path("final-real")
    os.mkdir(final)
    reach, walks, swap_at = LocalFiles.open_folder, [0], [1]

    def reach_then_swap(self, path, create):
        fd = reach(self, path, create)
        walks[0] += 1
        if walks[0] == swap_at[0]:
            os.rename(final, aside)
            os.symlink(outside, final)
        return fd
    monkeypatch.setattr(LocalFiles, "open_folder", reach_then_swap)

    def put_back(walks_next_op: int) -> None:
        os.unlink(final)
        os.rename(aside, final)
        walks[0], swap_at[0] = 0, walks_next_op
    s.write_bytes("final/a.json", b"{}")  # one walk
    put_back(2)
    s.move("final/a.json", "final/b.json")  # the source's folder, then the destination's
    assert os.listdir(aside) == ["b.json"]
    put_back(1)
    s.remove("final/b.json")
    assert os.listdir(outside) == [] and os.listdir(aside) == []


def test_a_file_replaced_at_the_moment_it_is_moved_aside_stays_in_place(tmp_path, monkeypatch):
    """move_if renames first and checks what it renamed: a new file put at the key just before the
    rename (after its identity was taken) is put back, not moved under the old one's name."""
    s = Storage(str(tmp_path / "run"))
    s.write_bytes("contrib/w.bin", b"refused")
    seen = s.identity("contrib/w.bin")
    rename = os.rename

    def land_first(src, dst, **kw):
        if src == "w.bin":  # the new file lands between the identity check and the rename
            (tmp_path / "new").write_bytes(b"valid")
            os.replace(tmp_path / "new", s.path("contrib/w.bin"))
        return rename(src, dst, **kw)
    monkeypatch.setattr(os, "rename", land_first)
    assert not s.move_if("contrib/w.bin", "rejected/w.bin", seen)
    assert s.read_bytes("contrib/w.bin") == b"valid" and not s.exists("rejected/w.bin")
    monkeypatch.setattr(os, "rename", rename)
    assert s.move_if("contrib/w.bin", "rejected/w.bin", s.identity("contrib/w.bin"))
    assert s.read_bytes("rejected/w.bin") == b"valid" and not s.exists("contrib/w.bin")
    assert s.move_if("contrib/w.bin", "rejected/again.bin", None)  # nothing there, nothing seen: done
    s.write_bytes("contrib/w.bin", b"newer")  # where hard links are refused, it is renamed back instead

    def no_links(*a, **kw):
        raise OSError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(os, "link", no_links)
    assert not s.move_if("contrib/w.bin", "rejected/w2.bin", seen) and s.read_bytes("contrib/w.bin") == b"newer"
    assert not s.exists("rejected/w2.bin")


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


def test_a_file_where_a_folder_is_due_is_one_clear_error_at_once(run_and_outside):
    s, _ = run_and_outside
    (Path(s.root) / "final").write_bytes(b"not a folder")
    with pytest.raises(StorageError, match="Not a directory; a file stands where a folder of that path is due: move the file aside") as info:
        s.write_bytes("final/model.json", b"{}")
    assert "attempts" not in str(info.value)  # not retried: no wait makes it a folder
    assert s.move_if("nowhere/w.bin", "rejected/w.bin", None)  # no source folder: nothing to set aside


@pytest.mark.parametrize("plant", ["a link to a folder outside", "a link in final/", "a file"])
def test_a_planted_final_is_replaced_and_the_run_delivers_its_model(dense_run, tmp_path, capsys, plant):
    """Every round committed, `final/` planted (a link out, a link at final/model.json, a file):
    resume removes what was planted (never what a link leads to) and writes the final model in the
    run: it finishes (rc 0), never `stopped`."""
    import shutil
    from core.checkpoint import read_manifest
    from orchestrator.cli import main
    run, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(dense_run, run, symlinks=True)
    outside.mkdir()
    (outside / "model.json").write_text('{"digest": "theirs"}')
    final = run / "final"
    shutil.rmtree(final)
    if plant == "a link to a folder outside":
        final.symlink_to(outside, target_is_directory=True)
    elif plant == "a link in final/":
        final.mkdir()
        (final / "model.json").symlink_to(outside / "model.json")
    else:
        final.write_bytes(b"not a folder")
    capsys.readouterr()
    assert main(["resume", str(run)]) == 0, capsys.readouterr().out
    said = capsys.readouterr()
    assert "where the run's final model goes: removed" in said.out + said.err
    s = Storage(str(run))
    assert final.is_dir() and not final.is_symlink() and not (final / "model.json").is_symlink()
    assert read_manifest(s, "final/model.safetensors")["digest"] == read_manifest(s, "global/round_00002.safetensors")["digest"]
    assert sorted(os.listdir(outside)) == ["model.json"] and (outside / "model.json").read_text() == '{"digest": "theirs"}'
