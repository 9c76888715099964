"""bench.reproduce: the in-process simulation against an oracle, and one experiment end to end."""
from __future__ import annotations

import json
import math

import pytest
import torch

from bench.reproduce import report, sim
from bench.reproduce.__main__ import main
from bench.reproduce.context import SIZES, Context


@pytest.fixture(scope="module")
def ctx() -> Context:
    return Context(SIZES["test"], [0])


def _max_diff(a: sim.Weights, b: sim.Weights) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_diloco_one_worker_fedavg_is_plain_training(ctx: Context) -> None:
    """K = 1 with outer SGD lr 1.0: the new global model is the worker's weights, and the worker
    keeps its AdamW state and data position, so it must equal uninterrupted training."""
    over = {"workers": 1, "rounds": 4, "outer.optimizer": "sgd", "outer.lr": 1.0}
    cfg = ctx.cfg(0, **over)
    data = ctx.data(cfg)
    plain = sim.run_plain(cfg, data)
    fedavg = sim.run_diloco(cfg, data)
    assert fedavg.losses == pytest.approx(plain.losses, abs=1e-5)
    assert _max_diff(fedavg.extra["weights"], plain.extra["weights"]) < 1e-4
    # the oracle can fail: the DiLoCo outer step (Nesterov) moves away from plain training
    nesterov = sim.run_diloco(ctx.cfg(0, **{**over, "outer.optimizer": "nesterov", "outer.lr": 0.7}), data)
    assert _max_diff(nesterov.extra["weights"], plain.extra["weights"]) > 1e-3


def test_all_gradients_dropped_leaves_the_global_model(ctx: Context) -> None:
    cfg = ctx.cfg(0, workers=2)
    run = sim.run_diloco(cfg, ctx.data(cfg), drop=1.0)
    assert run.extra["dropped"] == 2 * cfg.rounds
    assert len(set(run.losses)) == 1
    # dropped workers continue from their own weights: only the first round downloads the base
    size = sim.nbytes(run.extra["weights"])
    assert run.comm_bytes == 2 * size + 2 * cfg.rounds * size


def test_overlap_adopting_at_step_0_is_synchronous_diloco(ctx: Context) -> None:
    """An overlapped worker that adopts the global before its first step (rebase: global + p - p)
    trains exactly as a synchronous one; adopting later moves away from it (the test can fail)."""
    cfg = ctx.cfg(0, workers=2)
    data = ctx.data(cfg)
    sync = sim.run_diloco(cfg, data)
    over = ctx.cfg(0, workers=2, **{"round.overlap": "rebase"})
    assert sim.run_diloco(over, data, ahead=0).losses == sync.losses
    late = sim.run_diloco(over, data, ahead=cfg.inner.steps // 2)
    assert _max_diff(late.extra["weights"], sync.extra["weights"]) > 1e-4


def test_test_docs_are_a_separate_domain(ctx: Context) -> None:
    tests = ctx.data(ctx.cfg(0), "tests")
    assert {s.group for s in tests.sampler(ctx.cfg(0), 0, 1).shards} == {sim.TEST_GROUP}
    assert tests.dataset.index.split("eval") and tests.eval_set(ctx.cfg(0))
    source = ctx.data(ctx.cfg(0))
    assert sim.TEST_GROUP not in {s.group for s in source.dataset.index.shards}


def test_one_experiment_end_to_end_keeps_notes(tmp_path) -> None:
    assert main(["single", "--size", "test", "--seeds", "1", "--rounds", "3", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / report.IMG / "single.json").read_text())
    assert record["command"] == "python -m bench.reproduce single --size test --seeds 1 --rounds 3"
    assert [len(c["per_seed"][0]) for c in record["curves"]] == [4, 4]  # the initial loss, then 3 rounds
    labels = [r["label"] for r in record["rows"]]
    assert labels[0] == "plain training (1 worker)" and labels[1].startswith("DiLoCo, K = 1")
    assert all(math.isfinite(v) and v < math.log(256) + 0.5 for r in record["rows"] for v in r["finals"])
    assert record["checks"] and (tmp_path / report.IMG / "single.png").stat().st_size > 1000
    md = (tmp_path / "results.md").read_text()
    assert "| plain training (1 worker) |" in md and "img/results/single.png" in md
    (tmp_path / "results.md").write_text(md.replace(report.NO_NOTES.strip(), "Hand-written: kept."))
    report.render(tmp_path, ["single"])
    assert "Hand-written: kept." in (tmp_path / "results.md").read_text()


def test_unknown_experiment_is_refused() -> None:
    with pytest.raises(SystemExit):
        main(["nope"])


@pytest.mark.parametrize("argv, said", [(["--jobs", "0"], "--jobs must be at least 1"),
                                        (["--rounds", "-1"], "--rounds must be at least 1")])
def test_a_bad_count_is_refused_with_its_option(argv, said, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["compress", *argv])
    assert said in capsys.readouterr().err


def test_the_recorded_command_names_rounds_and_jobs_when_given() -> None:
    from bench.reproduce.__main__ import _command, parse
    assert _command("compress", parse(["compress", "--size", "small", "--seeds", "8", "--rounds", "64", "--jobs", "14"])) == \
        "python -m bench.reproduce compress --size small --seeds 8 --rounds 64 --jobs 14"
    assert _command("compress", parse(["compress"])) == "python -m bench.reproduce compress --size tiny --seeds 2"


def test_methods_of_an_experiment_share_the_eval_data(ctx: Context) -> None:
    """A 4x-batch baseline or an LTE head's small batch must not change what it is scored on."""
    small, big = ctx.cfg(0), ctx.cfg(0, **{"inner.batch_size": 4 * SIZES["test"].batch_size})
    a, b = ctx.data(small).eval_set(small), ctx.data(big).eval_set(big)
    assert len(a) == len(b) and all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))


def test_runs_trained_in_parallel_processes_equal_runs_trained_here() -> None:
    """Context.prefetch (--jobs): each run in a process of its own, one torch thread; the same runs
    trained in this process with one thread end at the same losses, and the experiment's own call
    then finds the prefetched run instead of training it again."""
    runs = [(0, {}), (0, {"round.contribution": "delta", "round.codec": "topk", "outer.optimizer": "sgd", "outer.lr": 3.0})]
    par = Context(SIZES["test"], [0], jobs=2)
    par.prefetch(runs)
    assert len(par._memo) == 2  # trained there: no pre-training here either
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        here = Context(SIZES["test"], [0])
        for seed, kw in runs:
            got = par.diloco(seed, **kw)
            assert got is par.diloco(seed, **kw) and got.losses == here.diloco(seed, **kw).losses
    finally:
        torch.set_num_threads(threads)
