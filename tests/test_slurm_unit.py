"""Slurm specifics that need no cluster: sbatch text (golden files), presets, sacct/squeue parsing."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from core.config import config_from_dict, load_config, replace, to_yaml
from core.config_parse import load_preset
from core.errors import ConfigError, IslandsError
from orchestrator.executor import sbatch_text
from orchestrator.slurm import SlurmPoller, parse_sacct, parse_squeue

GOLDEN = Path(__file__).parent / "golden"
CASES = {
    "sbatch_local": {"workers": 2, "executor": {"preset": "local"}},
    "sbatch_gpu1_account": {"workers": 8, "executor": {"preset": "gpu-1", "account": "proj42", "setup": ["module load cuda"]}},
    "sbatch_gpu_node_8": {"workers": 4, "executor": {"preset": "gpu-node-8", "partition": "a100", "constraint": "ib"}},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sbatch_text_matches_golden_file(name):
    """To accept an intended change: ISLANDS_REGEN_GOLDEN=1 pytest tests/test_slurm_unit.py"""
    cfg = config_from_dict(CASES[name])
    text = sbatch_text(cfg, "/shared/runs/r1/jobs/%j", cfg.workers)
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("ISLANDS_REGEN_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"no golden file {path}: run with ISLANDS_REGEN_GOLDEN=1 and review it"
    assert text == path.read_text()


def test_explicit_values_win_over_the_preset():
    e = config_from_dict({"executor": {"preset": "gpu-1", "cpus_per_task": 3}}).executor
    assert e.cpus_per_task == 3 and e.gpus_per_node == 1 and e.mem_gb == 64
    # a value written equal to the built-in default is still the user's (local.yaml has 1 CPU, 10 min)
    e = load_config(sets=["executor.preset=local", "executor.cpus_per_task=2", "executor.timeout_min=60"]).executor
    assert (e.cpus_per_task, e.timeout_min, e.mem_gb, e.partition) == (2, 60, 0.5, "debug")
    # the config a run stores reads back the same, and another preset given later replaces the first's
    cfg = config_from_dict(yaml.safe_load(to_yaml(config_from_dict({"executor": {"preset": "gpu-1"}}))))
    assert cfg.executor.gpus_per_node == 1 and cfg.executor.mem_gb == 64
    other = replace(cfg, executor__preset="local", executor__timeout_min=30).executor
    assert (other.gpus_per_node, other.mem_gb, other.partition, other.timeout_min) == (0, 0.5, "debug", 30)
    with pytest.raises(ConfigError) as err:  # listed with the config's other problems
        config_from_dict({"executor": {"preset": "nope"}, "inner": {"lr": -1}})
    assert "known presets" in str(err.value) and "inner.lr" in str(err.value)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ConfigError, match="known presets: .*gpu-1.*local"):
        load_preset("nope")


def test_every_shipped_preset_loads():
    names = sorted(p.stem for p in (Path(__file__).parent.parent / "slurm_templates").glob("*.yaml"))
    assert {"local", "gpu-1", "gpu-node-8", "cpu-node", "preemptible"} <= set(names)
    for n in names:
        load_preset(n)


def test_parse_sacct_and_squeue():
    rows = parse_sacct("12_0|COMPLETED|2026-11-22T03:00:00|2026-11-22T03:00:05|2026-11-22T03:01:00|n1\n"
                       "12_0.batch|COMPLETED|x|x|x|n1\n12_[1-2]|PENDING|2026-11-22T03:00:00|Unknown|Unknown|None\n")
    assert set(rows) == {"12_0", "12_[1-2]"} and rows["12_0"]["Start"] == "2026-11-22T03:00:05"
    assert parse_squeue("12_1|RUNNING|2026-11-22T03:00:00|2026-11-22T03:00:04\n12_2|PENDING|2026-11-22T03:00:00|N/A\n"
                        "garbage\n") == {"12_1": ("RUNNING", "2026-11-22T03:00:00", "2026-11-22T03:00:04"),
                                         "12_2": ("PENDING", "2026-11-22T03:00:00", "N/A")}
    import pwd
    who = parse_sacct("13|CANCELLED by 0|x|x|x|n1\n14|CANCELLED by 999999|x|x|x|n1\n")
    assert who["13"]["State"] == f"CANCELLED by {pwd.getpwuid(0).pw_name}" and who["14"]["State"] == "CANCELLED by uid 999999"


def test_poller_gone_after_grace():
    # An array task cancelled while pending appears in neither sacct nor squeue (seen on 22.05).
    p = SlurmPoller(grace_s=10)
    assert p._status("5_1", None, None, now=100.0).state == "PENDING"
    assert p._status("5_1", None, None, now=105.0).alive
    gone = p._status("5_1", None, None, now=111.0)
    assert not gone.alive and gone.state.startswith("GONE")
    row = {"State": "CANCELLED by 0", "Submit": "s", "Start": "Unknown", "End": "e"}
    done = p._status("5_0", row, None, now=0)
    assert not done.alive and done.start is None
    # sacct lags squeue: a job squeue runs is alive even if sacct still says PENDING
    queued = ("RUNNING", "2026-11-22T03:00:00", "2026-11-22T03:00:04")
    assert p._status("5_2", {**row, "State": "PENDING"}, queued, now=0).state == "RUNNING"
    # no sacct row yet (the accounting database lags): squeue's times give the queue wait
    running = p._status("5_3", None, queued, now=0)
    assert running.state == "RUNNING" and running.timing()["queue_wait_s"] == 4.0
    # a pending job's squeue start is a forecast, not a start
    pending = p._status("5_4", None, ("PENDING", "2026-11-22T03:00:00", "2026-11-22T04:00:00"), now=0)
    assert pending.submit == "2026-11-22T03:00:00" and pending.start is None and pending.timing()["run_s"] is None


def test_the_poller_backs_off_while_nothing_happens_and_asks_at_once_on_news(monkeypatch):
    """One sacct per interval at most; the interval doubles from round.poll_s to 30 s while nothing
    new happens, and news from storage (or a new job) asks at once and starts again from poll_s."""
    from orchestrator import slurm
    from orchestrator.jobstatus import JobStatus
    poller, now, asked = slurm.SlurmPoller(), [1000.0], []
    monkeypatch.setattr(slurm.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(poller, "poll", lambda ids: asked.append(now[0]) or {j: JobStatus(j, "RUNNING") for j in ids})
    for _ in range(400):  # 200 s of polls every 0.5 s, nothing new
        assert poller.watch(["7_0"], news=False, min_interval_s=0.5)["7_0"].state == "RUNNING"
        now[0] += 0.5
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    assert gaps[:6] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0] and set(gaps[6:]) == {30.0}
    poller.watch(["7_0"], news=True, min_interval_s=0.5)  # a contribution arrived: ask now
    assert asked[-1] == now[0]
    poller.watch(["7_0", "7_1"], news=False, min_interval_s=0.5)  # a new job: ask now too
    assert len(asked) == len(gaps) + 3


def _slurm_shims(tmp_path: Path, controller_up: bool) -> str:
    """A PATH whose sbatch and scontrol stand in for an installed Slurm whose controller is up or
    down (the real controller is up while these tests run; downing it would break the others)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state, rc = ("UP", 0) if controller_up else ("DOWN", 1)
    (bin_dir / "sbatch").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho 'Slurmctld(primary) at vm is {state}'\nexit {rc}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return str(bin_dir)


