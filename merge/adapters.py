"""PEFT LoRA adapters as merge inputs: several merged into one adapter, or folded into their base.

An adapter directory is what PEFT's `save_pretrained` writes: `adapter_config.json` and
`adapter_model.safetensors`. Each adapted module m has A [r, in] and B [out, r] (an embedding:
`lora_embedding_A` [r, vocab], `lora_embedding_B` [dim, r]) and a scaling s = alpha / r
(alpha / sqrt(r) with rslora; `rank_pattern` and `alpha_pattern` per module, matched as PEFT
does). Its update of the base weight `m.weight` is delta = s * B @ A, transposed for GPT-2's Conv1D
layers (`fan_in_fan_out`) and for embeddings.

**Merging several adapters concatenates their ranks** (PEFT's `add_weighted_adapter` with
`combination_type="cat"`, the same tensors): A = [c_1 s_1 A_1; ...; c_K s_K A_K], B = [B_1 ... B_K],
rank and alpha both sum_i r_i (scaling 1), so the merged adapter's update is exactly
sum_i c_i delta_i. Averaging the A's and the B's separately (PEFT's "linear") would give
(sum c_i B_i)(sum c_i A_i), cross terms included; an SVD would truncate. The c_i are the weights
normalised (`average`) or `scale * w_i` (`task-arithmetic`). A module some adapters lack gets
zeros in their place, as in PEFT.

**Folding** writes base + sum_i c_i delta_i (each delta in float32) into a model directory with the
base's layout: one adapter with weight 1 is PEFT's `merge_and_unload()`.

Tensors other than A and B are whole tensors: a `modules_to_save` head (every adapter must hold
it) is merged as the weights' mean whatever the method; PEFT's copy of a base weight beside a LoRA
(`...base_layer.weight`, an embedding's) is kept as the adapters holding it have it. Either
replaces the base's tensor when folded. DoRA, LoRA biases, convolutions, trainable tokens and other PEFT types are refused with
the reason. Everything in the directory is checked before any maths, like every other input.
"""
from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from core.checkpoint import FLOATS, TensorFile
from core.errors import CheckpointError, StorageError
from core.storage import Storage
from merge.inputs import Model, finite, nonfinite, open_file_model
from merge.methods import average

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
MAX_CONFIG_BYTES = 1 << 20
MAX_RANK, MAX_ALPHA = 1 << 16, 1e6
"""Past these a rank or an alpha is damage, not an adapter: a rank of 1e15 allocated petabytes, an alpha of 1e308
made the merged adapter Inf."""
MAX_PATTERN = 512
_PARTS = {".lora_A.weight": ("a", False), ".lora_B.weight": ("b", False),
          ".lora_embedding_A": ("a", True), ".lora_embedding_B": ("b", True)}
_UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "target_parameters": "LoRA on parameters",
                "trainable_token_indices": "trainable tokens", "layer_replication": "layer replication"}


@dataclass(frozen=True)
class Lora:
    """One adapted module of one adapter."""

    module: str  # the base model's module, e.g. model.layers.0.self_attn.q_proj
    a: str  # tensor names in the adapter file
    b: str
    rank: int
    scaling: float
    transposed: bool  # delta = (B @ A).T: an embedding, or a Conv1D layer (fan_in_fan_out)
    embedding: bool


@dataclass
class Adapter:
    label: str
    config: dict[str, Any]
    model: Model
    loras: dict[str, Lora]
    full: dict[str, str]  # the base model's tensor name -> its name in the adapter file
    max_rank: int  # r, or the largest of rank_pattern: an adapter's room in a concatenation (PEFT's)

    def tensor(self, name: str) -> torch.Tensor:
        f: TensorFile = self.model.files[0]
        t = f.read(name)
        if not finite(t):
            raise CheckpointError(nonfinite(self.model.label, name))
        return t


def is_adapter(url: str) -> bool:
    """A directory with an adapter_config.json? (Anything unreadable is left to open_model to report.)"""
    try:
        st = Storage(url, follow_links=True)
        return st.kind() == "directory" and st.exists(CONFIG)
    except (OSError, StorageError, ValueError):
        return False


