"""Your own model and task (worker/tasks/): the interface, the shipped vision task on real images
(scikit-learn's bundled digits), a user's task written into a temporary directory outside the
repository, and every bad task refused by `orchestrate submit` before anything is made.
Real models, real images, real processes (the local executor); the Slurm runs are in test_slurm_e2e.py."""
from __future__ import annotations

import json
import math
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.config import load_config
from core.storage import Storage
from orchestrator.cli import main
from worker.tasks import Ensemble, ExampleSampler, TaskError, task_for

SMALL = ["--set", "inner.batch_size=8", "--set", "inner.warmup_steps=2", "--set", "data.eval_batches=2",
         "--set", "round.poll_s=0.2", "--set", "inner.lr=3e-3"]

# A user's task: a two-layer MLP classifying which half of the plane a point lies in. Written into
# tmp_path (not inside the repository) and named as `blobs:Blobs` with task_path.
USER_TASK = '''
import torch
from torch.nn import functional as F


class Blobs:
    def __init__(self, cfg):
        g = torch.Generator().manual_seed(cfg.seed)
        x = torch.randn(512, 2, generator=g)
        self.data = list(zip(x, (x[:, 0] + x[:, 1] > 0).long().tolist()))

    def model(self):
        return torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))

    def examples(self, split):
        return self.data[:400] if split == "train" else self.data[400:]

    def collate(self, examples):
        return torch.stack([x for x, _ in examples]), torch.tensor([y for _, y in examples])

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def metrics(self, model, batch):
        x, y = batch
        return {"accuracy": (model(x).argmax(-1) == y).float().mean().item()}
'''


def _write_task(folder, source: str, name: str = "blobs") -> str:
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    return str(folder)


