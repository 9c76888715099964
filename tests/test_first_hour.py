"""What a new user meets in the first hour (issue #44), through the real command line: a mistake in
a path is one clear line naming what to give instead, never a traceback; bare `orchestrate` shows
what it can do; `--version` says which islands this is; help with examples that fit 80 columns;
Ctrl-C tells to resume only where there is a run to resume."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.checkpoint_writer import write_checkpoint
from core.storage import Storage

ROOT = Path(__file__).resolve().parent.parent


def orchestrate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("command", [["status"], ["resume"], ["cancel"], ["submit", "--executor", "local", "--run-dir"]])
def test_a_file_given_as_the_run_directory_is_named_with_the_folder_to_give(tmp_path, command):
    (tmp_path / "run").mkdir()
    config = tmp_path / "run" / "config.yaml"
    config.write_text("workers: 2\n")
    done = orchestrate(*command, str(config))
    assert done.returncode == 2 and "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert f"error: {config} is a file, not a run directory: give the run directory itself (here perhaps " \
           f"{tmp_path / 'run'})" in done.stdout
    assert config.read_text() == "workers: 2\n" and sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.yaml"]


def test_merging_a_file_that_is_not_safetensors_is_one_problem_not_a_traceback(tmp_path):
    write_checkpoint(Storage(str(tmp_path)), "a.safetensors", {"w": torch.ones(2)})
    (tmp_path / "notes.json").write_text("{}")
    done = orchestrate("merge", str(tmp_path / "a.safetensors"), str(tmp_path / "notes.json"), "--out",
                       str(tmp_path / "out.safetensors"))
    assert done.returncode == 2 and "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert f"{tmp_path / 'notes.json'}: not a .safetensors file nor a model directory" in done.stdout
    assert not (tmp_path / "out.safetensors").exists()


def test_a_small_merge_reports_its_bytes_in_a_unit_that_shows_them(tmp_path):
    for name in ("a", "b"):
        write_checkpoint(Storage(str(tmp_path)), f"{name}.safetensors", {"w": torch.ones(1000)})
    done = orchestrate("merge", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--out",
                       str(tmp_path / "out.safetensors"))
    assert done.returncode == 0 and "merged 2 input(s) with average: 8.1kB read in " in done.stdout, done.stdout
    assert "0.00 GB" not in done.stdout


def test_evaluating_a_path_that_does_not_exist_says_so(tmp_path):
    done = orchestrate("eval", str(tmp_path / "nothing.safetensors"))
    assert done.returncode == 2 and "Traceback" not in done.stdout + done.stderr
    assert f"error: {tmp_path / 'nothing.safetensors'}: no such file or directory" in done.stdout


def test_bare_orchestrate_lists_the_commands_and_version_names_islands():
    bare = orchestrate()
    assert bare.returncode == 0 and "usage: orchestrate" in bare.stdout and "submit" in bare.stdout, bare.stderr
    assert "error" not in bare.stdout + bare.stderr
    version = orchestrate("--version")
    from importlib.metadata import version as installed
    assert version.returncode == 0 and version.stdout.strip() == f"orchestrate (islands) {installed('islands')}"


def test_submit_help_has_examples_that_fit_80_columns_and_eval_json_is_explained():
    import os
    env = {**os.environ, "COLUMNS": "80"}
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)
    examples = done.stdout.split("examples:\n", 1)[1]
    assert "orchestrate submit --workers 4 --rounds 8" in examples and max(map(len, examples.splitlines())) <= 80
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "eval", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)
    assert "--json" in done.stdout and "as one JSON object" in " ".join(done.stdout.split())


@pytest.mark.parametrize("command, resume", [(["eval", "x.safetensors"], False), (["status", "RUN"], False),
                                             (["submit"], True)])
def test_ctrl_c_in_a_command_tells_resume_only_where_a_run_can_be_resumed(monkeypatch, capsys, command, resume):
    from orchestrator import cli

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setitem(cli.COMMANDS, command[0], interrupted)  # Ctrl-C inside the command, wherever it is
    assert cli.main(command) == 130
    out = capsys.readouterr().out
    assert out.startswith("interrupted") and ("orchestrate resume RUN" in out) == resume


# `orchestrate` as its console script runs it (orchestrator.launch.main), SIGINT at its default as
# in a terminal's foreground job, and a Ctrl-C delivered at a chosen moment: while a module imports
# (an import hook), or while the interpreter exits (an exit hook, run last).
AT_IMPORT = """
import os, signal, sys
class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            os.kill(os.getpid(), signal.SIGINT)
sys.meta_path.insert(0, CtrlC())
"""
AT_EXIT = """
import atexit, os, signal, sys, time
atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(5)))
"""


@pytest.mark.parametrize("hook, argv, printed", [
    (AT_IMPORT.format(module="core.config"), ["--version"], ""),  # the CLI's own modules
    (AT_IMPORT.format(module="fsspec"), ["--version"], ""),  # a subcommand's, imported to build the parser
    # torch's C init imports numpy and would drop the KeyboardInterrupt: `eval` then ran on, its error printed
    (AT_IMPORT.format(module="numpy"), ["eval", "x.safetensors"], ""),
    (AT_EXIT, ["--version"], "orchestrate (islands)")])
def test_ctrl_c_while_the_cli_imports_or_exits_prints_no_traceback(hook, argv, printed):
    """Python would print a KeyboardInterrupt traceback (at exit: "Exception ignored in atexit
    callback"); the command ends at once, by the signal, as a C program does, its output kept."""
    code = hook + f"from orchestrator.launch import main\nsys.argv[1:] = {argv!r}\nsys.exit(main())\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == -signal.SIGINT, (done.returncode, done.stdout, done.stderr)
    assert done.stderr == "" and done.stdout.startswith(printed), (done.stdout, done.stderr)


def test_verbose_records_on_a_terminal_name_their_level_once(monkeypatch):
    """`-v` on a terminal: rich prints the time and the level; the record itself is `name: message`,
    not logging's default `INFO:name:message` after rich's INFO."""
    import logging

    from core import progress
    from orchestrator.console import setup_logging
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    try:
        setup_logging(True)
        handler = root.handlers[0]
        record = logging.LogRecord("merge.rounds", logging.INFO, __file__, 1, "merge: folded worker %d", (0,), None)
        assert type(handler).__name__ == "RichHandler" and handler.format(record) == "merge.rounds: merge: folded worker 0"
    finally:  # what setup_logging set for the whole process: the other tests' logging and progress lines
        root.handlers[:] = handlers
        root.setLevel(level)
        progress.set_renderer(None)


def test_a_round_line_wider_than_the_terminal_wraps_between_words(tmp_path):
    import io

    from rich.console import Console

    from core.config import config_from_dict
    from orchestrator.run_view import RunView
    cfg = config_from_dict({"workers": 2, "rounds": 3})
    rec = {"round": 0, "eval_loss": 5.4896, "merged": [0, 1], "dropped": [], "rejected": [], "merge_seconds": 0.02,
           "worker_train_s": {"0": 9.0}, "worker_idle_s": {"0": 1.0}, "round_s": 12.0, "committed_at": 1000.0}
    printed = {}
    for terminal in (False, True):
        out = Console(file=io.StringIO(), width=80, force_terminal=terminal, color_system=None)
        view = RunView(out, Storage(str(tmp_path)), cfg, first_round=0)
        view.round_done(rec)
        printed[terminal] = out.file.getvalue().splitlines()
    (whole,) = printed[False]  # a pipe or a log gets it whole
    assert len(whole) > 80 and whole.startswith("round 0 (1/3): eval loss 5.4896, merged 2/2, merge 0.02s, round ")
    assert all(len(line) <= 80 for line in printed[True]) and " ".join(x.strip() for x in printed[True]) == whole


def test_the_round_line_and_the_footer_say_one_eta(tmp_path):
    """Both are RunView.eta(): the mean round time of this service's rounds (RoundRecord.round_s)
    times the rounds left, less what the round in progress has run."""
    import io
    import time

    from rich.console import Console

    from core.config import config_from_dict
    from orchestrator.run_view import RunView
    cfg = config_from_dict({"workers": 2, "rounds": 4})
    out = Console(file=io.StringIO(), width=200, force_terminal=True, color_system=None)
    view = RunView(out, Storage(str(tmp_path)), cfg, first_round=0)
    rec = {"round": 0, "eval_loss": 5.0, "merged": [0, 1], "dropped": [], "rejected": [], "merge_seconds": 0.02,
           "round_s": 100.0, "committed_at": time.time() - 10}  # committed 10 s ago, evaluated since
    view.round_done(rec)
    line = out.file.getvalue()
    assert ", round 1m40s, ETA 4m50s" in line, line  # 3 rounds left x 100 s, less the 10 s since the commit
    head = view.footer().renderables[0].plain
    assert head.startswith("round 1 (2/4) running for 10s, ETA 4m50s, 36 rounds/h"), head


def test_the_first_eta_leaves_out_the_start_of_persistent_workers(tmp_path):
    """The first round of a service holds its persistent workers' start (processes, imports, the
    model built): only their round time (worker_train_s) and the merge come again; per-round jobs
    start every round, so their whole first round does."""
    import io
    import time

    from rich.console import Console

    from core.config import config_from_dict
    from orchestrator.run_view import RunView
    rec = {"round": 0, "eval_loss": 5.0, "merged": [0, 1], "dropped": [], "rejected": [], "merge_seconds": 2.0,
           "worker_train_s": {"0": 30.0, "1": 28.0}, "round_s": 100.0, "committed_at": time.time() - 10}
    for mode, eta in (("persistent", "ETA 1m26s"), ("per_round", "ETA 4m50s")):  # 3 x (30 + 2) - 10; 3 x 100 - 10
        out = Console(file=io.StringIO(), width=200, force_terminal=True, color_system=None)
        view = RunView(out, Storage(str(tmp_path)), config_from_dict({"workers": 2, "rounds": 4,
                                                                      "round": {"worker_mode": mode}}), first_round=0)
        view.round_done(rec)
        assert eta in out.file.getvalue(), (mode, out.file.getvalue())
        view.round_done({**rec, "round": 1, "round_s": 40.0, "committed_at": time.time()})
        assert view.measured == ([32.0, 40.0] if mode == "persistent" else [100.0, 40.0])
    # resumed into round 2, its workers going on from mid-round: no ETA until a whole round is measured
    view = RunView(Console(file=io.StringIO()), Storage(str(tmp_path)), config_from_dict({"rounds": 4}), first_round=2)
    view.round_done({**rec, "round": 2, "round_s": 5.0, "worker_train_s": {"0": 1.0}})
    assert view.measured == [] and view.eta() is None
    view.round_done({**rec, "round": 3, "round_s": 40.0})
    assert view.measured == [32.0]
