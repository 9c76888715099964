"""What a person meets at the command line: help for every option, a reader that goes away, one
round numbering, commands that do not load torch, true job states, the screen of a run, and a
cancel that stops everything."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.config import config_from_dict
from core.storage import Storage
from orchestrator.cli import build_parser, main
from orchestrator.executor import CANCELLED_MARK, FAILED_LINE, local_job_status
from orchestrator.run_models import create_run
from orchestrator.run_view import duration, round_line
from slurm_support import requires_slurm
from orchestrator.runstate import read_heartbeat
from terminal_support import in_a_terminal

ROOT = Path(__file__).resolve().parent.parent


def _parsers(parser: argparse.ArgumentParser, name: str = "orchestrate"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _parsers(p, f"{name} {sub}")


def test_every_option_of_the_run_commands_says_what_it_does():
    for name, parser in _parsers(build_parser()):
        if name.split()[1:2] not in ([], ["submit"], ["resume"], ["status"], ["cancel"]):
            continue
        bare = [a.dest for a in parser._actions if not a.help and not isinstance(a, argparse._SubParsersAction)]
        assert bare == [], f"{name}: no help for {bare}"
    text = build_parser()._subparsers._group_actions[0].choices["submit"].format_help()
    assert "(default 4)" in text and "(default diloco)" in text and "(default auto)" in text


def test_every_help_fits_80_columns_without_breaking_a_word(monkeypatch):
    """`orchestrate ... --help` in an 80-column terminal: no line wider (argparse wraps only what it
    formats; descriptions and examples are ours), and no name cut at its hyphen (`task-` / `arithmetic`)."""
    monkeypatch.setenv("COLUMNS", "80")  # what argparse reads the width from
    for name, parser in _parsers(build_parser()):
        lines = parser.format_help().splitlines()
        assert [line for line in lines if len(line) > 80] == [], name
        cut = [(a, b) for a, b in zip(lines, lines[1:]) if re.search(r"\w-$", a) and re.match(r"\s+\w", b)]
        assert cut == [], name


def test_a_reader_that_goes_away_gets_no_traceback(tmp_path, corpus_cache):
    cfg = config_from_dict({"model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32},
                            "data": {"cache_dir": corpus_cache}, "run_dir": str(tmp_path / "run")})
    create_run(Storage(cfg.run_dir), cfg)
    # `orchestrate status RUN --json | head`, with the reader gone before a byte is written
    code = ("import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1); from orchestrator.cli import main; "
            f"sys.exit(main(['status', {cfg.run_dir!r}, '--json']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr


# -- one round numbering, the round line ------------------------------------------------------------

def test_round_lines_count_rounds_from_0_and_say_how_many_are_done():
    rec = {"round": 0, "eval_loss": 3.27981, "merged": [0, 1, 2, 3], "dropped": [], "rejected": [], "merge_seconds": 0.061}
    assert round_line(rec, 8, 4, 14.7, 103.0) == \
        "round 0 (1/8): eval loss 3.2798, merged 4/4, merge 0.06s, round 15s, ETA 1m43s"
    last = {**rec, "round": 7, "merged": [0, 2], "dropped": [1], "rejected": [3], "eval_loss": None}
    assert round_line(last, 8, 4, 3725, 0.0) == ("round 7 (8/8): eval loss not evaluated, merged 2/4, dropped [1], "
                                                 "rejected [3], merge 0.06s, round 1h02m")
    # a round committed before a resume, evaluated only now: this process did not see it run
    assert round_line(rec, 8, 4, None, None) == "round 0 (1/8): eval loss 3.2798, merged 4/4, merge 0.06s"
    # persistent workers: 9 s busy and 1 s idle, 6 s and 4 s: 15 of 20 s
    busy = {**rec, "worker_train_s": {"0": 9.0, "1": 6.0}, "worker_idle_s": {"0": 1.0, "1": 4.0}}
    assert round_line(busy, 8, 4, 20, 5) == "round 0 (1/8): eval loss 3.2798, merged 4/4, merge 0.06s, round 20s, " \
                                          "workers busy 75%, ETA 5s"
    assert [duration(s) for s in (0.4, 59.6, 61, 3599, 7200)] == ["0s", "1m00s", "1m01s", "59m59s", "2h00m"]


# -- a light CLI ---------------------------------------------------------------------------------------

NO_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "safetensors", "matplotlib"):
            raise ImportError(f"{name} imported by a command that must stay light")
sys.meta_path.insert(0, NoTorch())
from orchestrator.cli import build_parser, main
"""


