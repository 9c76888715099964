"""Progress of long operations: plain periodic log lines by default, rich bars only on a terminal."""
from __future__ import annotations

import io
import logging
import os
import select
import time

import pytest
import torch
from rich.console import Console
from safetensors.torch import save_file

from core import progress
from orchestrator import progress_bars


@pytest.fixture(autouse=True)
def plain(monkeypatch):
    """Every test starts and ends with the default: plain lines, no renderer."""
    previous = progress.set_renderer(None)
    yield
    progress.set_renderer(previous)


def test_plain_lines_at_most_every_interval(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="core.progress")
    monkeypatch.setattr(progress, "DEFAULT_INTERVAL_S", 0.05)
    with progress.progress(6, "copying", unit="files") as task:
        for _ in range(3):
            task.advance()
            task.advance()  # two advances within one interval: at most one line
            time.sleep(0.06)
    lines = [r.getMessage() for r in caplog.records]
    assert 1 <= len(lines) - 1 <= 3 and lines[-1].startswith("copying: done, 6/6 files (100%)"), lines
    assert all(line.startswith("copying: ") and "\r" not in line and "\x1b" not in line for line in lines)
    assert "files (" in lines[0] and "%) after" in lines[0]


def test_a_short_operation_logs_nothing(caplog):
    caplog.set_level(logging.INFO, logger="core.progress")
    assert list(progress.track(range(1000), "quick")) == list(range(1000))  # far under 30 s
    assert caplog.records == []


def test_track_counts_sizes_and_says_where_it_stopped(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="core.progress")
    monkeypatch.setattr(progress, "DEFAULT_INTERVAL_S", 0.0)
    items = [3, 1, 2_000]
    with pytest.raises(RuntimeError):
        for n in progress.track(items, "merge", unit="values", size=lambda n: n):
            if n == 2_000:
                raise RuntimeError("boom")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("merge: 3/2.0k values (0%)") and lines[1].startswith("merge: 4/2.0k values")
    assert lines[-1].startswith("merge: stopped at 4/2.0k values"), lines


def test_rich_bars_only_on_a_terminal(tmp_path):
    not_a_tty = Console(file=io.StringIO(), force_terminal=None)
    assert not_a_tty.is_terminal is False and progress_bars.install(not_a_tty) is False
    assert progress._renderer is None
    log_file = open(tmp_path / "slurm.log", "w")
    assert progress_bars.install(Console(file=log_file)) is False and progress._renderer is None
    master, slave = os.openpty()
    tty = os.fdopen(slave, "w")
    try:
        console = Console(file=tty, force_terminal=None, width=100)
        assert progress_bars.install(console) is True
        assert isinstance(progress._renderer, progress_bars.RichBars)
        with progress.progress(4, "outer", unit="files") as outer:
            with progress.progress(None, "inner", unit="values") as inner:  # nested: one live display
                inner.advance(10)
            outer.advance(4)
        assert progress._renderer.open == 0 and not progress._renderer.bars.live.is_started
        drawn = _read_all(master).decode(errors="replace")
        assert "outer" in drawn and "\x1b[" in drawn  # a bar, drawn with terminal escape codes
    finally:
        tty.close()
        os.close(master)
        log_file.close()


def test_the_cli_installs_no_bars_off_a_terminal_and_merges_log_plain_lines(tmp_path, monkeypatch, capsys):
    """`orchestrate merge` under pytest writes to pipes: the merge engine's progress comes as lines."""
    from orchestrator.cli import main

    progress.set_renderer(lambda total, desc, unit: pytest.fail("a bar was drawn off a terminal"))
    monkeypatch.setattr(progress, "DEFAULT_INTERVAL_S", 0.0)
    for i in range(2):
        save_file({"w": torch.full((4, 4), float(i)), "b": torch.ones(3)}, str(tmp_path / f"m{i}.safetensors"))
    out = tmp_path / "avg.safetensors"
    argv = ["merge", str(tmp_path / "m0.safetensors"), str(tmp_path / "m1.safetensors"), "--out", str(out)]
    capsys.readouterr()
    assert main(argv) == 0
    assert progress._renderer is None
    err = capsys.readouterr().err  # what a Slurm log file would hold: plain lines
    lines = [line for line in err.splitlines() if "core.progress" in line]
    assert lines and lines[-1].endswith(f"core.progress: merge into {out}: done, 19/19 values (100%) in 0s"), err
    assert "\r" not in err and "\x1b" not in err


def _read_all(fd: int) -> bytes:
    """Everything written to the pty so far: one read may return only its first chunk (on a loaded
    machine it returned the cursor-hiding escape alone), so read until nothing more is pending."""
    out = b""
    while select.select([fd], [], [], 1.0)[0]:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        out += chunk
    return out
