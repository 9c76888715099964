"""Turning raw configuration (YAML, `--set` dotted keys) into core.config's frozen dataclasses.

`build` (core/coerce.py, the one coercer of untrusted values into dataclasses) walks a dataclass's
type hints and collects every problem (unknown keys with the valid ones named, wrong types)
instead of stopping at the first; `check` then runs every range and cross-field check on the typed
result. core.config's loaders call these and raise one ConfigError.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from core.errors import ConfigError

PRESET_DIR = Path(__file__).resolve().parent.parent / "slurm_templates"
PRESET_KEYS = ("timeout_min", "cpus_per_task", "mem_gb", "gpus_per_node", "tasks_per_node", "partition", "account",
               "qos", "constraint", "extra_sbatch", "setup")

if TYPE_CHECKING:
    from core.config import Config, ModelConfig

BUILTIN_TASKS = ("lm", "digits")  # worker/tasks/: the language model (GPT or model.hf), the vision example


MAX_DEPTH, MAX_NODES = 32, 100_000
"""A config needs none of these near their bounds; past them YAML is an attack (billion laughs,
nesting that overflows the stack, a tag asking for an object) and is refused before it is built."""
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C one: faster at every worker start


def load_yaml(text: str | bytes, where: str) -> Any:
    """YAML parsed safely and boundedly: the size the document would have with every alias expanded,
    and its nesting, measured on the event stream before any object is built (an alias bomb expands
    only when something walks it, such as an error message), and tags other than YAML's own refused;
    every problem is a ConfigError naming `where`."""
    sizes: dict[str, int] = {}  # anchor -> nodes it stands for, expanded
    stack: list[list] = []  # open collections: [anchor, nodes so far]
    try:
        for event in yaml.parse(text, Loader=_SafeLoader):
            tag = getattr(event, "tag", None)
            if tag is not None and (not tag.startswith("tag:yaml.org,2002:") or tag.startswith("tag:yaml.org,2002:python/")):
                raise ConfigError([f"YAML tag {tag!r} ({event.start_mark}): a config takes no tags"], source=where)
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                stack.append([event.anchor, 1])
                if len(stack) > MAX_DEPTH:
                    raise ConfigError([f"YAML nested deeper than {MAX_DEPTH} levels is not a config"], source=where)
                continue
            if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                anchor, n = stack.pop()
            elif isinstance(event, yaml.AliasEvent):
                anchor, n = None, sizes.get(event.anchor, 1)
            elif isinstance(event, yaml.ScalarEvent):
                anchor, n = event.anchor, 1
            else:
                continue
            if anchor:
                sizes[anchor] = n
            if stack:
                stack[-1][1] += n
            if n > MAX_NODES or (stack and stack[-1][1] > MAX_NODES):
                raise ConfigError([f"YAML that stands for more than {MAX_NODES} values once its aliases are expanded "
                                   "is not a config (an alias bomb?)"], source=where)
        return yaml.load(text, Loader=_SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML: {str(exc)[:500]}"], source=where) from None


def read_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = load_yaml(f.read(), path)
    except FileNotFoundError:
        raise ConfigError([f"config file {path} does not exist"], source=path) from None
    except (UnicodeDecodeError, OSError) as exc:
        raise ConfigError([f"cannot read it as text: {exc}"], source=path) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"the top level must be a mapping of keys, got {type(data).__name__}"], source=path)
    return data


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def model_shorthand(raw: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """`model: hf:PATH` -> `model: {hf: PATH}`; model.hf made absolute, so that workers started
    elsewhere (another directory, a Slurm node) find the same directory."""
    model = raw.get("model")
    if isinstance(model, str):
        if not model.startswith("hf:") or not model[3:].strip():
            problems.append(f"model: {model!r} is not a model; write `model: hf:/path/to/dir` for a local Hugging "
                            "Face model directory, or a mapping of model.* keys for the built-in model")
            return {k: v for k, v in raw.items() if k != "model"}
        model = {"hf": model[3:].strip()}
    if isinstance(model, dict) and isinstance(model.get("hf"), str) and model["hf"]:
        model = {**model, "hf": os.path.abspath(os.path.expanduser(model["hf"]))}
    return {**raw, "model": model} if "model" in raw else raw


def load_preset(name: str, directory: Path = PRESET_DIR) -> dict[str, Any]:
    """An executor preset (slurm_templates/NAME.yaml): the executor keys it sets."""
    path = directory / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in directory.glob("*.yaml"))
        raise ConfigError([f"executor.preset {name!r} does not exist; known presets: {', '.join(known) or 'none'} "
                           f"(files in {directory})"])
    data = load_yaml(path.read_text(), str(path)) or {}
    unknown = sorted(set(data) - set(PRESET_KEYS))
    if unknown:
        raise ConfigError([f"preset {path}: unknown key(s) {unknown}; valid keys: {', '.join(PRESET_KEYS)}"])
    return data


def apply_executor_preset(raw: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """Fill the executor keys raw does not write from its executor.preset; a key written is kept,
    even one equal to the built-in default. The config then holds what the jobs get."""
    e = raw.get("executor")
    if not isinstance(e, Mapping) or not isinstance(e.get("preset"), str):
        return raw  # no preset (a wrong type is reported by build)
    try:
        preset = load_preset(e["preset"])
    except ConfigError as exc:
        problems.extend(exc.problems)
        return raw
    raw["executor"] = {**preset, **e}
    return raw


def apply_preset(raw: dict[str, Any], presets: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Fill the keys of raw's algorithm preset (core.config.PRESETS) that the user did not set."""
    algorithm = raw.get("algorithm", "diloco")
    preset = presets.get(algorithm, {}) if isinstance(algorithm, str) else {}  # a wrong type is reported by build
    for key, value in preset.items():
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node.get(part), dict) else {}
        if parts[-1] not in node:
            set_dotted(raw, key, value)
    return raw


