"""LoRA-the-Explorer on a worker: its own LoRA head on every nn.Linear, over a frozen base.

Huh et al., *Training Neural Networks from Scratch with Parallel Low-Rank Adapters* (Algorithm 1,
Section 3.3, Appendix A). Each linear layer `y = W x + b` becomes

    y = W x + b + s * B (A x),      A: r x in,  B: out x r,  s = alpha / r

with W frozen (optionally held in bf16: the merge keeps the float32 copy). B starts at zero, so a
fresh head changes nothing; A is drawn per worker from (seed, worker). The worker trains its heads
and the small non-LoRA parameters (norms, embeddings, biases) and publishes exactly those; the merge
(merge/lte.py) folds `W <- W + (s / N) sum_n B_n A_n` into the global base and averages the rest.
Between rounds the worker keeps A and its AdamW state (in its state file, next to the optimizer
state) and sets B back to zero (lte.reset_b / reset_a / reset_opt switch these, as ablations).

Generic over nn.Linear: any model whose layers are plain `nn.Linear` (the built-in GPT, Hugging Face
models) gets heads. Left alone, and trained in full like an embedding: subclasses of nn.Linear
(their forward may be bypassed, e.g. MultiheadAttention's out_proj), layers whose weight is tied
to another module (a tied lm_head is the embedding), and layers no wider than the rank.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.nn import functional as F

from core.config import Config, LteConfig
from core.errors import CheckpointError
from worker.weights import tied_aliases

LORA_A, LORA_B = "lora_A", "lora_B"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def head_seed(seed: int, worker: int, *extra: int) -> int:
    """A seed of its own for every worker's heads (and, with reset_a, for every redraw of A)."""
    return int.from_bytes(hashlib.sha256(repr(("lte", seed, worker, *extra)).encode()).digest()[:8], "little") & (2**63 - 1)


