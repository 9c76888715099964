"""Config loading: every problem at once, unknown keys named with the valid ones, presets, round trips."""
from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from core.config import Config, config_from_dict, load_config, replace, to_dict, to_yaml
from core.errors import ConfigError


def test_defaults_are_the_paper_defaults():
    cfg = load_config()
    assert cfg.algorithm == "diloco"
    assert (cfg.outer.optimizer, cfg.outer.lr, cfg.outer.momentum) == ("nesterov", 0.7, 0.9)
    assert cfg.outer.eps == 0.1
    assert cfg.quorum == cfg.workers


def test_unknown_keys_are_named_with_the_valid_ones(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("workerz: 3\ninner:\n  lr: 0.1\n  stepz: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    msg = str(info.value)
    assert "unknown key 'workerz'" in msg and "valid keys here: algorithm, workers, rounds" in msg
    assert "unknown key 'inner.stepz'" in msg and "valid keys here: steps, batch_size, lr" in msg
    assert "did you mean 'workers'?" in msg and "did you mean 'inner.steps'?" in msg
    assert str(path) in msg


def test_a_mistyped_key_through_the_cli_says_which_was_meant(tmp_path, capsys):
    from orchestrator.cli import main
    for key, meant in (("inner.lrr", "inner.lr"), ("inner.warmup", "inner.warmup_steps"), ("innr.lr", "inner")):
        assert main(["submit", "--set", f"{key}=1", "--run-dir", str(tmp_path / "run")]) == 2
        out = capsys.readouterr().out
        assert f"unknown key '{key.split('.')[0] if key.startswith('innr') else key}'; did you mean '{meant}'?" in out, out
    assert main(["submit", "--set", "inner.zzz=1", "--run-dir", str(tmp_path / "run")]) == 2
    assert "did you mean" not in capsys.readouterr().out and not (tmp_path / "run").exists()


def test_a_codec_without_delta_names_only_what_the_user_set():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"round": {"codec": "topk"}})
    assert "round.codec=topk codes the outer gradient: it needs round.contribution=delta" in str(info.value)
    assert "prune_keep" not in str(info.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"workers": 0, "rounds": "many", "inner": {"lr": -1, "device": "tpu"},
                          "outer": {"optimizer": "lion"}})
    problems = info.value.problems
    assert len(problems) == 5, problems  # type and range problems together
    text = "\n".join(problems)
    assert "rounds: expected an integer, got 'many'" in text
    assert "inner.device: 'tpu' is not one of 'auto', 'cpu', 'cuda'" in text
    assert "outer.optimizer: 'lion' is not one of 'nesterov', 'sgd', 'sgdm', 'adam'" in text


def test_range_problems_listed_together():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"workers": 0, "inner": {"lr": -1}, "model": {"n_embd": 130, "n_head": 4}})
    text = str(info.value)
    assert "workers must be >= 1" in text and "inner.lr must be > 0" in text and "divisible by model.n_head" in text


def test_set_overrides_and_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("workers: 8\ninner:\n  lr: 0.01\n")
    cfg = load_config(str(path), {"rounds": 3}, ["inner.lr=1e-3", "outer.betas=[0.8, 0.9]", "data.source=/x"])
    assert (cfg.workers, cfg.rounds, cfg.inner.lr, cfg.outer.betas, cfg.data.source) == (8, 3, 1e-3, (0.8, 0.9), "/x")


def test_bad_set_syntax():
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(sets=["inner.lr"])


def test_fedavg_preset_fills_only_unset_keys():
    cfg = config_from_dict({"algorithm": "fedavg"})
    assert (cfg.outer.optimizer, cfg.outer.lr) == ("sgd", 1.0)
    cfg = config_from_dict({"algorithm": "fedavg", "outer": {"lr": 0.5}})
    assert (cfg.outer.optimizer, cfg.outer.lr) == ("sgd", 0.5)


def test_lofi_is_one_round_with_split_batch():
    cfg = config_from_dict({"algorithm": "lofi", "workers": 4, "inner": {"batch_size": 32}})
    assert cfg.rounds == 1 and cfg.worker_batch_size == 8 and cfg.outer.optimizer == "sgd"
    with pytest.raises(ConfigError, match="rounds must be 1"):
        config_from_dict({"algorithm": "lofi", "rounds": 3})
    with pytest.raises(ConfigError, match="multiple of workers"):
        config_from_dict({"algorithm": "lofi", "workers": 3, "inner": {"batch_size": 16}})


def test_yaml_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("workers: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(str(lst))


def test_resolved_config_round_trips_through_yaml():
    cfg = config_from_dict({"algorithm": "fedavg", "workers": 3, "executor": {"extra_sbatch": {"exclusive": None}}})
    again = config_from_dict(yaml.safe_load(to_yaml(cfg)))
    assert again == cfg
    assert replace(cfg, inner__lr=0.5).inner.lr == 0.5


@settings(max_examples=60, deadline=None)
@given(workers=st.integers(1, 64), rounds=st.integers(1, 500), steps=st.integers(1, 1000),
       lr=st.floats(1e-6, 1.0), opt=st.sampled_from(["nesterov", "sgd", "sgdm", "adam"]),
       quorum=st.integers(0, 64))
def test_property_valid_configs_round_trip(workers, rounds, steps, lr, opt, quorum):
    raw = {"workers": workers, "rounds": rounds, "inner": {"steps": steps}, "outer": {"optimizer": opt, "lr": lr},
           "round": {"min_workers": quorum}}
    if quorum > workers:
        with pytest.raises(ConfigError, match="min_workers"):
            config_from_dict(raw)
        return
    cfg = config_from_dict(raw)
    assert config_from_dict(to_dict(cfg)) == cfg
    assert cfg.total_inner_steps == rounds * steps
    assert cfg.quorum == (quorum or workers)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k not in Config.__dataclass_fields__),
                       st.integers(), min_size=1, max_size=3))
def test_property_any_unknown_top_level_key_is_rejected(extra):
    with pytest.raises(ConfigError) as info:
        config_from_dict(extra)
    assert len(info.value.problems) == len(extra)


def test_docs_config_md_is_generated_from_the_dataclasses():
    from pathlib import Path

    from core.config_docs import render
    page = Path(__file__).parent.parent / "docs" / "config.md"
    assert page.read_text() == render(), "docs/config.md is stale: python -m core.config_docs > docs/config.md"


@pytest.mark.parametrize("overrides", [["round.budget=seconds"], ["round.budget_seconds=60"],
                                       ["round.budget=seconds", "round.budget_seconds=-1"]])
def test_a_time_budget_needs_both_keys(overrides):
    with pytest.raises(ConfigError, match="a time budget needs both"):
        load_config(None, None, overrides)


def test_a_time_budget():
    rc = load_config(None, None, ["round.budget=seconds", "round.budget_seconds=600"]).round
    assert (rc.budget, rc.budget_seconds) == ("seconds", 600)