MAX_WORKERS, MAX_ROUNDS = 4096, 1_000_000
"""Past these a number is a typo, not a run: each worker is a job (on the local executor a process)."""


MAX_INT = 1 << 53
"""No key needs an integer past this; beyond it a count is no longer exact as a float, and 2**1100
overflows one (outer.warmup_rounds once did, in the first merge)."""


def _leaves(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every value in a config, nested sections and tuples included."""
    out = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            out += _leaves(v, key + ".")
            continue
        out += [(key, x) for x in (v if isinstance(v, tuple) else (v,))]
    return out


def _collector() -> tuple[list[str], Callable[[bool, str], None]]:
    """(the problems, need(cond, msg): adds msg unless cond holds)."""
    problems: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            problems.append(msg)
    return problems, need


def check(cfg: Config) -> list[str]:
    """Range and cross-field checks, all of them, on a well-typed config."""
    leaves = _leaves(cfg)
    p = [f"{key} must be a finite number, got {value}" for key, value in leaves
         if isinstance(value, float) and not math.isfinite(value)]
    p += [f"{key} is {'a' if value > 0 else 'minus a'} {len(str(abs(value)))}-digit number, past any count a run "
          f"needs (at most {MAX_INT}): a typo?" for key, value in leaves
          if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT]
    p += [f"{key} holds a NUL byte (at character {value.index(chr(0))}), which no path, name or command can: "
          "a damaged or pasted value?" for key, value in leaves if isinstance(value, str) and "\0" in value]
    for part in (_check_run, _check_round, _check_schedule, _check_model, _check_training, _check_io):
        p += part(cfg)
    return p


def _check_run(cfg: Config) -> list[str]:
    p, need = _collector()
    need(cfg.task in BUILTIN_TASKS or re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", cfg.task) is not None,
         f"task: {cfg.task!r} is not a task; valid: {', '.join(BUILTIN_TASKS)}, or your own as package.module:Class "
         "(docs/tasks.md)")
    need(cfg.task == "lm" or (cfg.model.hf is None and cfg.data.source is None),
         f"model.hf and data.source belong to task lm; task {cfg.task} builds its own model and reads its own data: "
         "drop them")
    need(cfg.task_path is None or cfg.task not in BUILTIN_TASKS,
         f"task_path names where your own task is imported from; task {cfg.task} is built in: drop task_path")
    need(cfg.workers >= 1, f"workers must be >= 1, got {cfg.workers}")
    need(cfg.rounds >= 1, f"rounds must be >= 1, got {cfg.rounds}")
    need(cfg.workers <= MAX_WORKERS, f"workers must be at most {MAX_WORKERS}, got {cfg.workers}: a typo?")
    need(cfg.rounds <= MAX_ROUNDS, f"rounds must be at most {MAX_ROUNDS}, got {cfg.rounds}: a typo?")
    need(cfg.algorithm != "lofi" or cfg.rounds == 1,
         f"lofi averages once at the end, so rounds must be 1 (got {cfg.rounds}); use --algorithm diloco for several rounds")
    return p


def _check_round(cfg: Config) -> list[str]:
    p, need = _collector()
    need(0 <= cfg.round.min_workers <= cfg.workers,
         f"round.min_workers must be between 0 (all) and workers={cfg.workers}, got {cfg.round.min_workers}")
    need(cfg.round.deadline_s >= 0, f"round.deadline_s must be >= 0, got {cfg.round.deadline_s}")
    need(cfg.round.max_retries >= 0, f"round.max_retries must be >= 0, got {cfg.round.max_retries}")
    need(cfg.round.poll_s > 0, f"round.poll_s must be > 0, got {cfg.round.poll_s}")
    need(0 < cfg.round.staleness_decay <= 1, f"round.staleness_decay must be in (0, 1], got {cfg.round.staleness_decay}")
    need(cfg.round.max_staleness >= 1, f"round.max_staleness must be >= 1, got {cfg.round.max_staleness}")
    need(cfg.outer.warmup_rounds >= 0, f"outer.warmup_rounds must be >= 0, got {cfg.outer.warmup_rounds}")
    need(cfg.round.dense_rounds >= 0, f"round.dense_rounds must be >= 0, got {cfg.round.dense_rounds}")
    rc = cfg.round
    need(0 < rc.prune_keep <= 1, f"round.prune_keep must be in (0, 1], got {rc.prune_keep}")
    coding = [f"round.{k}={v}" for k, v, plain in (("codec", rc.codec, "fp32"), ("prune_keep", rc.prune_keep, 1))
              if v != plain]  # only what was set: the other key says nothing to the user
    need(rc.contribution == "delta" or not coding,
         f"{' and '.join(coding)} code{'s' if len(coding) == 1 else ''} the outer gradient: "
         f"{'it needs' if len(coding) == 1 else 'they need'} round.contribution=delta (weights are always sent in full)")
    need(0 < rc.topk <= 1, f"round.topk must be in (0, 1], got {rc.topk}")
    need(rc.bits in (2, 4, 8), f"round.bits must be 2, 4 or 8, got {rc.bits}")
    need(0 <= rc.error_feedback <= 1, f"round.error_feedback (the buffer's decay) must be in [0, 1], got {rc.error_feedback}")
    need(rc.state_every >= 1, f"round.state_every (rounds between state snapshots) must be >= 1, got {rc.state_every}")
    need(rc.keep_last >= 0 and rc.keep_every >= 0,
         f"round.keep_last and round.keep_every must be >= 0 (0: keep everything / no extra globals), got "
         f"{rc.keep_last} and {rc.keep_every}")
    need(rc.max_update >= 0 and math.isfinite(rc.max_update),
         f"round.max_update must be a finite number >= 0 (0: derived from inner.lr and inner.steps), got {rc.max_update}")
    need(rc.codec != "topk" or rc.prune_keep == 1,
         "round.prune_keep prunes rows for the fp32, bf16 and int8 codecs; codec topk keeps round.topk of each chunk: "
         "drop prune_keep")
    need(rc.codec != "topk" or rc.aggregate == "mean",
         f"round.aggregate={rc.aggregate} with codec topk: each worker sends a different 1.6% of each chunk, so an "
         "element's median or trimmed mean over the workers is almost always 0; use aggregate mean (or another codec)")
    need(rc.contribution == "weights" or cfg.algorithm != "lte",
         "round.contribution=delta does not apply to lte, whose workers send LoRA heads: drop it")
    need(rc.contribution == "weights" or rc.late_policy != "fold",
         "round.contribution=delta with round.late_policy=fold is not supported yet: use late_policy continue or drop")
    need(cfg.algorithm != "lte" or rc.late_policy != "fold",
         "round.late_policy=fold does not apply to lte: a late worker's heads were trained on an older base, which the "
         "merged heads have changed since; use late_policy drop (a straggler is cancelled at the deadline)")
    return p


def _check_schedule(cfg: Config) -> list[str]:
    """A round's time budget, overlap, robust aggregation and replay."""
    p, need = _collector()
    rc = cfg.round
    need((rc.budget == "seconds") == (rc.budget_seconds > 0),
         f"round.budget={rc.budget} with round.budget_seconds={rc.budget_seconds}: a time budget needs both "
         "(e.g. --set round.budget=seconds --set round.budget_seconds=600, with inner.steps as the most a worker may "
         "take); budget steps takes no budget_seconds")
    ranks = cfg.executor.tasks_per_node or cfg.executor.gpus_per_node or 1
    need(rc.overlap == "off" or (rc.worker_mode == "persistent" and cfg.algorithm != "lte" and ranks == 1),
         f"round.overlap={rc.overlap} needs persistent workers (round.worker_mode=persistent) of one rank "
         f"(executor.tasks_per_node 1) training the whole model (not lte); got worker_mode={rc.worker_mode}, "
         f"algorithm={cfg.algorithm}, {ranks} rank(s) per worker")
    need(0 <= rc.overlap_mix <= 1, f"round.overlap_mix must be in [0, 1], got {rc.overlap_mix}")
    need(0 < rc.overlap_ahead <= 1, f"round.overlap_ahead must be in (0, 1], got {rc.overlap_ahead}")
    need(rc.aggregate == "mean" or (cfg.algorithm != "lte" and rc.late_policy != "fold"),
         f"round.aggregate={rc.aggregate} is unweighted and per element: it does not apply to lte (LoRA heads) nor "
         "to late_policy=fold (late contributions weighed down): use aggregate mean, or late_policy continue or drop")
    need(0 <= rc.trim < 0.5, f"round.trim must be in [0, 0.5), got {rc.trim}")
    need(not rc.replay or (not rc.stream_merge and rc.min_workers in (0, cfg.workers) and rc.deadline_s == 0),
         f"round.replay ({rc.replay}) needs every worker in every round, summed in the recorded order: "
         f"round.min_workers 0, round.deadline_s 0 and round.stream_merge false (got {rc.min_workers}, "
         f"{rc.deadline_s}, {str(rc.stream_merge).lower()}); `orchestrate submit --replay RUN` sets them")
    return p


def _check_model(cfg: Config) -> list[str]:
    p, need = _collector()
    m = cfg.model
    need(min(m.n_layer, m.n_head, m.n_embd, m.block_size) >= 1, "model sizes (n_layer, n_head, n_embd, block_size) must be >= 1")
    for key, value, most in (("n_layer", m.n_layer, 1024), ("n_head", m.n_head, 1024), ("n_embd", m.n_embd, 1 << 16),
                             ("block_size", m.block_size, 1 << 20)):
        need(value <= most, f"model.{key} is {value}, more than any model this runs ({most}): a typo?")
    need(m.n_head >= 1 and m.n_embd % max(m.n_head, 1) == 0,
         f"model.n_embd ({m.n_embd}) must be divisible by model.n_head ({m.n_head})")
    need(0 <= m.dropout < 1, f"model.dropout must be in [0, 1), got {m.dropout}")
    if m.hf is not None:
        p.extend(check_hf(m))
    return p


def _check_training(cfg: Config) -> list[str]:
    """inner, outer and lte."""
    p, need = _collector()
    m = cfg.model
    i = cfg.inner
    need(i.steps >= 1, f"inner.steps must be >= 1, got {i.steps}")
    need(i.batch_size >= 1, f"inner.batch_size must be >= 1, got {i.batch_size}")
    if cfg.algorithm == "lofi":
        need(i.batch_size % cfg.workers == 0 and i.batch_size >= cfg.workers,
             f"lofi splits the global batch across workers: inner.batch_size ({i.batch_size}) must be a multiple of workers ({cfg.workers})")
    need(i.lr > 0, f"inner.lr must be > 0, got {i.lr}")
    need(0 <= i.min_lr_ratio <= 1, f"inner.min_lr_ratio must be in [0, 1], got {i.min_lr_ratio}")
    need(i.warmup_steps >= 0, f"inner.warmup_steps must be >= 0, got {i.warmup_steps}")
    need(i.grad_clip >= 0, f"inner.grad_clip must be >= 0, got {i.grad_clip}")
    need(0 <= i.beta1 < 1 and 0 <= i.beta2 < 1, "inner.beta1 and inner.beta2 must be in [0, 1)")
    need(i.threads >= 0, f"inner.threads must be >= 0, got {i.threads}")
    o = cfg.outer
    need(o.lr > 0, f"outer.lr must be > 0, got {o.lr}")
    need(0 <= o.momentum < 1, f"outer.momentum must be in [0, 1), got {o.momentum}")
    need(o.eps > 0, f"outer.eps must be > 0, got {o.eps}")
    need(all(0 <= b < 1 for b in o.betas), f"outer.betas must be in [0, 1), got {list(o.betas)}")
    need(o.optimizer != "sgdm" or o.momentum > 0, "outer.optimizer sgdm needs outer.momentum > 0")
    need(o.optimizer != "nesterov" or o.momentum > 0, "outer.optimizer nesterov needs outer.momentum > 0")
    t = cfg.lte
    need(t.rank >= 1, f"lte.rank must be >= 1, got {t.rank}")
    need(cfg.algorithm != "lte" or m.hf is not None or t.rank < m.n_embd,
         f"lte.rank ({t.rank}) must be < model.n_embd ({m.n_embd}): a head as wide as the layer is not low-rank")
    need(t.alpha > 0, f"lte.alpha must be > 0, got {t.alpha}")
    need(t.lr > 0, f"lte.lr must be > 0, got {t.lr}")
    return p


def _check_io(cfg: Config) -> list[str]:
    """data and executor."""
    p, need = _collector()
    d = cfg.data
    need(0 < d.heldout_fraction < 1, f"data.heldout_fraction must be in (0, 1), got {d.heldout_fraction}")
    need(d.eval_batches >= 1, f"data.eval_batches must be >= 1, got {d.eval_batches}")
    e = cfg.executor
    need(e.timeout_min >= 1, f"executor.timeout_min must be >= 1, got {e.timeout_min}")
    need(e.cpus_per_task >= 1, f"executor.cpus_per_task must be >= 1, got {e.cpus_per_task}")
    need(e.mem_gb > 0, f"executor.mem_gb must be > 0, got {e.mem_gb}")
    need(e.service_timeout_min >= 1, f"executor.service_timeout_min must be >= 1, got {e.service_timeout_min}")
    need(e.gpus_per_node >= 0, f"executor.gpus_per_node must be >= 0, got {e.gpus_per_node}")
    need(e.tasks_per_node >= 0, f"executor.tasks_per_node must be >= 0, got {e.tasks_per_node}")
    return p


def check_hf(m: ModelConfig) -> list[str]:
    """A Hugging Face model: a local directory with its config.json, and no built-in-model keys."""
    p = []
    default = type(m)()
    builtin = [k for k in ("n_layer", "n_head", "n_embd", "dropout") if getattr(m, k) != getattr(default, k)]
    if builtin:
        p.append(f"model.{', model.'.join(builtin)} describe the built-in model, but model.hf brings its own "
                 "architecture: remove them")
    return p