def test_slurm_down_is_one_line_and_leaves_no_run_directory(tmp_path, monkeypatch, capsys):
    from orchestrator.cli import main
    monkeypatch.setenv("PATH", _slurm_shims(tmp_path, controller_up=False) + os.pathsep + "/bin")
    run = tmp_path / "run"
    assert main(["submit", "--executor", "slurm", "--run-dir", str(run)]) == 2
    out = capsys.readouterr().out
    assert "the Slurm controller does not answer" in out and "is DOWN" in out and "--executor local" in out
    assert "Traceback" not in out and not run.exists()


def _kind(kind: str):
    return config_from_dict({"executor": {"kind": kind}})


def test_auto_takes_slurm_only_when_its_controller_answers(tmp_path, monkeypatch, capsys):
    from orchestrator.cli import _with_executor
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch at all: this machine, nothing to say
    assert _with_executor(_kind("auto")).executor.kind == "local" and capsys.readouterr().out == ""
    monkeypatch.setenv("PATH", _slurm_shims(tmp_path, controller_up=False))
    assert _with_executor(_kind("auto")).executor.kind == "local"
    assert "not using Slurm: the Slurm controller does not answer" in capsys.readouterr().out
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    (tmp_path / "bin" / "scontrol").write_text("#!/bin/sh\necho 'Slurmctld(primary) at vm is UP'\n")
    assert _with_executor(_kind("auto")).executor.kind == "slurm"
    assert _with_executor(_kind("local")).executor.kind == "local"


