"""The run configuration: frozen dataclasses, one YAML file, `--set dotted.key=value` overrides.

Every field has a docstring (docs/config.md is generated from them). Loading collects every
problem (unknown keys with the valid ones named, wrong types, out-of-range values) and raises one
ConfigError (the parsing and checks live in core/config_parse.py). The resolved config is written
into the run directory, and a resumed run reads it back.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import yaml

from core.coerce import build
from core.config_parse import (PRESET_KEYS, apply_executor_preset, apply_preset, check, load_yaml, model_shorthand,
                               read_yaml, set_dotted)
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
    """What to train on: a prepared dataset (a folder with index.json at any fsspec URL, made by
    `orchestrate data prepare`; docs/data.md); or a text file or folder of text files on this machine,
    prepared once into cache_dir; or null, the Python standard library's own source (always present)."""
    include_tests: bool = False
    """With the built-in corpus: also include the stdlib's test/ folders."""
    sharding: Literal["iid", "non-iid"] = "iid"
    """How the train split is shared by the workers: `iid` deals segments of it at random; `non-iid`
    gives each worker whole groups (a text folder's top-level folders, email/, asyncio/, ...; or
    the values of a prepared dataset's --group-field), a natural non-i.i.d. split."""
    heldout_fraction: float = 0.05
    """Text sources: the fraction of files held out for the global model's eval loss (a prepared
    dataset has its own held-out split: its --heldout)."""
    eval_batches: int = 8
    """Held-out batches (of inner.batch_size sequences) per evaluation."""
    cache_dir: str | None = None
    """Where text sources are prepared (default $ISLANDS_CACHE or ~/.cache/islands)."""


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
    parallel: Literal["auto", "ddp", "fsdp"] = "auto"
    """How the ranks of a worker job (executor.tasks_per_node > 1) share the model: `ddp`, each
    holds all of it and its AdamW state; `fsdp` (FSDP2), weights, gradients and AdamW state are
    sharded across them, for a model that does not fit one device (preempted, its ranks save the
    in-flight checkpoint together after the step); `auto`, fsdp when those (16 bytes a parameter)
    would take more than half of one GPU, else ddp (always ddp on CPUs). Each rank takes its slice
    of the batch."""


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
    warmup_rounds: int = 0
    """Rounds over which the outer learning rate rises linearly to outer.lr (round r merges with
    lr x (r + 1) / warmup_rounds); 0: outer.lr from the first round."""
    weighting: Literal["tokens", "uniform"] = "tokens"
    """Average workers weighted by the tokens each trained on, or uniformly. The service derives
    the tokens itself: the steps a contribution's manifest reports (a whole number in [1,
    inner.steps]) x the worker's batch x model.block_size; a manifest whose own `tokens` figure
    differs is refused as not written by its worker."""


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
    and it restarts from the new global weights (not with `lte`)."""
    staleness_decay: float = 0.5
    """`fold` only: a contribution k rounds late is averaged in with its weight x decay ** k."""
    max_staleness: int = 4
    """`fold` only: contributions more rounds late than this are dropped, not folded."""
    max_retries: int = 2
    """How often a worker whose job ended without a contribution is resubmitted in one round."""
    worker_mode: Literal["per_round", "persistent"] = "persistent"
    """`persistent` (the default): a worker job stays alive across rounds, waiting on storage for
    the next global checkpoint, until its time limit, when it checkpoints and is requeued: the queue
    is paid once per job lifetime. It also keeps its model and AdamW state in memory between
    rounds, so a round reads only its base weights; the state file is written after the
    contribution, in the background. `per_round`: a new job per worker per round, which pays the
    queue wait, a Python start, the torch import and the model and state loads every round (the
    README run takes twice as long: docs/benchmarks.md); it gives a node back between rounds."""
    poll_s: float = 0.5
    """Seconds between polls of the run directory and the scheduler."""
    contribution: Literal["weights", "delta"] = "weights"
    """What a worker publishes: its `weights`, or its outer gradient `delta` = base - weights,
    coded as round.codec (core/codec.py); the merge decodes either. Not with `lte` (which sends
    LoRA heads) nor late_policy `fold`."""
    codec: Literal["fp32", "bf16", "int8", "topk"] = "fp32"
    """`delta` only: how the delta's values are stored: `fp32` (exact), `bf16` (half the bytes),
    `int8` with one fp32 scale per row (a quarter; error <= half a step of the row's max / 127), or
    `topk`: of each chunk of 4096 entries the round.topk largest, in round.bits bits each with its
    offset in about 6 bits, plus one fp32 scale per chunk (1/63 of fp32 at the defaults), what is left out
    carried to the next round by error feedback (round.error_feedback; SparseLoCo, docs/algorithms.md);
    with topk use outer.optimizer sgd and outer.lr 3: the feedback is the momentum."""
    prune_keep: float = 1.0
    """`delta` only: fraction of each row's entries kept, the largest by magnitude (the DiLoCo
    paper's Table 6 prunes outer gradients); the rest are sent as zero. Below 1 the delta is stored
    as topk's are (core/topk.py), each row a chunk: the kept values (fp32 and bf16 as they are, int8
    as 8-bit codes of the row's largest kept magnitude), their offsets in at most a bit a column,
    and 4 bytes a row."""
    topk: float = 0.0625
    """codec `topk` only: fraction of each chunk of 4096 entries kept, the largest by magnitude
    (1/16: 256 a chunk; 1/64 halves the bytes and costs more loss, docs/benchmarks.md)."""
    bits: int = 2
    """codec `topk` only: bits per kept value: 2, 4 or 8 (uniform levels between -s and s, s the
    chunk's largest kept magnitude)."""
    error_feedback: float = 0.9
    """codec `topk` only: decay of the error-feedback buffer, in [0, 1]: a worker codes decay x
    buffer + its delta and keeps what that left out as the buffer, which lives with its AdamW state
    (state file, in-flight checkpoint, memory of a persistent worker). 0 = no feedback: what is not
    sent is lost. 0.9 rather than SparseLoCo's 0.95: a little lower loss at 1/16 (docs/benchmarks.md)."""
    dense_rounds: int = 0
    """codec `topk` only: the first this many rounds send their delta dense (fp32, nothing left to
    the error-feedback buffer): a run's first rounds move the weights most."""
    state_every: int = 20
    """A persistent worker writes its AdamW state (and error-feedback buffer) to storage every this
    many rounds, and when its job is preempted, reaches its time limit or ends before the run does;
    in between it lives in memory only. A job restarted after a hard loss (kill -9, a lost node)
    takes the newest snapshot, up to this many rounds old (its contribution's manifest says which:
    `state_from_round`). 1: every round. Per-round jobs (worker_mode per_round) and LTE workers
    write it every round: it is their only copy. 20: the smallest round number that brings a
    worker-round's bytes through storage under 2.2 W dense and 1.2 W with top-k (W: the fp32
    weights; the state is 2W, 3W with error feedback), measured in docs/benchmarks.md."""
    keep_last: int = 1
    """Tensors kept of the last this many committed rounds (global weights, outer state,
    contributions, folds); older ones are deleted after each commit, so a run's footprint is flat in
    rounds. Records, jobs files and manifests are all kept. 0: keep everything."""
    keep_every: int = 0
    """Also keep the global weights of every this many rounds (round 0 included); 0: only the last
    ones and the final model."""
    replica: Literal["auto", "always", "never"] = "auto"
    """A persistent worker with `delta` contributions makes the next global weights itself, from
    the round's record and the contributions it merged (the merge's outer step, summed in the same
    order), whenever those are fewer bytes than the global weights (codec topk: about K/63 of
    them), and uses them only if they hash to the published global's digest; otherwise it reads
    the global weights, saying why (worker/replica.py). With an outer optimizer that has state
    (Nesterov's momentum) the worker holds that state too: one more fp32 copy of the weights in
    host memory. `auto`: only while its last replay took no longer than its last read (both
    measured by the worker: a fast filesystem reads, a slow one replays); `always`: whenever it
    can (the fewest bytes from storage); `never`: always read them."""
    max_update: float = 0.0
    """The largest magnitude any entry of a worker's outer gradient (base - its weights, error
    feedback included) may have; a contribution or error-feedback buffer past it is refused as
    forged or damaged (docs/reliability.md). 0 = derived from what a round of AdamW can move an
    entry: 10 x inner.lr x inner.steps x AdamW's bound on |m|/sqrt(v) for inner.beta1/beta2 (x
    1 + round.overlap_ahead when overlapping, x the feedback's accumulation with error feedback)."""
    aggregate: Literal["mean", "median", "trimmed_mean"] = "mean"
    """How a round combines its contributions before the outer step: `mean`, weighted by each
    contribution's weight (DiLoCo, FedAvg); `median`, element-wise (Flower's FedMedian); or
    `trimmed_mean`, per element the mean of what is left once `round.trim` of the contributions
    are dropped at each end (Flower's FedTrimmedAvg). The last two are unweighted, so that one
    valid-looking but wrong contribution cannot drag a round; they read every contribution again
    at the merge (K x the largest tensor in memory) instead of using the running sum alone. Not
    with `lte` nor late_policy `fold` (which weighs late contributions down)."""
    trim: float = 0.2
    """`trimmed_mean` only: int(trim x K) contributions dropped at each end, per element (Flower's
    beta); in [0, 0.5)."""
    budget: Literal["steps", "seconds"] = "steps"
    """What a worker's round is: `steps`, inner.steps steps (DiLoCo's H); or `seconds`,
    round.budget_seconds of training (at most inner.steps steps), so that every worker of a round
    trains for the same wall time whatever its speed: a slow node, a noisy neighbour or an older
    GPU is never waited for. Contributions are weighted by the tokens they trained on
    (outer.weighting: tokens), so the outer gradient is the token-weighted mean of the workers'
    unequal steps (docs/algorithms.md)."""
    budget_seconds: float = 0.0
    """`budget: seconds` only: seconds of training per worker per round, from its first step (the
    base's load and the contribution's write come on top); a worker stops at the first step
    boundary past it, after at least one step. The learning-rate schedule and the data position
    still advance inner.steps per round: set inner.steps a little above what the fastest worker
    takes in the budget. With round.overlap the budget runs from the step at which the worker adopts
    the round's global; what it trained ahead before (at most a budget's worth) comes on top, so
    every worker publishes S after the global and none drifts a round ahead."""
    overlap: Literal["off", "rebase", "mix"] = "off"
    """Persistent workers: `off`, a worker idles from publishing its contribution until the next
    global exists (the barrier); `rebase`, it goes straight on with the next round's steps from its
    own weights and, when the next global appears, adopts it at a step boundary keeping the steps
    taken since publishing (theta <- global + theta - published: each step counted in exactly one
    contribution); `mix`, it blends instead, theta <- (1 - overlap_mix) global + overlap_mix theta
    (Streaming DiLoCo). A worker is never more than one round ahead: one that finishes the next
    round's steps first waits. Not with per-round jobs, lte, nor several ranks per worker."""
    overlap_mix: float = 0.5
    """`overlap: mix` only: the weight of the worker's own weights in the blend, in [0, 1]."""
    overlap_ahead: float = 1.0
    """`overlap` only: the most a worker trains before its round's global exists, as a fraction of a
    round (of inner.steps, or with budget seconds of budget_seconds), after which it waits: 1, up to
    a whole round; less bounds how stale the start of a contribution may be (Streaming DiLoCo's
    tau / H) at the cost of idle time. In (0, 1]."""
    stream_merge: bool = True
    """Fold each contribution into an fp32 running sum as it arrives, so the merge after the last
    worker lands reads one contribution instead of K. The service also holds the round's global
    weights and outer state in memory from the round's start, so the step reads nothing from
    storage: about 3 fp32 copies of the model in all (sum, global, state); the step runs in place
    in the held copies. The sum is in arrival order (recorded as the round record's `merge_order`;
    a resumed service rebuilds it from the contributions), so with 3+ workers two runs may differ in
    the last bit; `false` merges in worker order at the end (bitwise reproducible from run to run).
    Linear merges only: not `lte`."""
    replay: str = ""
    """Set by `orchestrate submit --replay RUN`, not by hand: the run this one replays. Its workers
    train, and adopt their bases (round.overlap), at the steps recorded in the source run, and its
    merges sum in the recorded order (`replay.json`, core/replay.py), so every global it publishes
    equals the source's bit for bit."""


@dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    kind: Literal["auto", "local", "slurm", "inline"] = "auto"
    """`local` runs workers as local processes (submitit LocalExecutor); `slurm` submits them with
    sbatch; `auto` takes Slurm when `sbatch` is on PATH and its controller answers (`scontrol
    ping`), bringing a default request it refuses down to the partition's nodes, and never runs
    workers here while Slurm answers; else local. `inline` runs each worker as a thread of the
    orchestrating process, one rank each, for debugging (a breakpoint or profiler sees every
    worker) and tests: nothing survives that process. A run records the kind it got."""
    timeout_min: int = 60
    """Time limit of each worker job, in minutes."""
    cpus_per_task: int = 2
    """CPUs per worker job."""
    mem_gb: float = 4.0
    """Memory per worker job, in GB."""
    gpus_per_node: int = 0
    """GPUs per worker job. On the local executor a job sees only these (0: none, so
    inner.device=auto trains on the CPU): worker w takes the w-th group of the machine's GPUs, more
    workers than groups sharing them round robin."""
    tasks_per_node: int = 0
    """Processes (ranks) per worker job, one per GPU, training one model with DistributedDataParallel
    (each takes its slice of the worker's batch). 0 = gpus_per_node, or 1 without GPUs.
    cpus_per_task is for the whole job, shared by its ranks."""
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
    """A preset from slurm_templates/ whose values fill the fields not written here (a field
    written keeps its value, even one equal to the default)."""
    service_timeout_min: int = 4320
    """Time limit of the merge service's own CPU-only Slurm job (`orchestrate submit --detach` on
    Slurm); at the limit it is requeued and resumes from storage."""


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    wandb: str | None = None
    """A Weights & Biases project: the merge service sends the numbers the report plots (the eval
    loss, each worker's training loss per inner step, each round's costs) to one W&B run per
    islands run, through the official client (`pip install 'islands[wandb]'`)."""
    wandb_mode: Literal["online", "offline"] | None = None
    """`offline` keeps the W&B run on disk (under the run directory's `wandb/` when it is local) for
    `wandb sync`; `online` sends it as it goes (after `wandb login`). Default: the client's own,
    WANDB_MODE or online."""
    mlflow: str | None = None
    """An MLflow tracking URI: a server (`http://host:5000`) or a local store (`sqlite:///PATH/mlflow.db`);
    the same numbers as log.wandb go to one MLflow run per islands run (`pip install 'islands[mlflow]'`)."""
    mlflow_experiment: str = "islands"
    """The MLflow experiment the run is filed under (made if missing)."""


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
    task: str = "lm"
    """What is trained and how it is scored (docs/tasks.md): `lm`, a causal language model (the
    built-in GPT, or model.hf's) on data.source; `digits`, the shipped image-classification example
    (a small Hugging Face ViT on scikit-learn's bundled digits); or your own, `package.module:Class`."""
    task_path: str | None = None
    """A directory put first on the import path of `submit` and of every job before `task` is
    imported: a task module outside any installed package (it must be readable by the jobs)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The built-in model (task lm)."""
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
    log: LogConfig = field(default_factory=LogConfig)
    """Where the run's metrics go besides its own metrics/ files, report and TensorBoard: W&B, MLflow."""

    @property
    def quorum(self) -> int:
        return self.round.min_workers or self.workers

    @property
    def worker_batch_size(self) -> int:
        if self.algorithm == "lofi":
            return self.inner.batch_size // self.workers
        return self.inner.batch_size

    @property
    def tokens_per_example(self) -> int:
        """What one example of a batch counts in a manifest's `tokens` (outer.weighting tokens): a
        window of block_size tokens for task lm; one example for any other task."""
        return self.model.block_size if self.task == "lm" else 1

    @property
    def total_inner_steps(self) -> int:
        return self.rounds * self.inner.steps

    @property
    def loss_per(self) -> str | None:
        """What task lm's loss (mean cross-entropy, nats) is per: `byte` for the built-in byte-level
        model, `token` for model.hf's tokenizer; None for another task, whose loss is its own."""
        if self.task != "lm":
            return None
        return "token" if self.model.hf else "byte"

    @property
    def loss_label(self) -> str:
        """The run's loss with its unit, for a column or an axis: `loss (nats/byte)`, `loss (nats/token)`,
        or a task's `loss`."""
        return "loss" if self.loss_per is None else f"loss (nats/{self.loss_per})"


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
        raw = model_shorthand(read_yaml(path), problems)  # before --set model.x merges into it
    flat = dict(overrides or {})
    for item in sets or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {item!r}: expected dotted.key=value, e.g. --set inner.lr=1e-3")
            continue
        try:
            flat[key.strip()] = load_yaml(value, f"--set {key.strip()}") if value.strip() else None
        except ConfigError as exc:
            problems += exc.problems
            continue
    for key, value in flat.items():
        set_dotted(raw, key, value)
        raw = model_shorthand(raw, problems)  # `--set model=hf:PATH`, then `--set model.block_size=...`
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
    raw = apply_executor_preset(apply_preset(model_shorthand(dict(raw), problems), PRESETS), problems)
    cfg = build(Config, raw, "", problems)
    if cfg is not None:
        problems.extend(check(cfg))
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
    """A copy of `cfg` with dotted keys changed, validated like a fresh load. A new executor.preset
    fills every executor key of its kind that `dotted` does not set (the old preset's go)."""
    raw = to_dict(cfg)
    dotted = {key.replace("__", "."): value for key, value in dotted.items()}
    if "executor.preset" in dotted:
        given = {key.removeprefix("executor.") for key in dotted if key.startswith("executor.")}
        raw["executor"] = {k: v for k, v in raw["executor"].items() if k not in PRESET_KEYS or k in given}
    for key, value in dotted.items():
        set_dotted(raw, key, value)
    return config_from_dict(raw)
