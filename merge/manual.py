"""`orchestrate merge`: merge existing checkpoints, ours or anyone's, with any registered method.

Inputs are `.safetensors` files or Hugging Face model directories (`model.safetensors`, or shards
+ `model.safetensors.index.json`) at any fsspec URL. A file with a manifest beside it (our
checkpoints) is checked against the manifest's digest; plain files from elsewhere are taken as
they are. The output follows the first input's layout: a `.safetensors` OUT is one file (with a
manifest, so it is a checkpoint of ours); any other OUT is a model directory with the first
input's shard names and grouping, its safetensors metadata, its index (written last) and its
other files (config, tokenizer, ...) copied, so `from_pretrained(OUT)` works. PEFT LoRA adapter
directories are merged into one adapter directory, or folded into `--base` (merge/adapters.py).

Every problem found before the maths (unreadable or truncated files, malformed headers or indexes,
missing tensors, shape or dtype mismatches, bad parameters) is reported at once, each naming the
file and tensor; a non-finite value found while streaming names its file and tensor too. Nothing is
written unless the whole merge succeeds, and nothing outside OUT (and the outer state) ever: an
input's index may name only files of its own directory, and an output that is an input (the same
file, by inode, whatever its name) is refused.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import posixpath
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch

from core.checkpoint import DTYPES, ITEMSIZE, TORCH_DTYPES
from core.checkpoint_writer import OutputFile, StreamWriter
from core.config import OuterConfig
from core.errors import CheckpointError, IslandsError, StorageError
from core.layout import RunLayout
from core.storage import Storage
from merge import DEFAULT_BUFFER_BYTES
from merge import adapters as lora
from merge.engine import MergeJob, run_merge
from merge.inputs import INDEX, InputError, Model, compare_specs, finite, nonfinite, open_file_model, open_model, split_url
from merge.methods import check_method_args, method_spec, with_defaults
from merge.outer import state_out_specs
from merge.reading import read_tensors

L = RunLayout()

MERGE_KEY = "islands.merge"
"""safetensors metadata key of every output file: the method, inputs, weights and parameters as JSON."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")


class MergeError(IslandsError):
    """A manual merge cannot be done; the message lists every problem, each with file and tensor."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"merge failed, nothing was written; {len(self.problems)} problem(s):\n{lines}")


@dataclass
class ManualResult:
    method: str
    inputs: int
    bytes_read: int
    seconds: float
    outputs: list[str]
    state: str | None


def _norm(url: str) -> str:
    proto, _ = fsspec.core.split_protocol(url)
    _, path = fsspec.core.url_to_fs(url)
    return f"{proto or 'file'}://{path.rstrip('/')}"


@dataclass(frozen=True)
class ManualMerge:
    """What `orchestrate merge` is asked to do."""

    inputs: Sequence[str]
    """`.safetensors` files, Hugging Face model directories or PEFT adapter directories, any fsspec URL."""
    out: str
    """A `.safetensors` file (with a manifest), or a model (or adapter) directory."""
    method: str = "average"
    """A name of merge.methods.METHODS."""
    weights: Sequence[float] | None = None
    """One per input; None: all 1."""
    base: str | None = None
    """The inputs' common starting point (task vectors, outer), or the model LoRA adapters are folded into."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """The method's parameters (density, scale, ...)."""
    outer: OuterConfig | None = None
    """`outer`: the outer optimizer (default: Nesterov, merge.outer)."""
    state: str | None = None
    """`outer`: the optimizer state file, read if it exists and written with the merge."""
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    """Read buffers of all inputs together: the merge's working set."""


def run_model(url: str, role: str) -> str:
    """A run directory a person names, as the model it stands for: as an input its final model,
    as the base its initial one (round 0's global, which a run keeps: orchestrator/retention.py),
    so that runs fine-tuned from one base merge against it; any other URL as it is."""
    try:
        is_run = Storage(url, follow_links=True).exists(L.CONFIG)
    except (OSError, IslandsError):
        return url
    return posixpath.join(url.rstrip("/"), L.global_weights(0) if role == "base" else L.FINAL) if is_run else url