def test_help_status_and_cancel_never_import_torch(tmp_path, corpus_cache):
    run = _tiny_run(tmp_path, corpus_cache)
    code = NO_TORCH + f"""
import contextlib, io
for sub in ("", "submit", "resume", "status", "cancel", "report", "eval", "merge", "bench"):
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
        main([*sub.split(), "--help"])
assert main(["status", {run!r}, "--json"]) == 0 and main(["status", {run!r}]) == 0
assert main(["cancel", {run!r}]) == 0
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "cancelled the run during round 0: jobs []" in done.stdout


def test_a_run_cancelled_before_its_detached_service_started_stays_cancelled(tmp_path, corpus_cache, capsys):
    """`submit --detach` on a busy cluster: the run is starting (made, its service job queued); cancel
    marks it, and the service job, once it starts, stops rather than run it."""
    from orchestrator.run_service import requeued_service
    run = _tiny_run(tmp_path, corpus_cache)
    assert main(["status", run, "--json"]) == 0 and json.loads(capsys.readouterr().out)["state"] == "starting"
    assert main(["cancel", run]) == 0 and "cancelled the run during round 0" in capsys.readouterr().out
    assert requeued_service(run) == 3 and "this service job stops" in capsys.readouterr().out
    assert not (Path(run) / "lock.json").exists() and not (Path(run) / "rounds").exists()  # nothing ran


def test_the_merge_methods_the_cli_offers_are_the_method_table():
    from merge import METHOD_NAMES
    from merge.methods import METHODS
    assert sorted(METHOD_NAMES) == sorted(METHODS)  # merge/__init__.py keeps --help free of torch


def _tiny_run(tmp_path: Path, corpus_cache: str) -> str:
    cfg = config_from_dict({"model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32},
                            "data": {"cache_dir": corpus_cache}, "run_dir": str(tmp_path / "run"),
                            "executor": {"kind": "local"}})
    create_run(Storage(cfg.run_dir), cfg)
    return cfg.run_dir


# -- local jobs: true states and times, from submitit's files --------------------------------------

def test_a_local_job_state_and_times_come_from_its_files(tmp_path):
    folder = tmp_path / "jobs"

    def job(job_id: str, result: bool = False, log: str = "", cancelled: bool = False, t: float = 1_800_000_000.0):
        d = folder / job_id
        d.mkdir(parents=True)
        for name, body, at in ((f"{job_id}_submitted.pkl", "x", t), (f"{job_id}_0_log.err", log, t + 7),
                               *([(f"{job_id}_0_result.pkl", "x", t + 5)] if result else []),
                               *([(CANCELLED_MARK, "", t + 9)] if cancelled else [])):
            (d / name).write_text(body)
            os.utime(d / name, (at, at))
        return job_id

    ok = local_job_status(folder, job("1", result=True, log="... Job completed successfully\n"), alive=False)
    assert ok.state == "COMPLETED" and ok.timing() == {"queue_wait_s": 0.0, "run_s": 5.0}
    raised = local_job_status(folder, job("2", result=True, log=f"Traceback ...\n{FAILED_LINE}\n"), alive=False)
    assert raised.state == "FAILED" and raised.timing()["run_s"] == 5.0
    killed = local_job_status(folder, job("3"), alive=False)  # no result: ended when its log last moved
    assert killed.state == "FAILED" and killed.timing()["run_s"] == 7.0
    assert local_job_status(folder, job("4", cancelled=True), alive=False).state == "CANCELLED"
    running = local_job_status(folder, job("5", t=time.time() - 30), alive=True)
    assert running.state == "RUNNING" and 29 <= running.timing()["run_s"] <= 60 and running.end is None


# -- the run as a person sees it, and a cancel that stops it ----------------------------------------

TINY = ["--executor", "local", "--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2",
        "--set", "model.block_size=32", "--set", "inner.batch_size=4", "--set", "inner.warmup_steps=2",
        "--set", "data.eval_batches=2", "--set", "round.poll_s=0.2"]


@pytest.mark.slow
def test_the_readme_run_on_a_terminal_shows_round_lines_and_a_live_footer(tmp_path, corpus_cache):
    """The README's first command in a pseudo-terminal (pyte reads the screen as a person would)."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "orchestrator.cli", "submit", "--workers", "2", "--rounds", "2", "--inner-steps", "60",
           "--run-dir", str(run), "--set", f"data.cache_dir={corpus_cache}", *TINY]
    raw, lines = in_a_terminal(cmd, cols=100, rows=30)
    text = raw.decode(errors="replace")
    assert "Traceback" not in text and " INFO " not in text and "WARNING" not in text, text[-3000:]
    assert "running for" in text and "worker 1: " in text  # the live footer was drawn (and is gone at the end)
    head = next(i for i, x in enumerate(lines) if x.startswith("diloco: "))  # the data line before it wraps
    assert lines[0] == f"run directory: {run}" and lines[1].startswith("data: the Python standard library's source")
    assert lines[head].startswith("diloco: 2 workers x 2 rounds x 60 inner"), lines
    lines = lines[head - 1:]
    number = r"\d+(\.\d+)?"
    busy = r", workers busy \d+%"  # persistent workers (the default)
    assert re.fullmatch(rf"round 0 \(1/2\): eval loss {number}, merged 2/2, merge {number}s, round \w+{busy}, ETA \w+",
                        lines[2]), lines
    assert re.fullmatch(rf"round 1 \(2/2\): eval loss {number}, merged 2/2, merge {number}s, round \w+{busy}", lines[3]), lines
    assert lines[4].startswith("done in ") and " ".join(lines[4:]).endswith(f"inspect it with: orchestrate status {run}"), lines
    log = (run / "orchestrator.log").read_text()  # what -v would have shown is all in the run's log
    assert "INFO orchestrator.submission: round 0: submitted workers [0, 1]" in log


