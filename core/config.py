"""The run configuration: frozen dataclasses, one YAML file, `--set dotted.key=value` overrides.

Every field has a docstring (docs/config.md is generated from them). Loading collects every
problem (unknown keys with the valid ones named, wrong types, out-of-range values) and raises one
ConfigError. The resolved config is written into the run directory, and a resumed run reads it back.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import yaml

from core.errors import ConfigError

Algorithm = Literal["diloco", "lofi", "fedavg", "lte"]
OuterOptimizer = Literal["nesterov", "sgd", "sgdm", "adam"]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    n_layer: int = 2
    """Transformer blocks of the built-in byte-level GPT."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Model width. 2 x 4 x 128 is ~0.5M parameters; 12 x 12 x 768 is ~85M."""
    block_size: int = 128
    """Context length in tokens (bytes for the built-in model)."""
    dropout: float = 0.0
    """Dropout probability inside the model (0 for pre-training as in the papers)."""
    init_from: str | None = None
    """Checkpoint (.safetensors, any fsspec URL) to start from instead of a random init: the
    pre-trained model that lo-fi fine-tunes. Tensor names and shapes must match the model."""
    hf: str | None = None
    """A local Hugging Face transformers causal-LM directory (config.json, weights, tokenizer: what
    save_pretrained writes) to train instead of the built-in model, from its own weights;
    `model: hf:PATH` is short for this. Its tokenizer tokenizes the corpus; n_layer, n_head, n_embd
    and dropout do not apply. The final model is also exported as a Hugging Face directory
    (final/hf). Nothing is ever downloaded. Needs transformers (`pip install -e ".[hf]"`)."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str | None = None
    """Text to train on: null = the Python standard library's own source (always present);
    or a file or directory of text files of your own."""
    include_tests: bool = False
    """With the built-in corpus: also include the stdlib's test/ folders."""
    sharding: Literal["iid", "non-iid"] = "iid"
    """How documents are split across workers: `iid` deals files at random; `non-iid` gives each
    worker whole top-level packages (email/, asyncio/, ...), a natural non-i.i.d. split."""
    heldout_fraction: float = 0.05
    """Fraction of documents held out for the global model's eval loss."""
    eval_batches: int = 8
    """Held-out batches (of inner.batch_size sequences) per evaluation."""
    cache_dir: str | None = None
    """Where prepared token shards are cached (default $ISLANDS_CACHE or ~/.cache/islands)."""


@dataclass(frozen=True, kw_only=True)
class InnerConfig:
    steps: int = 25
    """H: inner AdamW steps each worker runs per round. lo-fi runs all its steps in one round."""
    batch_size: int = 16
    """Sequences per inner step on each worker. For `lofi` this is the global batch, and each of
    the K workers uses batch_size / K (the lo-fi paper's 1/K scaling)."""
    lr: float = 3e-3
    """Peak AdamW learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = 20
    """Linear warm-up steps. The schedule spans the worker's whole run (rounds x steps) and
    continues across rounds."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on biases, norms or embeddings)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Gradient-norm clipping threshold (0 disables it)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where workers train: `auto` takes CUDA when present (with bf16 autocast), else the CPU."""
    threads: int = 0
    """torch CPU threads per worker; 0 = the job's CPUs shared by the workers running at once."""


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    optimizer: OuterOptimizer = "nesterov"
    """Outer optimizer fed the outer gradient `global - mean(workers)`: `nesterov` (the DiLoCo
    default), `sgd` (lr 1.0 = FedAvg / plain averaging), `sgdm` (heavy-ball momentum), `adam`."""
    lr: float = 0.7
    """Outer learning rate (DiLoCo: 0.7; FedAvg: 1.0)."""
    momentum: float = 0.9
    """Momentum for `nesterov` and `sgdm`."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas for `adam`."""
    eps: float = 0.1
    """Adam epsilon; the DiLoCo paper needed 0.1 to keep outer Adam stable."""
    weighting: Literal["tokens", "uniform"] = "tokens"
    """Average workers weighted by the tokens each actually consumed, or uniformly."""