def manual_merge(req: ManualMerge) -> ManualResult:
    """Merge the models at req.inputs into req.out (see the module docstring); return what was done."""
    req = dataclasses.replace(req, inputs=[run_model(u, "input") for u in req.inputs],
                              base=run_model(req.base, "base") if req.base else None)
    params = dict(req.params)
    weights = [1.0] * len(req.inputs) if req.weights is None else [float(w) for w in req.weights]
    problems: list[str] = []
    if len(weights) != len(req.inputs):
        problems.append(f"{len(weights)} weights for {len(req.inputs)} inputs: give one weight per input")
    if any(lora.is_adapter(u) for u in req.inputs):
        return _adapter_merge(req, weights, problems + _no_outer(req.outer, req.state))
    if req.method == "outer":
        params.setdefault("optimizer", req.outer or OuterConfig())
    else:
        problems += _no_outer(req.outer, req.state, req.method)
    problems += check_method_args(req.method, weights if len(weights) == len(req.inputs) else [1.0] * len(req.inputs),
                                  params, req.base is not None)
    params = with_defaults(req.method, params)  # recorded with the output: a DARE merge's seed
    sources = {_norm(u): u for u in [*req.inputs, *([req.base] if req.base else [])]}
    for target in [req.out, *([req.state] if req.state else [])]:
        if _norm(target) in sources:
            problems.append(f"{target} is also an input: write the merge somewhere else")
    if problems:
        raise MergeError(problems)
    models: list[Model] = []
    base_model = None
    try:
        base_model = _open_inputs(open_model, req.inputs, req.base, problems, models)
        job = _job(req, MergeJob(models[: len(req.inputs)], weights, req.method, [], params, base_model), models)
        try:
            stats = run_merge(job)
        except InputError as exc:
            raise MergeError([exc.reason]) from None
        except (CheckpointError, StorageError, ValueError) as exc:
            raise MergeError([str(exc)]) from None
        _finish_dir(job.inputs[0], req.out, list(job.outputs))
        return ManualResult(req.method, len(req.inputs), stats.bytes_read, stats.seconds,
                            [o.storage.display(o.key) for o in job.outputs], req.state)
    finally:
        for m in [*models, *([base_model] if base_model else [])]:
            m.close()


def _job(req: ManualMerge, job: MergeJob, opened: list[Model]) -> MergeJob:
    """`job` (its inputs open) given its outputs and, for outer, its optimizer state, after checking
    the inputs against each other and the outputs against the inputs; MergeError lists every problem."""
    ref, problems = job.inputs[0], []
    for m in [*job.inputs[1:], *([job.base] if job.base else [])]:
        problems += [f"{m.label}: {p}" for p in compare_specs(ref.specs, m.specs, ref.label)]
    if problems:
        raise MergeError(problems + ["merge models of the same architecture and dtype (convert them first)"])
    outputs = _output_layout(ref, req.out, _note(req.method, req.inputs, job.weights, job.params))
    if clash := _clashes([(o.storage, o.key) for o in outputs], [*job.inputs, *([job.base] if job.base else [])]):
        raise MergeError(clash)
    state_in = state_out = None
    if req.method == "outer" and req.state:
        layout = [(n, d, s) for o in outputs for n, d, s, _ in o.specs]
        state_dir, state_name = split_url(req.state)
        sst = Storage(state_dir, follow_links=True)
        if sst.exists(state_name):
            try:
                state_in = open_file_model(sst, state_name, f"{req.state} (outer state)", "state", require_manifest=False)
            except CheckpointError as exc:
                raise MergeError([str(exc)]) from None
            opened.append(state_in)
        optimizer = job.params["optimizer"]
        state_out = OutputFile(sst, state_name, state_out_specs(layout, optimizer), None, {"optimizer": optimizer.optimizer})
    return dataclasses.replace(job, outputs=outputs, state_in=state_in, state_out=state_out,
                               buffer_bytes=req.buffer_bytes)