@pytest.mark.slow
def test_on_an_80_column_terminal_lines_break_between_words_and_the_footer_says_evaluating(tmp_path, corpus_cache):
    """The run's lines wrapped between words (never inside a number), a path longer than a line left
    whole for the terminal to wrap (it copies as one), and so is a command to paste; while the service evaluates a committed round
    (3000 eval batches: seconds), the footer says so rather than `running`."""
    run = tmp_path / ("a-run-directory-whose-name-is-long-enough-to-need-a-line-of-its-own-" + "x" * 20)
    cmd = [sys.executable, "-m", "orchestrator.cli", "submit", "--workers", "2", "--rounds", "2", "--inner-steps", "30",
           "--run-dir", str(run), "--set", f"data.cache_dir={corpus_cache}", *TINY, "--set", "data.eval_batches=3000",
           "--executor", "inline"]  # the lines are the subject, not the workers' processes (the README run's test is local)
    raw, lines = in_a_terminal(cmd, cols=80, rows=40)
    text = raw.decode(errors="replace")
    pieces = [p for line in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).split("\r\n") for p in line.split("\r")]
    # a command to paste stays one line (its path is longer than one), written whole for the terminal to wrap
    assert all(len(p) <= 80 or " " not in p.strip() or p.startswith("orchestrate ") for p in pieces), \
        [p for p in pieces if len(p) > 80]
    assert f"inspect it with:\r\norchestrate status {run}\r\n" in text
    assert "merged: evaluating the new global model" in text
    cut = [(a, b) for a, b in zip(lines, lines[1:]) if " " in a and re.search(r"[\d.]$", a) and re.match(r"[\d.]", b)]
    assert not cut, cut  # no number cut between two lines
    assert re.search(r"initial eval loss (\(nats/byte\) )?\d\.\d{4}", " ".join(lines))
    assert f"final model:\r\n{run}/final/model.safetensors\r\n" in text  # written whole: the terminal wraps it


@pytest.mark.slow
def test_cancel_stops_a_run_started_under_setsid_nohup(tmp_path, corpus_cache):
    """`setsid nohup orchestrate submit ... &` ignores SIGINT: cancel still stops every process of the
    run within 30 s, with no traceback anywhere; while it ran, ended jobs did not linger as zombies
    (per-round jobs: each round's end; test_e2e_local cancels persistent workers)."""
    run, out = tmp_path / "run", tmp_path / "out.txt"
    args = ["submit", "--workers", "2", "--rounds", "50", "--inner-steps", "300", "--run-dir", str(run),
            "--set", f"data.cache_dir={corpus_cache}", "--set", "round.worker_mode=per_round", *TINY]
    subprocess.run(["bash", "-c", f"setsid nohup {sys.executable} -m orchestrator.cli {shlex.join(args)} > {out} 2>&1 &"],
                   cwd=ROOT, check=True)
    s = Storage(str(run))
    try:
        _wait(lambda: s.exists("rounds/00001/jobs.json") and s.exists("rounds/00000/record.json"), 180, out)
        ended = {int(j) for e in s.read_json("rounds/00000/jobs.json")["workers"].values() for j in e["job_ids"]}
        _wait(lambda: all(_state(pid) in ("Z", None) for pid in ended), 30, out)  # round 0's local jobs have exited
        time.sleep(2.0)  # the service polls every 0.2 s, and reaps what ended each time
        assert [_state(pid) for pid in ended] == [None] * len(ended), "ended jobs left <defunct>"
    finally:  # whatever failed above, the run is cancelled: a 50-round run must not outlive the test
        assert main(["cancel", str(run)]) == 0
    _wait(lambda: not _processes_of(run), 30, out)
    text = out.read_text()
    # round 1 or later: 300 tiny steps may finish a round before the cancel lands (an idle machine)
    assert re.search(r"run cancelled during round [1-9]\d* \(marker", text) and "Traceback" not in text, text[-3000:]
    logs = "".join(p.read_text(errors="replace") for p in (run / "jobs").rglob("*.err"))
    assert "Traceback" not in logs and "KeyboardInterrupt" not in logs, logs[-3000:]
    assert json.loads(subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", str(run), "--json"],
                                     capture_output=True, cwd=ROOT).stdout)["state"] == "cancelled"