class LoRALinear(nn.Linear):
    """An nn.Linear plus one LoRA head. `weight` and `bias` keep their names (and Parameter objects),
    so the base checkpoint loads unchanged; the head adds `lora_A` and `lora_B`."""

    def __init__(self, linear: nn.Linear, rank: int, scale: float, base_dtype: torch.dtype = torch.float32) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.rank, self.scale = rank, scale
        self.weight = linear.weight
        self.weight.requires_grad_(False)
        self.weight.data = self.weight.data.to(base_dtype)
        self.bias = linear.bias
        device = linear.weight.device
        self.lora_A = nn.Parameter(torch.zeros(rank, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            w = w.to(x.dtype)  # a bf16 base in a float32 forward
        return F.linear(x, w, self.bias) + self.scale * F.linear(F.linear(x, self.lora_A), self.lora_B)

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        """s * B A: what merging this head alone would add to W."""
        return self.scale * (self.lora_B.float() @ self.lora_A.float())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scale={self.scale:g}"


def init_a(a: torch.Tensor, scheme: str, generator: torch.Generator) -> None:
    """Draw A (r x in) in place. `bernstein`: semi-orthogonal rows scaled by sqrt(d_out / d_in) =
    sqrt(r / in) (Bernstein et al. 2023, as the LTE paper prescribes; the official code scales by
    the inverse); `kaiming`: LoRA's kaiming_uniform(a=sqrt(5)); `xavier`: xavier_uniform."""
    cpu = torch.empty(a.shape, dtype=torch.float32)
    if scheme == "bernstein":
        nn.init.orthogonal_(cpu, generator=generator)
        cpu.mul_(math.sqrt(a.shape[0] / a.shape[1]))
    elif scheme == "kaiming":
        nn.init.kaiming_uniform_(cpu, a=math.sqrt(5), generator=generator)
    elif scheme == "xavier":
        nn.init.xavier_uniform_(cpu, generator=generator)
    else:
        raise ValueError(f"unknown lte.a_init {scheme!r}; valid: bernstein, kaiming, xavier")
    with torch.no_grad():
        a.copy_(cpu)


def head_layers(model: nn.Module, rank: int) -> list[tuple[str, nn.Linear]]:
    """The layers that get a head, in name order: plain nn.Linear (or already headed), untied,
    wider than the rank."""
    owners: dict[int, int] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    out = []
    for name, mod in model.named_modules():
        if type(mod) is LoRALinear or (type(mod) is nn.Linear and owners.get(id(mod.weight), 0) == 1
                                       and min(mod.in_features, mod.out_features) > rank):
            out.append((name, mod))
    return sorted(out, key=lambda kv: kv[0])


def attach_heads(model: nn.Module, cfg: LteConfig, seed: int) -> list[str]:
    """Give every eligible nn.Linear of `model` a LoRA head (A drawn from `seed`, B zero), freeze
    their weights; returns the headed layers' names."""
    g = torch.Generator().manual_seed(seed)
    names = []
    for name, mod in head_layers(model, cfg.rank):
        if isinstance(mod, LoRALinear):
            raise ValueError(f"{name} already has a LoRA head")
        head = LoRALinear(mod, cfg.rank, cfg.alpha / cfg.rank, DTYPES[cfg.base_dtype])
        init_a(head.lora_A, cfg.a_init, g)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, head)
        names.append(name)
    if not names:
        raise ValueError(f"the model has no nn.Linear layer wider than lte.rank={cfg.rank} to put a head on")
    return names


def heads(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for name, mod in model.named_modules():
        if isinstance(mod, LoRALinear):
            yield name, mod


def is_head_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in (LORA_A, LORA_B)


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """What an LTE worker trains, by name: the heads and every parameter that is not a headed
    layer's (frozen) weight."""
    return sorted((n, p) for n, p in model.named_parameters() if p.requires_grad)


def make_optimizer(model: nn.Module, cfg: Config) -> tuple[torch.optim.AdamW, list[str]]:
    """AdamW over the trainable parameters only: the heads at lte.lr (with weight decay like any
    matrix), the rest at inner.lr (decay on matrices that are not embeddings). Each group carries
    `lr_scale`, its peak over inner.lr, so one schedule drives them all. Returns it with the
    parameter names in state order."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    params = trainable(model)
    head = [(n, p) for n, p in params if is_head_param(n)]
    decay = [(n, p) for n, p in params if not is_head_param(n) and p.dim() >= 2 and id(p) not in embeddings]
    rest = [(n, p) for n, p in params if not is_head_param(n) and (n, p) not in decay]
    i = cfg.inner
    groups = [(head, i.weight_decay, cfg.lte.lr / i.lr), (decay, i.weight_decay, 1.0), (rest, 0.0, 1.0)]
    groups = [g for g in groups if g[0]]
    opt = torch.optim.AdamW([{"params": [p for _, p in ps], "weight_decay": wd, "lr": i.lr * scale, "lr_scale": scale}
                             for ps, wd, scale in groups], lr=i.lr, betas=(i.beta1, i.beta2))
    return opt, [n for ps, _, _ in groups for n, _ in ps]


def _cpu32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float32, copy=True)


def head_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every head's A and B (float32, CPU), keyed `<layer>.lora_A` / `<layer>.lora_B`."""
    return {n: _cpu32(p) for n, p in model.named_parameters() if is_head_param(n)}


def contribution_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a worker publishes each round: its heads and the small non-LoRA parameters (float32)."""
    return {n: _cpu32(p) for n, p in trainable(model)}


def contribution_shapes(cfg: Config, rank: int) -> dict[str, tuple[int, ...]]:
    """Names and shapes of an LTE contribution for the run's model (its task's model built on the meta
    device: no memory, no weights read); what the merge checks contributions against."""
    from worker.tasks import task_for
    with torch.device("meta"):
        model = task_for(cfg).build_model(pretrained=False)
    headed = {f"{n}.weight" for n, _ in head_layers(model, rank)}
    out: dict[str, tuple[int, ...]] = {}
    for n, p in model.named_parameters():
        if n in headed:
            layer = n[: -len(".weight")]
            out[f"{layer}.{LORA_A}"] = (rank, p.shape[1])
            out[f"{layer}.{LORA_B}"] = (p.shape[0], rank)
        else:
            out[n] = tuple(p.shape)
    return out


def load_base(model: nn.Module, tensors: dict[str, torch.Tensor], label: str) -> None:
    """Copy a full-model checkpoint (the global weights) into a headed model: every tensor but the
    heads, each cast to the model's own dtype (bf16 for a bf16 base). A tied alias (an lm_head that
    is the embedding) is loaded through its first name, as worker.weights stores it."""
    aliases = tied_aliases(model)
    own = {k: v for k, v in model.state_dict().items() if not is_head_param(k) and k not in aliases}
    _copy(own, {k: v for k, v in tensors.items() if k not in aliases}, label, exact=True)


def load_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], label: str) -> None:
    """Copy some of the model's tensors back (heads from a state file, trainables from an in-flight
    checkpoint); names and shapes must match."""
    _copy(model.state_dict(), tensors, label, exact=False)


def _copy(own: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], label: str, exact: bool) -> None:
    problems = [f"missing tensor {k}" for k in own if exact and k not in tensors]
    problems += [f"unexpected tensor {k}" for k in tensors if k not in own]
    problems += [f"tensor {k} has shape {list(t.shape)}, the model wants {list(own[k].shape)}"
                 for k, t in tensors.items() if k in own and t.shape != own[k].shape]
    if problems:
        raise CheckpointError(f"{label} does not fit the model with its LoRA heads: " + "; ".join(problems[:8])
                              + ("" if len(problems) <= 8 else f"; and {len(problems) - 8} more")
                              + ". Check model.* and lte.rank in the config against the checkpoint.")
    with torch.no_grad():
        for k, t in tensors.items():
            own[k].copy_(t.to(own[k].dtype))


@torch.no_grad()
def reset_heads(model: nn.Module, cfg: LteConfig, seed: int) -> None:
    """After a merge: B <- 0 (reset_b), and A redrawn from `seed` if reset_a."""
    g = torch.Generator().manual_seed(seed)
    for _, h in sorted(heads(model), key=lambda kv: kv[0]):
        if cfg.reset_b:
            h.lora_B.zero_()
        if cfg.reset_a:
            init_a(h.lora_A, cfg.a_init, g)


def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state_dict with this worker's heads folded in (W + s B A), float32: to
    evaluate or export one worker's model on its own."""
    aliases = tied_aliases(model)
    out = {k: _cpu32(v) for k, v in model.state_dict().items() if not is_head_param(k) and k not in aliases}
    for name, h in heads(model):
        out[f"{name}.weight"] += h.delta().cpu()
    return out


def sizes(model: nn.Module, optimizer_slots: int = 2) -> dict[str, int]:
    """Per-worker figures: all parameters, trainable parameters, published bytes (float32) and
    optimizer memory (AdamW: `optimizer_slots` float32 slots per trainable parameter)."""
    total = sum(p.numel() for p in model.parameters())
    train = sum(p.numel() for _, p in trainable(model))
    return {"params": total, "trainable": train, "head_params": sum(p.numel() for n, p in trainable(model) if is_head_param(n)),
            "contribution_bytes": 4 * train, "optimizer_bytes": 4 * optimizer_slots * train}