def _open_inputs(open_one: Callable[[str, int], Any], inputs: Sequence[str], base: str | None,
                 problems: list[str], opened: list[Any]) -> Model | None:
    """Every input opened into `opened` (the caller closes them), and the base model; all problems
    at once (MergeError)."""
    for i, url in enumerate(inputs):
        try:
            opened.append(open_one(url, i))
        except CheckpointError as exc:
            problems.append(str(exc))
    base_model = None
    if base:
        try:
            base_model = open_model(base, ident="base", label=f"{base} (base)")
        except CheckpointError as exc:
            problems.append(str(exc))
    if problems:
        if base_model is not None:
            base_model.close()
        raise MergeError(problems)
    return base_model


def _finish_dir(ref: Model, out: str, outputs: list[OutputFile]) -> None:
    """A model directory's other files (config, tokenizer), then its index: last, the directory is
    whole from then on."""
    if not ref.directory or out.endswith(".safetensors"):
        return
    st = outputs[0].storage
    _copy_other_files(ref, st)
    if ref.index is not None:
        index = dict(ref.index)
        index["metadata"] = {**dict(index.get("metadata") or {}),
                             "total_size": sum(nb for o in outputs for *_, nb in o.specs)}
        index["weight_map"] = {n: o.key for o in outputs for n, *_ in o.specs}
        st.write_json(INDEX, index)


def _adapter_problems(req: ManualMerge, weights: list[float]) -> list[str]:
    """What stops req (whose inputs include an adapter) from being an adapter merge or fold."""
    inputs, out, method, base, problems = req.inputs, req.out, req.method, req.base, []
    if method not in ("average", "task-arithmetic"):
        problems.append(f"LoRA adapters merge with --method average or task-arithmetic (their updates summed, ranks "
                        f"concatenated), not {method}: fold each adapter into its base first (orchestrate merge "
                        f"ADAPTER --base MODEL --out DIR) and merge those models with {method}")
    elif len(weights) == len(inputs):  # --base names the model to fold into, not a task-vector base
        problems += check_method_args(method, weights, req.params, method_spec(method).needs_base)
    plain = [u for u in inputs if not lora.is_adapter(u)]
    if plain:
        problems.append(f"{plain} are not LoRA adapter directories (no {lora.CONFIG}): merge adapters with adapters, "
                        "or fold an adapter into a model with --base MODEL")
    if base and lora.is_adapter(base):
        problems.append(f"--base {base} is an adapter: --base names the model the adapters are folded into")
    if not base and out.endswith(".safetensors"):
        problems.append(f"merging adapters writes a PEFT adapter directory: give --out a directory, not {out}")
    if _norm(out) in {_norm(u) for u in [*inputs, *([base] if base else [])]}:
        problems.append(f"{out} is also an input: write the merge somewhere else")
    return problems