def _wait(ok, timeout: float, out: Path) -> None:
    deadline = time.time() + timeout
    while not ok():
        assert time.time() < deadline, out.read_text()[-3000:] if out.exists() else "no output"
        time.sleep(0.2)


def _state(pid: int) -> str | None:
    """A process's state letter (Z: a zombie), None when it has gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _processes_of(run: Path) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if str(run) in text:
                found.append(text)
    return found


def _interrupted_run(tmp_path, corpus_cache, rounds: int, steps: int, worker: int) -> tuple[Path, Path]:
    """A local run sent SIGINT to its whole process group, as a terminal sends it, once `worker` is
    training; (its run directory, what it printed) once every process of it has gone."""
    run, out = tmp_path / "run", tmp_path / "out.txt"
    args = ["submit", "--workers", "2", "--rounds", str(rounds), "--inner-steps", str(steps), "--run-dir", str(run),
            "--set", f"data.cache_dir={corpus_cache}", *TINY]
    with open(out, "wb") as f:
        # as a terminal's foreground job: SIGINT at its default (a test run in the background of a
        # non-interactive shell, as CI's, inherits it ignored, and Python then never raises KeyboardInterrupt)
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        s = Storage(str(run))
        _wait(lambda: (read_heartbeat(s, worker) or {}).get("step", 0) > 0, 120, out)  # it is training
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130, out.read_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    _wait(lambda: not _processes_of(run), 30, out)
    return run, out


@pytest.mark.slow
def test_ctrl_c_stops_the_local_run_and_its_jobs_without_a_traceback(tmp_path, corpus_cache):
    """The workers (started with SIGINT ignored) print no KeyboardInterrupt; the service stops them
    itself and says how to go on."""
    run, out = _interrupted_run(tmp_path, corpus_cache, rounds=50, steps=300, worker=1)
    text = out.read_text()
    assert f"interrupted: this run's local jobs are stopped; to go on: orchestrate resume {run}\n" in text
    assert "Traceback" not in text, text[-3000:]
    logs = "".join(p.read_text(errors="replace") for p in (run / "jobs").rglob("*.err"))
    assert "KeyboardInterrupt" not in logs and "Traceback" not in logs, logs[-3000:]
    # what status says of it now: stopped, and how to go on (never "running": nothing drives it)
    status = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", str(run)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    said = " ".join(status.stdout.split())
    assert f"{run}: stopped," in said and "running" not in said, said
    assert f"no merge service drives the run (it was interrupted or killed): `orchestrate resume {run}` continues it" \
        in said, said


@pytest.mark.slow
def test_a_service_that_stops_on_an_error_stops_its_local_jobs(tmp_path, corpus_cache, monkeypatch):
    """Whatever stops the merge service (here an error raised once worker 0 trains), local workers do
    not go on training for a run nothing merges."""
    from orchestrator import loop
    run = tmp_path / "run"

    def failing(self, r):
        self.submitter.ensure(r)
        _wait(lambda: (read_heartbeat(self.storage, 0) or {}).get("step", 0) > 0, 120, run / "orchestrator.log")
        raise RuntimeError("the service stops here")
    monkeypatch.setattr(loop.Service, "run_round", failing)
    with pytest.raises(RuntimeError, match="the service stops here"):
        main(["submit", "--workers", "2", "--rounds", "3", "--inner-steps", "300", "--run-dir", str(run),
              "--set", f"data.cache_dir={corpus_cache}", *TINY])
    _wait(lambda: not _processes_of(run), 30, run / "orchestrator.log")
    assert "the merge service stopped: this run's local jobs are stopped" in (run / "orchestrator.log").read_text()


def test_a_planted_heartbeat_is_no_heartbeat(tmp_path, corpus_cache):
    run = _tiny_run(tmp_path, corpus_cache)
    s = Storage(run)
    for junk in (b'{"round": "0", "step": 3, "steps": 5}', b"[1, 2]", b"{not json", b"x" * 10_000):
        s.write_bytes("workers/worker_000/progress.json", junk)
        assert read_heartbeat(s, 0) is None, junk[:40]
    s.write_bytes("workers/worker_000/progress.json", b'{"round": 0, "step": 3, "steps": 5, "loss": "nan?"}')
    assert read_heartbeat(s, 0) == {"round": 0, "step": 3, "steps": 5, "loss": None}



def test_utilization_counts_persistent_workers_only():
    from core.records import utilization
    rounds = [{"worker_train_s": {"0": 9.0, "1": 6.0}, "worker_idle_s": {"0": 1.0, "1": 4.0}},
              {"worker_train_s": {"0": 10.0, "2": 5.0}, "worker_idle_s": {"0": 0.0}}]  # 2: a per-round job
    assert utilization(rounds[:1]) == 0.75 and utilization(rounds[1:]) == 1.0
    assert utilization(rounds) == round(25 / 30, 4)
    assert utilization([{"worker_train_s": {"0": 3.0}, "worker_idle_s": {}}]) is None
    assert utilization([{}]) is None  # a record written before these fields


def test_the_footer_after_the_last_round_says_the_run_is_finishing(tmp_path):
    from rich.console import Console

    from core.storage import Storage
    from orchestrator.run_view import RunView
    cfg = config_from_dict({"workers": 2, "rounds": 3})
    view = RunView(Console(file=io.StringIO()), Storage(str(tmp_path)), cfg, first_round=0)
    view.round_done({"round": 2, "eval_loss": 3.0, "merged": [0, 1], "dropped": [], "rejected": [], "merge_seconds": 0.1})
    console = Console(file=io.StringIO(), width=100)
    console.print(view.footer())
    assert console.file.getvalue().strip() == "all 3 rounds done: writing the final model"  # not "round 3 (4/3)"


@requires_slurm  # submitit's Slurm executor looks for srun when it is made
def test_only_a_job_id_names_a_cancelled_mark(tmp_path):
    """Job ids are read from the run directory: a Slurm id (an array task's too) gets islands' mark,
    anything path-like never touches the filesystem."""
    from orchestrator.executor import Executor
    ex = Executor(config_from_dict({"executor": {"kind": "slurm"}}), tmp_path / "jobs")
    (tmp_path / "jobs").mkdir()
    for job in ("4711", "4712_3"):
        ex._mark_cancelled(job)
        assert ex.cancelled_here(job)
    for job in ("../escape", "/etc", "12/x"):
        ex._mark_cancelled(job)
        assert not ex.cancelled_here(job)
    assert sorted(p.name for p in (tmp_path / "jobs").iterdir()) == ["4711", "4712_3"] and not (tmp_path / "escape").exists()


def test_a_misspelt_flag_is_answered_with_the_flag_it_resembles(capsys):
    for argv, said in ((["submit", "--algoritm", "lte"], "--algoritm lte (did you mean --algorithm?)"),
                       (["status", "run", "--jsn"], "--jsn (did you mean --json?)")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"unrecognized arguments: {said}" in err, err


def test_a_command_to_paste_is_never_broken_across_lines():
    import io
    from rich.console import Console
    from orchestrator.console import say_command
    for width, want in ((120, "inspect it with: orchestrate status /a/long/path/to/the/run\n"),
                        (40, "inspect it with:\norchestrate status /a/long/path/to/the/run\n")):
        out = io.StringIO()
        say_command("inspect it with:", "orchestrate status /a/long/path/to/the/run",
                    Console(file=out, width=width, force_terminal=True, color_system=None))
        assert out.getvalue() == want


def test_a_dense_contribution_is_said_against_the_weights_not_as_one_in_one():
    from core.progress import bytes_sent
    assert bytes_sent(2.1e6, 2_000_000).endswith(", 1.05x the weights in fp32 (2.0MB)")
    assert bytes_sent(25.7e3, 1_900_000).endswith(", 1/74 of the weights in fp32 (1.9MB)")