def _refusing(tmp_path, monkeypatch, sinfo: str | None) -> None:
    """An answering controller whose sbatch refuses any job asking for more than 3000 MB (sbatch
    --test-only's words; a shim records what was asked), and whose sinfo prints `sinfo`."""
    bin_dir = Path(_slurm_shims(tmp_path, controller_up=True))
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/asked\n"
                                    "case \"$*\" in *--mem=3000MB*) exit 0;; esac\n"
                                    "echo 'sbatch: error: Memory specification can not be satisfied' >&2\n"
                                    "echo 'allocation failure: Requested node configuration is not available' >&2\n"
                                    "exit 1\n")
    if sinfo is not None:
        (bin_dir / "sinfo").write_text(f"#!/bin/sh\nprintf '{sinfo}'\n")
        (bin_dir / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + "/bin")


def test_auto_never_runs_here_while_slurm_answers_and_refuses(tmp_path, monkeypatch, capsys):
    """A controller that answers but refuses the worker jobs' request, and no partition to size it
    to: `auto` (the README's command on a login node) is one error before anything is made, naming
    Slurm's words, the request and the settings; it never starts workers on this machine."""
    from orchestrator.cli import main
    _refusing(tmp_path, monkeypatch, sinfo=None)
    for kind in ("auto", "slurm"):
        run = tmp_path / f"run-{kind}"
        assert main(["submit", "--executor", kind, "--run-dir", str(run)]) == 2
        out = " ".join(capsys.readouterr().out.split())
        assert (f"error: --executor {kind}: Slurm refuses the worker jobs: Memory specification can not be satisfied; "
                "allocation failure: Requested node configuration is not available (the worker jobs ask for 1 node, "
                "1 task(s) x 2 CPU(s), 4096MB of memory, 60 min)") in out and "executor.mem_gb" in out, out
        assert "Traceback" not in out and not run.exists() and "running on this machine" not in out
        assert ("workers never run on this machine (a login node); --executor local runs them here" in out) == (kind == "auto")
    assert (tmp_path / "asked").read_text().splitlines()[0].split() == [
        "--test-only", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=2", "--mem=4096MB", "--time=60", "--wrap=true"]


def test_auto_sizes_a_default_request_to_the_partitions_nodes(tmp_path, monkeypatch, capsys):
    """Slurm refuses the default 4096 MB; the default partition's largest node has 3000 MB (sinfo):
    `auto` asks for that instead, says so, and the run is Slurm's. A value the user wrote is theirs:
    refused as it is."""
    from orchestrator.cli import _with_executor
    _refusing(tmp_path, monkeypatch, sinfo="debug*|4|2000|infinite\\ndebug*|4|3000|infinite\\nbig|64|512000|2-00:00:00\\n")
    cfg = _with_executor(_kind("auto"))
    assert cfg.executor.kind == "slurm" and cfg.executor.mem_gb * 1024 == 3000 and cfg.executor.cpus_per_task == 2
    out = " ".join(capsys.readouterr().out.split())
    assert ("asking for 1 node, 1 task(s) x 2 CPU(s), 3000MB of memory, 60 min instead, what partition debug's "
            "largest node: 4 CPUs, 3000 MB (set executor.* to choose)") in out, out
    with pytest.raises(IslandsError, match="Slurm refuses the worker jobs"):
        _with_executor(config_from_dict({"executor": {"kind": "auto", "mem_gb": 8}}))


@pytest.mark.parametrize("limit, minutes", [("infinite", None), ("30", 30), ("30:00", 30), ("1:00:00", 60),
                                            ("2-00:00:00", 2880), ("2-12", 3600), ("2-12:30", 3630), ("0:45:59", 45)])
def test_slurm_time_limits_in_minutes(limit, minutes):
    from orchestrator.slurm import minutes as parse
    assert parse(limit) == minutes


def test_a_request_is_sized_only_where_the_user_left_the_default():
    from orchestrator.slurm import sized_request
    assert sized_request(_kind("auto"), 1, 1024, 30) == {"executor.mem_gb": 1.0, "executor.cpus_per_task": 1,
                                                         "executor.timeout_min": 30}
    assert sized_request(_kind("auto"), 64, 512000, None) == {}  # it fits already
    two = config_from_dict({"executor": {"cpus_per_task": 4, "mem_gb": 4.0, "tasks_per_node": 2}})
    assert sized_request(two, 2, 8000, None) == {}  # 4 CPUs written by the user stay (and are refused)
    assert sized_request(_kind("auto"), 1, 8000, None) == {"executor.cpus_per_task": 1}


def test_an_older_run_recorded_as_auto_follows_the_same_rule(tmp_path, monkeypatch):
    from orchestrator.executor import resolve_kind
    monkeypatch.setenv("PATH", _slurm_shims(tmp_path, controller_up=False))
    assert resolve_kind("auto") == "local" and resolve_kind("slurm") == "slurm"  # sbatch alone is not enough


def test_a_submission_sbatch_refuses_after_the_test_only_check_is_one_clear_error(tmp_path, monkeypatch):
    """`sbatch --test-only` said yes but the real submission is refused (the cluster changed in
    between): the same one error, sbatch's words without its prefix, what was asked and what to change."""
    from core.errors import RunError
    from orchestrator.executor import Executor
    bin_dir = Path(_slurm_shims(tmp_path, controller_up=True))
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Invalid account' >&2\n"
                                    "exit 1\n")
    monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + "/bin" + os.pathsep + "/usr/bin")
    executor = Executor(_kind("slurm"), tmp_path / "jobs")
    with pytest.raises(RunError) as err:
        executor.submit_service("file:///tmp/run", len)  # any entry point: sbatch refuses before it runs
    said = str(err.value)
    assert said.startswith("sbatch refused the merge service job(s): ") and "Invalid account" in said
    assert "sbatch: error" not in said and "2048MB of memory" in said and "executor.mem_gb" in said