def _adapter_merge(req: ManualMerge, weights: list[float], problems: list[str]) -> ManualResult:
    """PEFT LoRA adapters (merge.adapters): merged into one adapter directory, or with req.base, folded
    into that model."""
    problems += _adapter_problems(req, weights)
    if problems:
        raise MergeError(problems)
    inputs, out, method, base = req.inputs, req.out, req.method, req.base
    params = with_defaults(method, req.params)
    total = sum(weights)
    coeffs = [w / total for w in weights] if method == "average" else [params["scale"] * w for w in weights]
    ads: list[lora.Adapter] = []
    base_model = None
    t0 = time.perf_counter()
    try:
        base_model = _open_inputs(lora.open_adapter, inputs, base, problems, ads)
        problems += lora.check_together(ads)
        if (full := sorted(lora.wholes(ads))) and total <= 0:
            problems.append(f"the adapters' whole tensors {full[:3]} are merged as the weights' mean: "
                            f"the weights must sum to a positive number, got {weights}")
        if base_model is not None:
            problems += lora.fold_problems(ads, base_model.specs, base_model.label)
        if problems:
            raise MergeError(problems)
        note = {"lora": "folded" if base_model else "concatenated ranks", "coefficients": coeffs}
        try:
            if base_model is not None:
                written = _fold(ads, coeffs, weights, base_model, out, _note(method, inputs, weights, params, **note))
            else:
                written = _write_adapter(ads, coeffs, weights, out, _note(method, inputs, weights, params, **note))
        except InputError as exc:
            raise MergeError([exc.reason]) from None
        except (CheckpointError, StorageError) as exc:
            raise MergeError([str(exc)]) from None
        read = sum(a.model.bytes for a in ads) + (base_model.bytes if base_model else 0)
        how = f"{method} of LoRA adapters, " + ("folded into the base" if base_model else "ranks concatenated")
        return ManualResult(how, len(inputs), read, time.perf_counter() - t0, written, None)
    finally:
        for m in [*(a.model for a in ads), *([base_model] if base_model else [])]:
            m.close()


def _fold(ads: list[lora.Adapter], coeffs: list[float], weights: list[float], base: Model, out: str,
          note: dict[str, Any]) -> list[str]:
    """base + sum_i c_i delta_i, tensor by tensor in the base's layout; whole tensors replaced."""
    outputs = _output_layout(base, out, note)
    if clash := _clashes([(o.storage, o.key) for o in outputs], [base, *(a.model for a in ads)]):
        raise MergeError(clash)
    targets = {f"{m}.weight": m for m in lora.modules(ads)}
    full = lora.wholes(ads)
    writer = StreamWriter(list(outputs))
    try:
        for f, names in base.layout():
            for name, t in read_tensors(f, base.ident, names):
                if name in full:
                    t = lora.whole(ads, weights, name)
                if name in targets:
                    t = t.float() + lora.delta(ads, coeffs, targets[name])
                if t.is_floating_point() and not finite(t):
                    raise CheckpointError(nonfinite(base.label if name not in targets else f"{out} (folded)", name))
                writer.put(name, t.to(TORCH_DTYPES[f.specs[name].dtype]))
        writer.finish()
        for m in [base, *(a.model for a in ads)]:
            m.verify()
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    _finish_dir(base, out, outputs)
    return [o.storage.display(o.key) for o in outputs]


def _write_adapter(ads: list[lora.Adapter], coeffs: list[float], weights: list[float], out: str,
                   note: dict[str, Any]) -> list[str]:
    """The merged adapter: its tensors, the first adapter's other files, and its config, last."""
    tensors: dict[str, torch.Tensor] = {}
    for m in lora.modules(ads):
        a, b = lora.concatenated(ads, coeffs, m)
        emb = next(ad.loras[m].embedding for ad in ads if m in ad.loras)
        parts = (".lora_embedding_A", ".lora_embedding_B") if emb else (".lora_A.weight", ".lora_B.weight")
        tensors[lora.PREFIX + m + parts[0]], tensors[lora.PREFIX + m + parts[1]] = a, b
    for name, key in lora.wholes(ads).items():
        tensors[key] = lora.whole(ads, weights, name)
    st = Storage(out)
    if clash := _clashes([(st, lora.WEIGHTS)], [a.model for a in ads]):
        raise MergeError(clash)
    specs = [(n, DTYPES[t.dtype], tuple(t.shape), t.numel() * t.element_size()) for n, t in tensors.items()]
    meta = {**ads[0].model.files[0].metadata, MERGE_KEY: json.dumps(note, sort_keys=True)}
    writer = StreamWriter([OutputFile(st, lora.WEIGHTS, specs, meta)])
    try:
        for n, t in tensors.items():
            writer.put(n, t.contiguous())
        writer.finish()
        for ad in ads:
            ad.model.verify()
        if st.exists(lora.CONFIG):  # an old config must not describe the new weights, even for a moment
            st.remove(lora.CONFIG)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    _copy_other_files(ads[0].model, st, skip=(lora.CONFIG,))
    st.write_json(lora.CONFIG, lora.merged_config(ads))
    return [st.display(lora.WEIGHTS), st.display(lora.CONFIG)]