@dataclass(frozen=True, kw_only=True)
class LteConfig:
    rank: int = 32
    """`lte` only. r: rank of every worker's LoRA head on every linear layer (A is r x in, B is out x r).
    The paper pairs heads x rank around the model width; rank must be below model.n_embd."""
    alpha: float = 4096.0
    """LoRA alpha; the head's scale is s = alpha / rank (128 by default). The paper uses a large s
    (alpha 4096-8192 with rank 32-64) together with a lower learning rate (lte.lr)."""
    a_init: Literal["bernstein", "kaiming", "xavier"] = "bernstein"
    """Initialisation of each head's A (B starts at zero): `bernstein` a semi-orthogonal matrix
    scaled by sqrt(d_out / d_in) = sqrt(rank / in_features) (the paper's best); `kaiming` uniform
    (LoRA's default); `xavier` uniform. Every worker draws its own, from (seed, worker)."""
    reset_b: bool = True
    """After each merge the worker sets B to zero (Algorithm 1): its update now lives in the base."""
    reset_a: bool = False
    """Ablation: also redraw A after each merge (the paper found it worse)."""
    reset_opt: bool = False
    """Ablation: also drop the heads' AdamW state after each merge (the paper found it worse)."""
    lr: float = 1e-4
    """Peak learning rate of the LoRA heads (same warm-up and cosine schedule as inner.lr, which
    the small non-LoRA parameters keep). The paper: about 0.05-0.1x the full-model rate."""
    base_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the frozen base weights on the workers (bfloat16 halves their memory); the merge
    keeps the float32 copy and merges into it."""


@dataclass(frozen=True, kw_only=True)
class RoundConfig:
    min_workers: int = 0
    """Quorum: the fewest contributions a round may be merged with; 0 = all workers. A round is
    never merged below it."""
    deadline_s: float = 0.0
    """Once the quorum is in, close the round this many seconds after it was submitted, without
    the stragglers; 0 = wait for every worker whose job is still alive."""
    late_policy: Literal["continue", "restart", "drop", "fold"] = "continue"
    """What happens to a worker whose contribution missed a round's merge (docs/reliability.md).
    `continue`: it trains on from its own weights next round (the DiLoCo paper's dropped outer
    gradient). `drop` (`restart` is its old name): its late work is discarded, a straggler still
    running at the deadline is cancelled, it restarts from the new global weights. `fold`: the
    straggler runs on; once its contribution arrives, its pseudo-gradient (its base minus its
    weights) joins a later round's outer gradient with weight x staleness_decay ** rounds_late,
    and it restarts from the new global weights."""
    staleness_decay: float = 0.5
    """`fold` only: a contribution k rounds late is averaged in with its weight x decay ** k."""
    max_staleness: int = 4
    """`fold` only: contributions more rounds late than this are dropped, not folded."""
    max_retries: int = 2
    """How often a worker whose job ended without a contribution is resubmitted in one round."""
    worker_mode: Literal["per_round", "persistent"] = "per_round"
    """`per_round`: a new job per worker per round (each pays the queue wait). `persistent`: a
    worker job stays alive across rounds, waiting on storage for the next global checkpoint, until
    its time limit, when it checkpoints and is requeued: the queue is paid once per job lifetime.
    It also keeps its model and AdamW state in memory between rounds, so a round reads only its
    base weights; the state file is written after the contribution, in the background."""
    poll_s: float = 0.5
    """Seconds between polls of the run directory and the scheduler."""
    contribution: Literal["weights", "delta"] = "weights"
    """What a worker publishes: its `weights`, or its outer gradient `delta` = base - weights,
    coded as round.codec (core/codec.py); the merge decodes either. Not with `lte` (which sends
    LoRA heads) nor late_policy `fold`."""
    codec: Literal["fp32", "bf16", "int8"] = "fp32"
    """`delta` only: how the delta's values are stored: `fp32` (exact), `bf16` (half the bytes),
    `int8` with one fp32 scale per row (a quarter; error <= half a step of the row's max / 127)."""
    prune_keep: float = 1.0
    """`delta` only: fraction of each row's entries kept, the largest by magnitude (the DiLoCo
    paper's Table 6 prunes outer gradients); the rest are sent as zero. Below 1 the kept values are
    stored with their column index (2 bytes each for rows up to 32768 wide): it saves bytes only
    below about 1/3 (int8), 1/2 (bf16) or 2/3 (fp32)."""
    stream_merge: bool = True
    """Fold each contribution into an fp32 running sum as it arrives, so the merge after the last
    worker lands reads one contribution instead of K, folded while the outer step runs. The
    service also holds the round's global weights and outer state in memory from the round's
    start, so the step reads nothing from storage: about 3 fp32 copies of the model in all (sum,
    global, state). The step runs in place in the held copies, which become the new global and
    outer state: the new state waits there for its write (after the round's record) without a
    4th copy. The sum is in arrival order (recorded
    as the round record's `merge_order`; a resumed service rebuilds it from the contributions), so
    with 3+ workers two runs may differ in the last bit; `false` merges in worker order at the end
    (bitwise reproducible from run to run). Linear merges only: not `lte`."""


@dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    kind: Literal["auto", "local", "slurm"] = "auto"
    """`local` runs workers as local processes (submitit LocalExecutor); `slurm` submits them with
    sbatch; `auto` takes Slurm when `sbatch` is on PATH."""
    timeout_min: int = 60
    """Time limit of each worker job, in minutes."""
    cpus_per_task: int = 2
    """CPUs per worker job."""
    mem_gb: float = 4.0
    """Memory per worker job, in GB."""
    gpus_per_node: int = 0
    """GPUs per worker job."""
    partition: str | None = None
    """Slurm partition."""
    account: str | None = None
    """Slurm account."""
    qos: str | None = None
    """Slurm QOS."""
    constraint: str | None = None
    """Slurm node constraint."""
    extra_sbatch: dict[str, str] = field(default_factory=dict)
    """Additional sbatch parameters, e.g. {exclusive: ""} or {reservation: big}."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before each worker (module load ..., source venv/bin/activate)."""
    preset: str | None = None
    """A preset from slurm_templates/ whose values fill the fields not set here."""
    service_timeout_min: int = 4320
    """Time limit of the merge service's own CPU-only Slurm job (`orchestrate submit --detach` on
    Slurm); at the limit it is requeued and resumes from storage."""


@dataclass(frozen=True, kw_only=True)
class Config:
    algorithm: Algorithm = "diloco"
    """`diloco`: T rounds of H inner steps with an outer optimizer; `fedavg`: diloco with outer
    SGD lr 1.0; `lofi`: one round, batch / K per worker, weights averaged once at the end; `lte`:
    LoRA-the-Explorer, each worker trains its own LoRA heads, merged into the base each round."""
    workers: int = 4
    """K: independent single-node worker jobs per round."""
    rounds: int = 8
    """T: rounds (outer steps). `lofi` has exactly one."""
    seed: int = 0
    """Seed for the initial model, data splits and every worker's batches."""
    run_dir: str | None = None
    """Run directory (any fsspec URL: a path on shared storage, s3://...). Default:
    ./runs/<algorithm>-<timestamp>."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The built-in model."""
    data: DataConfig = field(default_factory=DataConfig)
    """The corpus and how it is split."""
    inner: InnerConfig = field(default_factory=InnerConfig)
    """Each worker's inner optimisation."""
    outer: OuterConfig = field(default_factory=OuterConfig)
    """The merge: outer optimizer and weighting."""
    lte: LteConfig = field(default_factory=LteConfig)
    """LoRA-the-Explorer (`--algorithm lte`): per-worker LoRA heads merged into the base each round."""
    round: RoundConfig = field(default_factory=RoundConfig)
    """Quorum, deadline, stragglers and retries."""
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    """Where worker jobs run."""

    @property
    def quorum(self) -> int:
        return self.round.min_workers or self.workers

    @property
    def worker_batch_size(self) -> int:
        if self.algorithm == "lofi":
            return self.inner.batch_size // self.workers
        return self.inner.batch_size

    @property
    def total_inner_steps(self) -> int:
        return self.rounds * self.inner.steps


# Presets name a combination of other keys. They fill only keys the user did not set, so an
# explicit `outer.lr` wins, and applying them to an already resolved config changes nothing.
PRESETS: dict[str, dict[str, Any]] = {
    "fedavg": {"outer.optimizer": "sgd", "outer.lr": 1.0, "outer.momentum": 0.0},
    "lofi": {"rounds": 1, "outer.optimizer": "sgd", "outer.lr": 1.0, "outer.momentum": 0.0},
}


def load_config(
    path: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    sets: list[str] | None = None,
) -> Config:
    """Load YAML `path` (optional), then apply `overrides` ({dotted.key: value}) and `--set` strings."""
    problems: list[str] = []
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _model_shorthand(_read_yaml(path), problems)  # before --set model.x merges into it
    flat = dict(overrides or {})
    for item in sets or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {item!r}: expected dotted.key=value, e.g. --set inner.lr=1e-3")
            continue
        flat[key.strip()] = yaml.safe_load(value) if value.strip() else None
    for key, value in flat.items():
        _set_dotted(raw, key, value)
        raw = _model_shorthand(raw, problems)  # `--set model=hf:PATH`, then `--set model.block_size=...`
    if problems:
        raise ConfigError(problems, source=path or "command line")
    cfg = config_from_dict(raw, source=path or "command line")
    # Checked here, where a user asks for a run, not in config_from_dict: `status` or `report` of
    # the run on a machine that cannot see the model directory must still read its config.
    if cfg.model.hf is not None and not os.path.isfile(os.path.join(cfg.model.hf, "config.json")):
        what = "has no config.json" if os.path.isdir(cfg.model.hf) else "does not exist"
        raise ConfigError([f"model.hf: {cfg.model.hf} {what}; give a local Hugging Face model directory (as "
                           "written by save_pretrained): islands never downloads a model"], source=path or "command line")
    return cfg


def config_from_dict(raw: Mapping[str, Any], source: str = "configuration") -> Config:
    problems: list[str] = []
    raw = _apply_preset(_model_shorthand(dict(raw), problems))
    cfg = _build(Config, raw, "", problems)
    if cfg is not None:
        problems.extend(_check(cfg))
    if problems:
        raise ConfigError(problems, source=source)
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, dict):
            value = dict(value)
        elif isinstance(value, list):
            value = list(value)
        out[f.name] = value
    return out


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def replace(cfg: Config, **dotted: Any) -> Config:
    """A copy of `cfg` with dotted keys changed, validated like a fresh load."""
    raw = to_dict(cfg)
    for key, value in dotted.items():
        _set_dotted(raw, key.replace("__", "."), value)
    return config_from_dict(raw)


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError([f"config file {path} does not exist"], source=path) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML: {exc}"], source=path) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"the top level must be a mapping of keys, got {type(data).__name__}"], source=path)
    return data


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _model_shorthand(raw: dict[str, Any], problems: list[str]) -> dict[str, Any]:
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