def open_adapter(url: str, ident: Any) -> Adapter:
    """The adapter directory at `url`, its config and tensor names checked (CheckpointError listing
    every problem)."""
    st = Storage(url, follow_links=True)
    label = url.rstrip("/")
    try:
        cfg = st.read_json(CONFIG, limit=MAX_CONFIG_BYTES)
    except (StorageError, CheckpointError) as exc:
        raise CheckpointError(f"{label}/{CONFIG}: {exc}") from None
    problems = check_config(cfg, f"{label}/{CONFIG}")
    if problems:
        raise CheckpointError("; ".join(problems))
    if not st.exists(WEIGHTS):
        raise CheckpointError(f"{label}: no {WEIGHTS} (a .bin adapter is a pickle, never read: re-save it with "
                              "PEFT's save_pretrained(safe_serialization=True))")
    model = open_file_model(st, WEIGHTS, f"{label}/{WEIGHTS}", ident, require_manifest=False)
    try:
        loras, full, problems = classify(model, cfg, label)
        if problems:
            raise CheckpointError("; ".join(problems))
    except BaseException:
        model.close()
        raise
    ranks = [cfg["r"], *(cfg.get("rank_pattern") or {}).values()]
    return Adapter(label, cfg, model, loras, full, max(ranks))


def check_config(cfg: Any, label: str) -> list[str]:
    """Every reason `cfg` (adapter_config.json, parsed) is not a LoRA adapter this merge handles."""
    if not isinstance(cfg, dict):
        return [f"{label}: not a JSON object: not a PEFT adapter config"]
    if cfg.get("peft_type") != "LORA":
        return [f"{label}: peft_type is {cfg.get('peft_type')!r}; only LoRA adapters (LORA) can be merged"]
    problems = []
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not (isinstance(r, int) and not isinstance(r, bool) and 0 < r <= MAX_RANK):
        problems.append(f"{label}: r is {r!r}, not a positive integer up to {MAX_RANK}")
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 < abs(alpha) <= MAX_ALPHA):
        problems.append(f"{label}: lora_alpha is {alpha!r}, not a nonzero number up to {MAX_ALPHA:g} in size")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            problems.append(f"{label}: {what} ({key}) cannot be merged; merge plain LoRA adapters")
    for key in ("fan_in_fan_out", "use_rslora"):
        if not isinstance(cfg.get(key, False), bool):
            problems.append(f"{label}: {key} is {cfg.get(key)!r}, not true or false")
    for key, ok in (("rank_pattern", lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_RANK),
                    ("alpha_pattern", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                     and 0 < abs(v) <= MAX_ALPHA)):
        pat = cfg.get(key) or {}
        if not isinstance(pat, dict):
            problems.append(f"{label}: {key} is not an object of module patterns")
            continue
        for k, v in pat.items():
            if not ok(v):
                problems.append(f"{label}: {key}[{k!r}] is {v!r}, not a positive " + ("integer" if key == "rank_pattern" else "number"))
            try:
                if len(k) > MAX_PATTERN:
                    raise re.error("too long")
                if "(" in k or sum(k.count(q) for q in "*+?{") > 4:  # what can make a match take exponential time
                    raise re.error("groups and more than 4 repetitions are refused: such a pattern can take for ever")
                re.compile(rf"(.*\.)?({k})$")  # as PEFT uses it
            except re.error as exc:
                problems.append(f"{label}: {key} key {k[:80]!r} is not a usable module pattern ({exc})")
    return problems