def _status(run, capsys) -> dict:
    capsys.readouterr()
    assert main(["status", str(run), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# -- the sampler and the ensemble: pure --------------------------------------------------------
@given(n=st.integers(1, 300), k=st.integers(1, 12), seed=st.integers(0, 2**31))
@settings(max_examples=150, deadline=None)
def test_workers_shares_of_examples_are_disjoint_covering_and_balanced(n, k, seed):
    if n < k:
        with pytest.raises(TaskError, match="cannot be shared"):
            ExampleSampler(range(n), list, seed, 0, k, 1)
        return
    shares = []
    for w in range(k):
        s = ExampleSampler(range(n), list, seed, w, k, 1)
        shares.append({(s.deal.a * (w + p * k) + s.deal.b) % n for p in range(s.deal.count)})
    assert sorted(i for share in shares for i in share) == list(range(n))  # each example once
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_a_workers_batches_are_a_pure_function_of_seed_worker_and_step():
    a, b = ExampleSampler(range(100), list, 7, 2, 4, 16), ExampleSampler(range(100), list, 7, 2, 4, 16)
    assert a.indices(5) == b.indices(5) and a.indices(5) != a.indices(6)
    share = {(a.deal.a * (2 + p * 4) + a.deal.b) % 100 for p in range(a.deal.count)}
    assert set(a.indices(5)) <= share


def test_the_ensemble_is_the_log_of_the_mean_probability():
    """Two 'models' with fixed logits: by hand, p = softmax of each, ensemble = log((p1 + p2) / 2)."""
    l1, l2 = torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([[math.log(3.0), 0.0]])  # p = (1/4, 3/4), (3/4, 1/4)

    class Fixed(torch.nn.Module):
        def __init__(self, logits):
            super().__init__()
            self.logits = torch.nn.Parameter(logits)

        def forward(self, x):
            return self.logits

    out = Ensemble([Fixed(l1), Fixed(l2)])(None)
    assert torch.allclose(out.exp(), torch.tensor([[0.5, 0.5]]))
    assert torch.allclose(Ensemble([Fixed(l1)])(None).exp(), torch.tensor([[0.25, 0.75]]))  # one model: itself


# -- the shipped vision task ---------------------------------------------------------------------
def test_digits_are_real_images_held_out_by_index():
    runner = task_for(load_config(None, {}, ["task=digits"]))
    train, held = runner.task.examples("train"), runner.task.examples("eval")
    assert len(train) + len(held) == 1797 and len(held) == 360  # scikit-learn's digits, every fifth held out
    x, y = runner.task.collate(train[:4])
    assert x.shape == (4, 1, 16, 16) and y.dtype == torch.int64 and set(y.tolist()) <= set(range(10))
    assert -1.0 <= float(x.min()) and float(x.max()) <= 1.0


def test_lte_puts_heads_on_the_vision_models_attention_and_mlp():
    from worker import lora
    cfg = load_config(None, {}, ["task=digits", "lte.rank=4"])
    model = task_for(cfg).build_model()
    names = lora.attach_heads(model, cfg.lte, seed=0)
    assert any(n.endswith("attention.q_proj") for n in names) and any(n.endswith("mlp.fc1") for n in names)
    assert all(type(m) is not torch.nn.Linear or min(m.in_features, m.out_features) <= 4 for m in model.modules())


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, extra", [
    ("lofi", ["--rounds", "1", "--inner-steps", "12"]),
    ("diloco", ["--rounds", "2", "--inner-steps", "6"]),
    ("lte", ["--rounds", "2", "--inner-steps", "6", "--set", "lte.rank=4"]),
])
def test_the_vision_task_trains_with_each_algorithm(tmp_path, capsys, algorithm, extra):
    run = tmp_path / "run"
    assert main(["submit", "--set", "task=digits", "--algorithm", algorithm, "--workers", "2", "--executor", "inline",
                 "--run-dir", str(run), *SMALL, *extra]) == 0
    out = capsys.readouterr().out
    assert "accuracy" in out  # the progress line shows the task's metric beside the loss
    st = _status(run, capsys)
    assert st["state"] == "done" and all(r["merged"] == [0, 1] for r in st["rounds"])
    assert all(0 <= r["eval_metrics"]["accuracy"] <= 1 and r["eval_loss"] > 0 for r in st["rounds"])
    assert main(["status", str(run)]) == 0 and "accuracy" in capsys.readouterr().out
    # the final model: a safetensors state dict, and a Hugging Face directory (the ViT is one)
    assert (run / "final" / "model.safetensors").exists() and (run / "final" / "hf" / "config.json").exists()
    from transformers import ViTForImageClassification
    assert ViTForImageClassification.from_pretrained(str(run / "final" / "hf")).config.num_labels == 10
    # the report and TensorBoard's scalars carry the accuracy too
    assert main(["report", str(run), "--out", str(tmp_path / "rep")]) == 0
    assert "eval accuracy" in (tmp_path / "rep" / "report.html").read_text()
    from orchestrator.observe.metrics import read_metrics, tensorboard_scalars
    from orchestrator.runstate import load_run
    lines = read_metrics(Storage(str(run)), load_run(Storage(str(run))))
    assert any(tag == "eval_accuracy" for ln in lines for tag, _, _ in tensorboard_scalars(ln))
    if algorithm == "lofi":  # lo-fi's table: the average, each worker, their ensemble, all in accuracy
        contribs = [str(run / "rounds/00000/contrib" / f"worker_{w:03d}.safetensors") for w in (0, 1)]
        capsys.readouterr()
        assert main(["eval", str(run), *contribs, "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["data"]["task"] == "digits" and len(got["models"]) == 3
        assert all(0 <= m["accuracy"] <= 1 for m in [*got["models"], got["ensemble"]])
        assert got["models"][0]["accuracy"] == st["rounds"][0]["eval_metrics"]["accuracy"]  # the same eval set
        # `orchestrate merge` of a task's checkpoints: the soup carries its task, and scores as lo-fi's average
        soup = str(tmp_path / "soup.safetensors")
        assert main(["merge", *contribs, "--out", soup]) == 0
        capsys.readouterr()
        assert main(["eval", soup, "--run", str(run), "--json"]) == 0
        soup_acc = json.loads(capsys.readouterr().out)["models"][0]["accuracy"]
        assert soup_acc == pytest.approx(st["rounds"][0]["eval_metrics"]["accuracy"], abs=1 / 64)


# -- a user's own task, from outside the package --------------------------------------------------
@pytest.mark.slow
def test_a_users_task_from_a_temporary_directory_trains_on_the_local_executor(tmp_path, capsys, monkeypatch):
    _write_task(tmp_path / "mytasks", USER_TASK)
    monkeypatch.chdir(tmp_path)  # task_path given relative to where submit runs
    run = tmp_path / "run"
    assert main(["submit", "--set", "task=blobs:Blobs", "--set", "task_path=mytasks", "--workers", "2",
                 "--rounds", "3", "--inner-steps", "10", "--executor", "inline", "--run-dir", str(run), *SMALL]) == 0
    st = _status(run, capsys)
    assert st["state"] == "done" and st["rounds"][-1]["eval_metrics"]["accuracy"] > 0.8  # an easy problem, learnt
    assert f"task_path: {tmp_path / 'mytasks'}" in (run / "config.yaml").read_text()  # absolute: jobs start anywhere
    m = Storage(str(run)).read_json("rounds/00000/contrib/worker_000.json")
    assert m["tokens"] == 10 * 8  # steps x examples: the weight of a contribution counts examples
    alone = tmp_path / "model.safetensors"  # copied out of its run: nothing says which task built it
    alone.write_bytes((run / "final" / "model.safetensors").read_bytes())
    capsys.readouterr()
    assert main(["eval", str(alone)]) == 2
    assert "is a model of task 'blobs:Blobs'" in capsys.readouterr().out
    assert main(["eval", str(alone), "--run", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["models"][0]["accuracy"] > 0.8


# -- bad tasks: one clear error from `submit`, before anything is made ----------------------------
BAD = {
    "unimportable": ("import no_such_module_here\n", "Blobs", "cannot import blobs"),
    "no_method": (USER_TASK.replace("def collate", "def collate_"), "Blobs", "has no collate method"),
    "no_class": (USER_TASK, "Nope", "blobs has no 'Nope'"),
    "non_scalar": (USER_TASK.replace("F.cross_entropy(model(x), y)", "F.cross_entropy(model(x), y, reduction='none')"),
                   "Blobs", "loss() returned (2,), not a scalar tensor"),
    "nan": (USER_TASK.replace("F.cross_entropy(model(x), y)", "F.cross_entropy(model(x), y) * float('nan')"),
            "Blobs", "loss() is nan on the first batch"),
    "no_grad": (USER_TASK.replace("F.cross_entropy(model(x), y)", "F.cross_entropy(model(x).detach(), y)"),
                "Blobs", "loss() has no gradient"),
    "names_change": (USER_TASK.replace("def model(self):", "n = 0\n\n    def model(self):\n        Blobs.n += 1")
                     .replace("torch.nn.Linear(32, 2))", "torch.nn.Linear(32, 2), "
                              "*([torch.nn.Linear(2, 2)] if Blobs.n > 1 else []))"),
                     "Blobs", "built different parameters on a second call"),
    "raises": (USER_TASK.replace("self.data = list", "raise RuntimeError('no data here')\n        self.data = list"),
               "Blobs", "Blobs(cfg) failed: RuntimeError: no data here"),
    "bad_metrics": (USER_TASK.replace('return {"accuracy"', 'return [1]\n        return {"accuracy"'), "Blobs",
                    "metrics() must return {name: number}"),
    "nan_metric": (USER_TASK.replace('.float().mean().item()}', '.float().mean().item() * float("nan")}'), "Blobs",
                   "metrics ['accuracy'] are not finite on the eval"),
    "not_a_module": (USER_TASK.replace("return torch.nn.Sequential(", "return dict(a=1) or torch.nn.Sequential("),
                     "Blobs", "model() returned dict, not a torch.nn.Module"),
    "empty_eval": (USER_TASK.replace("else self.data[400:]", "else []"), "Blobs", "examples('eval') is empty"),
    "instance": (USER_TASK + "\n\nINSTANCE = Blobs.__new__(Blobs)\n", "INSTANCE", "(cfg) failed: TypeError"),
    "exits_at_import": ("import sys\nsys.exit(0)\n" + USER_TASK, "Blobs", "it called exit(0)"),
    "argparse_at_import": ("import argparse\np = argparse.ArgumentParser(prog='blobs')\np.add_argument('--data', "
                           "required=True)\np.parse_args()\n" + USER_TASK, "Blobs",
                           "it called exit(2), saying 'usage: blobs [-h] --data DATA\\nblobs: error: the following "
                           "arguments are required: --data'; a module that reads the command line when imported "
                           "belongs under `if __name__ == \"__main__\":`"),
    "escape_in_metric_name": (USER_TASK.replace('{"accuracy"', '{"\\x1b[2Jaccuracy"'), "Blobs",
                              "metric name '\\x1b[2Jaccuracy' is not a short name"),
}


def test_a_task_that_parses_the_command_line_when_imported_sees_none_of_islands(tmp_path, monkeypatch):
    from worker.tasks import _import
    where = _write_task(tmp_path / "argtasks", "import argparse\nARGS = argparse.ArgumentParser().parse_args()\n"
                        + USER_TASK, name="argtasks")
    monkeypatch.setattr(sys, "argv", ["orchestrate", "submit", "--workers", "8"])
    assert _import("argtasks:Blobs", where).__name__ == "Blobs" and sys.argv[1:] == ["submit", "--workers", "8"]


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_task_is_one_clear_error_before_anything_is_made(tmp_path, capsys, case):
    source, cls, says = BAD[case]
    where = _write_task(tmp_path / "mytasks", source)
    run = tmp_path / "run"
    code = main(["submit", "--set", f"task=blobs:{cls}", "--set", f"task_path={where}", "--workers", "2",
                 "--executor", "inline", "--run-dir", str(run), *SMALL])
    out = capsys.readouterr().out
    assert code == 2 and says in out and "task blobs:" in out and "Traceback" not in out, out
    assert not run.exists()


def test_the_built_in_tasks_are_the_ones_the_config_accepts():
    from core.config_parse import BUILTIN_TASKS
    from worker.tasks import BUILTIN
    assert set(BUILTIN) == set(BUILTIN_TASKS)


def test_a_batch_of_nested_containers_has_each_tensor_mapped():
    from worker.tasks import map_tensors
    batch = {"x": torch.ones(4, 2), "parts": [torch.zeros(4), (torch.arange(4), "label")], "n": 3}
    got = map_tensors(batch, lambda t: t[:2])
    assert got["x"].shape == (2, 2) and got["parts"][0].shape == (2,) and got["parts"][1][0].tolist() == [0, 1]
    assert got["parts"][1][1] == "label" and got["n"] == 3 and isinstance(got["parts"][1], tuple)


def test_task_keys_are_checked_with_the_rest_of_the_config(capsys):
    assert main(["submit", "--set", "task=not a task", "--set", "task=digits", "--set", "model.hf=/x"]) == 2
    out = capsys.readouterr().out
    assert "model.hf and data.source belong to task lm" in out
    assert main(["submit", "--set", "task=digits", "--set", "task_path=/tmp"]) == 2
    assert "task digits is built in: drop task_path" in capsys.readouterr().out


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_task_path_others_can_write_is_refused(tmp_path, capsys, mode):
    """Whoever can write task_path runs code as you in every worker: refused before anything is made."""
    where = _write_task(tmp_path / "mytasks", USER_TASK)
    (tmp_path / "mytasks").chmod(mode)
    run = tmp_path / "run"
    code = main(["submit", "--set", "task=blobs:Blobs", "--set", f"task_path={where}", "--workers", "2",
                 "--executor", "inline", "--run-dir", str(run), *SMALL])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 2 and f"task_path {where} is writable by" in out and f"chmod go-w {where}" in out, out
    assert not run.exists()


def test_a_worker_reads_config_yaml_only_through_the_checked_loader(tmp_path):
    """A run's config.yaml rewritten where other users can write it (a co-tenant naming their own
    task_path) is refused by the worker job as by submit and resume, before it imports anything."""
    import worker.train as train
    from core.config import config_from_dict
    from core.errors import RunError
    from orchestrator.run_models import create_run
    storage = Storage(str(tmp_path / "run"))
    create_run(storage, config_from_dict({"workers": 1, "run_dir": storage.url}))
    (tmp_path / "run" / "config.yaml").chmod(0o666)
    with pytest.raises(RunError, match="(?s)others can rewrite this run.s config.*config.yaml is writable by other users"):
        train.load_run_config(storage)
    from core.assignment import Assignment
    with pytest.raises(RunError, match="others can rewrite"):
        train.run_worker(Assignment(storage.url, 0, 0, "global/round_00000.safetensors", threads=1))


@pytest.mark.slow
def test_a_loss_that_turns_non_finite_in_the_worker_names_task_worker_and_job(tmp_path, capsys):
    """Finite on the submit check's batch of 2, NaN on a worker's batch of 4: the worker's job fails
    with the task, worker, round and job id, and the run stops with that reason."""
    source = USER_TASK.replace("return F.cross_entropy(model(x), y)",
                               "return F.cross_entropy(model(x), y) * (float('nan') if len(y) > 2 else 1.0)")
    where = _write_task(tmp_path / "mytasks", source)
    run = tmp_path / "run"
    code = main(["submit", "--set", "task=blobs:Blobs", "--set", f"task_path={where}", "--workers", "1",
                 "--rounds", "1", "--inner-steps", "3", "--executor", "inline", "--run-dir", str(run), *SMALL,
                 "--set", "inner.batch_size=4", "--set", "round.max_retries=0"])
    assert code != 0
    jobs = Storage(str(run)).read_json("rounds/00000/jobs.json")
    failure = json.dumps(jobs["workers"]["0"]["failures"])
    job = jobs["workers"]["0"]["job_ids"][0]
    says = "task blobs:Blobs, worker 0 round 0 (job " + job + "): the loss became non-finite"
    assert says in failure
    assert says in capsys.readouterr().out  # the run's own last word, and status's, name it: not only the job log
    assert says in Storage(str(run)).read_json("failed.json")["reason"]
    assert main(["status", str(run)]) == 0 and says in " ".join(capsys.readouterr().out.split())  # wrapped: words


@pytest.mark.slow
def test_a_users_task_under_a_time_budget_is_replayed_bit_for_bit(tmp_path):
    """A time budget makes how many steps each worker trains a matter of timing; `submit --replay`
    repeats the run exactly for a task of examples too (its batches are a function of seed, worker, step)."""
    where = _write_task(tmp_path / "mytasks", USER_TASK)
    src, again = tmp_path / "src", tmp_path / "again"
    assert main(["submit", "--set", "task=blobs:Blobs", "--set", f"task_path={where}", "--workers", "2", "--rounds", "2",
                 "--inner-steps", "5000", "--set", "round.budget=seconds", "--set", "round.budget_seconds=0.3",
                 "--executor", "inline", "--run-dir", str(src), *SMALL]) == 0
    assert main(["submit", "--replay", str(src), "--run-dir", str(again), "--executor", "inline"]) == 0
    a, b = Storage(str(src)), Storage(str(again))
    for r in range(2):
        assert a.read_json(f"rounds/{r:05d}/record.json")["global_digest"] == b.read_json(f"rounds/{r:05d}/record.json")["global_digest"]
        steps = [a.read_json(f"rounds/{r:05d}/contrib/worker_{w:03d}.json")["steps"] for w in range(2)]
        assert all(0 < n < 5000 for n in steps)  # the budget, not the step count, ended the round
        assert steps == [b.read_json(f"rounds/{r:05d}/contrib/worker_{w:03d}.json")["steps"] for w in range(2)]


def test_task_digits_without_the_vision_extra_says_what_to_install(tmp_path, monkeypatch, capsys):
    """scikit-learn missing (blocked in sys.modules, as an install without the extra has it): one
    error naming the extra to install, before any run directory is made."""
    from orchestrator.cli import main
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    run = tmp_path / "run"
    assert main(["submit", "--executor", "inline", "--set", "task=digits", "--workers", "2", "--rounds", "1",
                 "--run-dir", str(run)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "task digits needs sklearn" in out and "pip install 'islands[vision]'" in out and "Traceback" not in out
    assert not run.exists()
