"""Every `submit` example the README and `orchestrate submit --help` show, run as written.

Each command is handed to bash as a user types it. `/shared/` is the only path replaced (by a
temporary folder) and `~` is a temporary home; what a command names is made first the way the docs
make it: a corpus by the documented `data prepare` command that writes it, `mytasks` from
docs/tasks.md's code, `/shared/models/my-llama` a tiny Llama with its tokenizer. Where Slurm is up
(CI), the examples without `--executor` run as Slurm jobs, as they would for a user on a login node
(`auto`), and the GPU examples on the local cluster's partition `gpu`: its GPUs are declared to Slurm
but absent (the one thing mocked, as it cannot run here), so the worker sees no CUDA device and
trains on the CPU. A run stops after its first merged round, by `orchestrate cancel RUN` as a user
would (128 rounds as written take an hour); a one-round run goes to its end.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from slurm_support import requires_slurm, slurm_available
from test_documented_examples import EXAMPLES, RUNNABLE, _corpus, local, parsed

ROOT = Path(__file__).resolve().parent.parent
SUBMITS = [c for c in EXAMPLES if c.startswith("orchestrate submit ")]
FIRST_ROUND = re.compile(r"round 0 \(1/(\d+)\): eval loss \d")


def _make_inputs(command: str, tmp: Path, env: dict[str, str]) -> None:
    """What the example names, made as the docs make it."""
    sets = dict(item.split("=", 1) for item in parsed(command).sets)
    if sets.get("model", "").startswith("hf:"):  # first: the corpus' maker reads its tokenizer
        pytest.importorskip("test_hf")._tiny_hf(Path(local(sets["model"], tmp)[3:]), positions=2048)  # a Llama's
    if "data.source" in sets:
        maker = [c for c in RUNNABLE if c.startswith("orchestrate data prepare ") and parsed(c).out == sets["data.source"]]
        assert maker, f"no documented `data prepare` writes {sets['data.source']}, which {command!r} reads"
        _corpus(tmp)
        done = subprocess.run(["bash", "-c", local(maker[0], tmp)], cwd=tmp, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    if "task_path" in sets:  # the module of docs/tasks.md, where the example looks for it
        module, name = sets["task"].split(":")
        code = next(b for b in re.findall(r"```python\n(.*?)```", (ROOT / "docs/tasks.md").read_text(), flags=re.S)
                    if f"class {name}" in b)
        folder = Path(sets["task_path"].replace("~", env["HOME"], 1))
        folder.mkdir(parents=True)
        (folder / f"{module}.py").write_text(code)


def _run_to_first_round(line: str, tmp: Path, env: dict[str, str], timeout: float = 400) -> tuple[int, str]:
    """Run `line`; once it prints its first round of several, cancel the run as a user would; a run of
    one round goes to its end. (exit code, output)"""
    proc = subprocess.Popen(["bash", "-c", line], cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    out: list[str] = []
    first = threading.Event()

    def read() -> None:
        for text in proc.stdout:
            out.append(text)
            if (m := FIRST_ROUND.match(text)) and m.group(1) != "1":
                first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and not first.is_set() and time.monotonic() < deadline:
        time.sleep(0.5)
    if proc.poll() is None:
        run = next((t.split(": ", 1)[1].strip() for t in out if t.startswith("run directory: ")), None)
        if run:
            subprocess.run(["orchestrate", "cancel", run], env=env, capture_output=True, timeout=120)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    reader.join(timeout=10)
    return proc.wait(), "".join(out)


@pytest.mark.slow
@pytest.mark.parametrize("command", [pytest.param(c, marks=[pytest.mark.slurm, requires_slurm]) if "--executor slurm" in c
                                     else c for c in SUBMITS])
def test_every_submit_example_runs_as_written(command, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "USER": "alice",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    _make_inputs(command, tmp_path, env)
    code, out = _run_to_first_round(local(command, tmp_path), tmp_path, env)
    assert "Traceback" not in out and FIRST_ROUND.search(out), out
    header = next((t for t in out.splitlines() if re.match(r"\w+: \d+ workers x", t)), "")
    if "--executor slurm" in command or "--executor" not in command and slurm_available()[0]:
        assert "slurm executor" in header, out  # `auto` where Slurm answers: never this machine
    rounds = int(FIRST_ROUND.search(out).group(1))
    if rounds == 1:
        assert code == 0 and "done in" in out, out
    else:
        assert code == 3 and "run cancelled during round" in out, out  # cancelled by this test, after round 0