def _pattern(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's get_pattern_key: the first key matching the end of `module` at a dot."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def classify(model: Model, cfg: Mapping[str, Any], label: str) -> tuple[dict[str, Lora], dict[str, str], list[str]]:
    """(LoRA modules, whole tensors, problems) of an adapter file whose config is `cfg`."""
    parts: dict[str, dict[str, tuple[str, bool]]] = {}
    full: dict[str, str] = {}
    problems = []
    for name, spec in model.specs.items():
        if not name.startswith(PREFIX):
            problems.append(f"{label}: tensor {name} does not start with {PREFIX!r}: not a PEFT adapter file")
            continue
        if spec.dtype not in FLOATS:
            problems.append(f"{label}: tensor {name} is {spec.dtype}: an adapter's tensors are floating point")
            continue
        rest = name[len(PREFIX):]
        suffix = next((s for s in _PARTS if rest.endswith(s)), None)
        if suffix is not None:
            part, emb = _PARTS[suffix]
            parts.setdefault(rest[: -len(suffix)], {})[part] = (name, emb)
        elif ".lora_" in rest:
            problems.append(f"{label}: tensor {name} is a LoRA part this merge does not know (DoRA, LoRA bias?); "
                            "merge plain LoRA adapters")
        else:
            full[rest.replace(".base_layer.", ".")] = name
    loras = {}
    for module, p in parts.items():
        if set(p) != {"a", "b"} or p["a"][1] != p["b"][1]:
            problems.append(f"{label}: module {module} has {sorted(n for n, _ in p.values())}: needs one A and one B")
            continue
        (a, emb), (b, _) = p["a"], p["b"]
        sa, sb = model.specs[a].shape, model.specs[b].shape
        if len(sa) != 2 or len(sb) != 2 or sa[0] != sb[1]:
            problems.append(f"{label}: module {module}: A {list(sa)} and B {list(sb)} are not a LoRA pair "
                            "(A [r, in], B [out, r]; convolutions are not supported)")
            continue
        want = _pattern(cfg.get("rank_pattern") or {}, module, cfg["r"])
        if sa[0] != want:
            problems.append(f"{label}: module {module} has rank {sa[0]}, its config says {want}")
            continue
        alpha = _pattern(cfg.get("alpha_pattern") or {}, module, cfg["lora_alpha"])
        scaling = alpha / math.sqrt(want) if cfg.get("use_rslora") else alpha / want
        loras[module] = Lora(module, a, b, want, scaling, emb or bool(cfg.get("fan_in_fan_out")), emb)
    if not loras:
        problems.append(f"{label}: holds no LoRA A/B tensors")
    return loras, full, problems


def check_together(adapters: Sequence[Adapter]) -> list[str]:
    """Every reason these adapters cannot be merged into one (shapes of shared modules, whole tensors)."""
    problems = []
    kinds = {type(a.config.get("target_modules")) for a in adapters}
    if len(kinds) > 1:
        problems.append("target_modules is a list in some adapters and a pattern in others: PEFT cannot load "
                        "their merge; save them with the same kind")
    seen: dict[str, tuple[Adapter, Lora]] = {}
    for ad in adapters:
        for m, lo in ad.loras.items():
            if m in seen:
                other, olo = seen[m]
                if _io(other, olo) != _io(ad, lo) or olo.embedding != lo.embedding:
                    problems.append(f"{ad.label}: module {m} is {_io(ad, lo)}, {other.label} has {_io(other, olo)}: "
                                    "adapters of different models")
            else:
                seen[m] = (ad, lo)
    for n in dict.fromkeys(n for ad in adapters for n in ad.full):
        holders = [ad for ad in adapters if n in ad.full]
        trained = [ad for ad in holders if ".base_layer." not in ad.full[n]]
        if trained and len(holders) < len(adapters):  # the others' would be the base's, which is not here
            problems.append(f"tensor {n} is in {[h.label for h in holders]} but not in "
                            f"{[a.label for a in adapters if a not in holders]}: every adapter must hold the same "
                            "modules_to_save")
        shapes = {tuple(h.model.specs[h.full[n]].shape) for h in holders}
        if len(shapes) > 1:
            problems.append(f"tensor {n} has shapes {sorted(shapes)} in {[h.label for h in holders]}: adapters of "
                            "different models")
    return problems


def _io(ad: Adapter, lo: Lora) -> tuple[int, int]:
    return ad.model.specs[lo.b].shape[0], ad.model.specs[lo.a].shape[1]


def modules(adapters: Sequence[Adapter]) -> list[str]:
    """Every adapted module, in the order the adapters list them."""
    return list(dict.fromkeys(m for ad in adapters for m in ad.loras))


def concatenated(adapters: Sequence[Adapter], coeffs: Sequence[float], module: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of `module` in the merged adapter: PEFT's cat, zeros where an adapter lacks it."""
    rank = sum(ad.max_rank for ad in adapters)
    la = [(ad, ad.loras[module], c) for ad, c in zip(adapters, coeffs) if module in ad.loras]
    dtype = functools.reduce(torch.promote_types,
                             (ad.model.specs[n].torch_dtype for ad, lo, _ in la for n in (lo.a, lo.b)))
    out_f, in_f = _io(la[0][0], la[0][1])
    A = torch.zeros(rank, in_f, dtype=dtype)
    B = torch.zeros(out_f, rank, dtype=dtype)
    o = 0
    for ad, lo, c in la:
        A[o:o + lo.rank] = ad.tensor(lo.a).to(dtype) * c * lo.scaling
        B[:, o:o + lo.rank] = ad.tensor(lo.b)
        o += lo.rank
    return A, B


def wholes(adapters: Sequence[Adapter]) -> dict[str, str]:
    """Whole tensors of the merge: the base model's name -> the name in the first adapter holding it."""
    out: dict[str, str] = {}
    for ad in adapters:
        for n, key in ad.full.items():
            out.setdefault(n, key)
    return out


def whole(adapters: Sequence[Adapter], weights: Sequence[float], name: str) -> torch.Tensor:
    """Whole tensor `name` of the merge: the common value of the adapters that hold it (PEFT's copy
    of a base weight beside its LoRA), or their weighted mean (modules_to_save, held by all)."""
    held = [(ad.tensor(ad.full[name]), w) for ad, w in zip(adapters, weights) if name in ad.full]
    ts = [t for t, _ in held]
    if all(torch.equal(ts[0], t) for t in ts[1:]):
        return ts[0]
    return average(ts, [w for _, w in held]).to(ts[0].dtype)


def delta(adapters: Sequence[Adapter], coeffs: Sequence[float], module: str) -> torch.Tensor:
    """sum_i c_i s_i B_i @ A_i (transposed where PEFT transposes), float32: what folding adds."""
    total = None
    for ad, c in zip(adapters, coeffs):
        lo = ad.loras.get(module)
        if lo is None:
            continue
        d = ad.tensor(lo.b).float() @ ad.tensor(lo.a).float()
        d = (d.T if lo.transposed else d) * lo.scaling  # PEFT's get_delta_weight, so one adapter is bitwise
        d = d if c == 1 else d * c
        total = d if total is None else total.add_(d)
    assert total is not None
    return total


def merged_config(adapters: Sequence[Adapter]) -> dict[str, Any]:
    """The merged adapter's adapter_config.json: the first's, with rank and alpha the summed ranks
    (scaling 1: the scalings are in A), the union of target modules and of modules_to_save."""
    cfg = dict(adapters[0].config)
    rank = sum(ad.max_rank for ad in adapters)
    targets = [ad.config.get("target_modules") for ad in adapters]
    if all(isinstance(t, str) for t in targets):
        cfg["target_modules"] = "|".join(f"({t})" for t in dict.fromkeys(targets))
    elif all(isinstance(t, list) for t in targets):
        cfg["target_modules"] = list(dict.fromkeys(m for t in targets for m in t))
    saves = [m for ad in adapters for m in ad.config.get("modules_to_save") or []]
    cfg["modules_to_save"] = list(dict.fromkeys(saves)) or cfg.get("modules_to_save")
    cfg.update(r=rank, lora_alpha=rank, rank_pattern={}, alpha_pattern={}, use_rslora=False)
    return cfg


def fold_problems(adapters: Sequence[Adapter], specs: Mapping[str, Any], label: str) -> list[str]:
    """Every reason the adapters cannot be folded into the model whose tensors are `specs`."""
    problems = []
    for m in modules(adapters):
        ad = next(a for a in adapters if m in a.loras)
        lo = ad.loras[m]
        out_f, in_f = _io(ad, lo)
        want = (in_f, out_f) if lo.transposed else (out_f, in_f)
        sp = specs.get(f"{m}.weight")
        if sp is None:
            problems.append(f"{label} has no tensor {m}.weight, which {ad.label} adapts: the adapter is for another "
                            "model (or that weight is tied to another; fold into a model that saves it)")
        elif sp.dtype not in FLOATS or tuple(sp.shape) != want:
            problems.append(f"{label}: tensor {m}.weight is {sp.dtype}{list(sp.shape)}, {ad.label}'s update of it is "
                            f"{list(want)}: the adapter is for another model")
    for n, key in wholes(adapters).items():
        ad = next(a for a in adapters if n in a.full)
        sp, have = specs.get(n), ad.model.specs[key].shape
        if sp is None or tuple(sp.shape) != tuple(have):
            problems.append(f"{label}: " + (f"has no tensor {n}" if sp is None else f"tensor {n} is {list(sp.shape)}")
                            + f", which {ad.label} replaces with {list(have)}: the adapter is for another model")
    return problems