def test_scheduler_output_that_is_not_utf8_or_holds_escapes_is_read_as_plain_text(tmp_path, monkeypatch, capsys):
    """scontrol, sbatch --test-only and sinfo printing invalid UTF-8 and terminal escape sequences:
    `auto` decides as before, and what it prints holds no control character (orchestrator/commands.py)."""
    from orchestrator.cli import main
    bin_dir = Path(_slurm_shims(tmp_path, controller_up=True))
    esc = r"\033]0;owned\007\033[2J\377\376"
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\nprintf 'Slurmctld(primary) at vm{esc} is UP\\n'\n")
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\nprintf 'sbatch: error: no{esc} node\\n' >&2\nexit 1\n")
    (bin_dir / "sinfo").write_text(f"#!/bin/sh\nprintf 'debug{esc}*|4|zz\\377|infinite\\n'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + "/bin")
    capsys.readouterr()
    assert main(["submit", "--executor", "auto", "--run-dir", str(tmp_path / "run")]) == 2
    out = capsys.readouterr().out
    assert "Slurm refuses the worker jobs: no]0;owned[2J\ufffd\ufffd node" in " ".join(out.split()), out
    assert "Traceback" not in out and not any(c in out for c in "\033\007\x9b")


def test_a_dry_run_says_the_config_the_jobs_the_sbatch_script_and_the_bytes_golden():
    """orchestrator.dry_run.plan for the headline run on Slurm, top-k: against a golden file. To accept
    an intended change: ISLANDS_REGEN_GOLDEN=1 pytest tests/test_slurm_unit.py"""
    from orchestrator.dry_run import plan
    cfg = config_from_dict({"workers": 8, "rounds": 128, "run_dir": "/shared/runs/r1", "executor": {"kind": "slurm",
                            "preset": "gpu-1"}, "round": {"contribution": "delta", "codec": "topk"}})
    text = "\n".join(plan(cfg, "/shared/runs/r1/jobs")) + "\n"
    path = GOLDEN / "dry_run_slurm_topk.txt"
    if os.environ.get("ISLANDS_REGEN_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()
    assert sbatch_text(cfg, "/shared/runs/r1/jobs", 8).splitlines()[0] in text


def test_a_dry_run_submits_nothing_and_writes_nothing(tmp_path, capsys):
    from orchestrator.cli import main
    run, cache = tmp_path / "run", tmp_path / "cache"
    assert main(["submit", "--executor", "local", "--run-dir", str(run), "--set", f"data.cache_dir={cache}",
                 "--workers", "3", "--rounds", "5", "--dry-run"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "dry run: nothing is submitted or written" in out and "workers: 3" in out and "rounds: 5" in out
    assert ("run directory at the end: about 28.7MB (15.0 W: the kept globals and outer states, the last round's "
            "contributions, each worker's newest state snapshot, the final model)") in out, out
    assert not run.exists() and not cache.exists()