def _no_outer(outer: OuterConfig | None, state: str | None, method: str = "a LoRA merge") -> list[str]:
    if outer is None and state is None:
        return []
    return [f"outer-optimizer options and --outer-state are for --method outer, not {method}"]


def _note(method: str, inputs: Sequence[str], weights: Sequence[float], params: Mapping[str, Any],
          **extra: Any) -> dict[str, Any]:
    """How an output was made, in every file it writes (a DARE merge's seed included)."""
    return {"method": method, "inputs": list(inputs), "weights": list(weights), **extra,
            **{k: v for k, v in params.items() if isinstance(v, (int, float, str))}}


def _output_layout(ref: Model, out: str, note: Mapping[str, Any]) -> list[OutputFile]:
    """The output files, in `ref`'s layout; every file's metadata and a single file's manifest
    record `note`."""
    def specs(names: list[str]) -> list[tuple[str, str, tuple[int, ...], int]]:
        return [(n, sp.dtype, sp.shape, math.prod(sp.shape) * ITEMSIZE[sp.dtype])
                for n in names for sp in [ref.tensors[n][1]]]

    layout = ref.layout()
    tag = {MERGE_KEY: json.dumps(note, sort_keys=True)}

    def meta(m: Mapping[str, str] | None) -> dict[str, str]:
        return {**dict(m or {}), **tag}

    if out.endswith(".safetensors"):
        parent, name = split_url(out)
        st = Storage(parent)
        names = [n for _, ns in layout for n in ns]
        return [OutputFile(st, name, specs(names), meta(layout[0][0].metadata), note)]
    st = Storage(out)
    if not ref.directory:
        return [OutputFile(st, "model.safetensors", specs(layout[0][1]), meta(layout[0][0].metadata))]
    return [OutputFile(st, f.key, specs(names), meta(f.metadata)) for f, names in layout]


def _clashes(outputs: list[tuple[Storage, str]], models: list[Model]) -> list[str]:
    """An output file that is one of the inputs' files (same inode: a link, another name of the
    same folder) would be overwritten while the merge reads it: refuse before reading anything."""
    ids = {}
    for m in models:
        for f in m.files:
            path = f.storage.local_path(f.key)
            if path is not None:
                st = os.stat(path)
                ids[(st.st_dev, st.st_ino)] = f.label
    problems = []
    for storage, key in outputs:
        path = storage.local_path(key)
        if path is not None and os.path.exists(path):
            st = os.stat(path)
            if (st.st_dev, st.st_ino) in ids:
                problems.append(f"output {path} is input {ids[(st.st_dev, st.st_ino)]} (the same file): write the "
                                "merge somewhere else")
    return problems


def _copy_other_files(ref: Model, dst: Storage, skip: tuple[str, ...] = ()) -> None:
    """Config, tokenizer, generation config...: every top-level non-weight file of the first input."""
    src = ref.storage
    assert src is not None
    shard_stems = {posixpath.splitext(f.key)[0] for f in ref.files}
    for name in src.list(""):
        if name.startswith(".") or name in (INDEX, *skip) or name.endswith(WEIGHT_SUFFIXES):
            continue
        if name.endswith(".json") and name[: -len(".json")] in shard_stems:  # a shard's manifest, not the model's
            continue
        local = src.local_path(name)
        if src.kind(name) == "directory" or local is not None and not stat.S_ISREG(os.stat(local).st_mode):
            continue  # a folder, a FIFO, a device: not a file of the model
        try:
            with src.open_read(name) as fin, dst.open_atomic(name) as fout:
                while chunk := fin.read(16 << 20):
                    fout.write(chunk)
        except OSError as exc:
            raise dst.error(f"copy {src.display(name)} to the output", exc) from exc