def _apply_preset(raw: dict[str, Any]) -> dict[str, Any]:
    algorithm = raw.get("algorithm", "diloco")
    preset = PRESETS.get(algorithm, {}) if isinstance(algorithm, str) else {}  # a wrong type is reported by _build
    for key, value in preset.items():
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node.get(part), dict) else {}
        if parts[-1] not in node:
            _set_dotted(raw, key, value)
    return raw


def _build(cls: type, raw: Any, prefix: str, problems: list[str]) -> Any:
    if not isinstance(raw, Mapping):
        problems.append(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {raw!r}")
        return None
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            problems.append(f"unknown key {prefix + str(key)!r}; valid keys here: {', '.join(names)}")
    kwargs = {}
    for name in names:
        if name in raw:
            before = len(problems)
            value = _coerce(hints[name], raw[name], f"{prefix}{name}", problems)
            # A field with a wrong type keeps its default, so range checks still run on the rest.
            if len(problems) == before or (dataclasses.is_dataclass(hints[name]) and value is not None):
                kwargs[name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        problems.append(f"{prefix.rstrip('.') or 'config'}: {exc}")
        return None


def _coerce(tp: Any, value: Any, where: str, problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, f"{where}.", problems)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, where, problems)
    if origin is Literal:
        if value not in args:
            problems.append(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            problems.append(f"{where}: expected a list of {len(args)} values, got {value!r}")
            return value
        return tuple(_coerce(a, v, f"{where}[{i}]", problems) for i, (a, v) in enumerate(zip(args, value)))
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{where}: expected a list, got {value!r}")
            return []
        return [_coerce(args[0], v, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{where}: expected a mapping, got {value!r}")
            return {}
        return {str(k): "" if v is None else str(v) for k, v in value.items()}
    return _scalar(tp, value, where, problems)


def _scalar(tp: Any, value: Any, where: str, problems: list[str]) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{where}: expected a number, got {value!r}")
            return value
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{where}: expected a string, got {value!r}")
        return value
    return value


def _check(cfg: Config) -> list[str]:
    """Range and cross-field checks, all of them, on a well-typed config."""
    p: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            p.append(msg)

    need(cfg.workers >= 1, f"workers must be >= 1, got {cfg.workers}")
    need(cfg.rounds >= 1, f"rounds must be >= 1, got {cfg.rounds}")
    need(cfg.algorithm != "lofi" or cfg.rounds == 1,
         f"lofi averages once at the end, so rounds must be 1 (got {cfg.rounds}); use --algorithm diloco for several rounds")
    need(0 <= cfg.round.min_workers <= cfg.workers,
         f"round.min_workers must be between 0 (all) and workers={cfg.workers}, got {cfg.round.min_workers}")
    need(cfg.round.deadline_s >= 0, f"round.deadline_s must be >= 0, got {cfg.round.deadline_s}")
    need(cfg.round.max_retries >= 0, f"round.max_retries must be >= 0, got {cfg.round.max_retries}")
    need(cfg.round.poll_s > 0, f"round.poll_s must be > 0, got {cfg.round.poll_s}")
    need(0 < cfg.round.staleness_decay <= 1, f"round.staleness_decay must be in (0, 1], got {cfg.round.staleness_decay}")
    need(cfg.round.max_staleness >= 1, f"round.max_staleness must be >= 1, got {cfg.round.max_staleness}")
    rc = cfg.round
    need(0 < rc.prune_keep <= 1, f"round.prune_keep must be in (0, 1], got {rc.prune_keep}")
    need(rc.contribution == "delta" or (rc.codec == "fp32" and rc.prune_keep == 1),
         f"round.codec={rc.codec} and round.prune_keep={rc.prune_keep} code the outer gradient: they need "
         "round.contribution=delta (weights are always sent in full)")
    need(rc.contribution == "weights" or cfg.algorithm != "lte",
         "round.contribution=delta does not apply to lte, whose workers send LoRA heads: drop it")
    need(rc.contribution == "weights" or rc.late_policy != "fold",
         "round.contribution=delta with round.late_policy=fold is not supported yet: use late_policy continue or drop")
    m = cfg.model
    need(min(m.n_layer, m.n_head, m.n_embd, m.block_size) >= 1, "model sizes (n_layer, n_head, n_embd, block_size) must be >= 1")
    need(m.n_head >= 1 and m.n_embd % max(m.n_head, 1) == 0,
         f"model.n_embd ({m.n_embd}) must be divisible by model.n_head ({m.n_head})")
    need(0 <= m.dropout < 1, f"model.dropout must be in [0, 1), got {m.dropout}")
    if m.hf is not None:
        p.extend(_check_hf(m))
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
    d = cfg.data
    need(0 < d.heldout_fraction < 1, f"data.heldout_fraction must be in (0, 1), got {d.heldout_fraction}")
    need(d.eval_batches >= 1, f"data.eval_batches must be >= 1, got {d.eval_batches}")
    e = cfg.executor
    need(e.timeout_min >= 1, f"executor.timeout_min must be >= 1, got {e.timeout_min}")
    need(e.cpus_per_task >= 1, f"executor.cpus_per_task must be >= 1, got {e.cpus_per_task}")
    need(e.mem_gb > 0, f"executor.mem_gb must be > 0, got {e.mem_gb}")
    need(e.service_timeout_min >= 1, f"executor.service_timeout_min must be >= 1, got {e.service_timeout_min}")
    need(e.gpus_per_node >= 0, f"executor.gpus_per_node must be >= 0, got {e.gpus_per_node}")
    return p


def _check_hf(m: ModelConfig) -> list[str]:
    """A Hugging Face model: a local directory with its config.json, and no built-in-model keys."""
    p = []
    default = ModelConfig()
    builtin = [k for k in ("n_layer", "n_head", "n_embd", "dropout") if getattr(m, k) != getattr(default, k)]
    if builtin:
        p.append(f"model.{', model.'.join(builtin)} describe the built-in model, but model.hf brings its own "
                 "architecture: remove them")
    return p
