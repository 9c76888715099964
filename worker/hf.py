"""Hugging Face causal LMs as islands models (`model: hf:PATH`): build, tokenize, export.

Only local directories are read (`local_files_only`, HF_HUB_OFFLINE): a job never downloads.
transformers is imported when this module is first used for a model, never by the built-in path.

- `build`: `AutoModelForCausalLM.from_pretrained(PATH)` in float32, seen through `HFCausalLM`, which
  takes (idx, targets) and returns (logits, loss) like the built-in GPT, and whose state_dict names
  are the Hugging Face model's own: checkpoints hold HF names, and LoRA heads (worker/lora.py) go
  on its nn.Linear layers.
- `load_tokenizer`: its tokenizer, for worker/data.py (the corpus cache is keyed by its hash).
- `save_pretrained_dir`: the final model as a Hugging Face directory (weights + config + tokenizer).
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import stat
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn as nn
from torch.nn import functional as F

from core.config import ModelConfig
from core.errors import CheckpointError, ConfigError, IslandsError
from core.storage import Storage

_COPY_CHUNK = 16 << 20


def transformers_module() -> ModuleType:
    """transformers, offline, without tqdm bars (they would land in Slurm logs); or a clear error."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is first imported: set before
    try:
        import transformers
    except ImportError as exc:
        raise IslandsError(f"model.hf needs the transformers package, which is not installed ({exc}): "
                           "pip install transformers") from None
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _dtype_kw(transformers: ModuleType) -> dict[str, torch.dtype]:
    # float32 whatever the directory was saved in: the optimizer and the merge work in float32.
    # The keyword was renamed in transformers 4.56.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.float32}


class HFCausalLM(nn.Module):
    """A transformers causal LM with the built-in model's interface: forward(idx, targets) ->
    (logits, mean next-token cross-entropy; -1 targets ignored).

    It is a view, not a wrapper: it shares the HF model's submodules, parameters and buffers
    (the same dicts), so its state_dict and module names are exactly the HF model's (a wrapper
    would prefix them all), and replacing a layer (a LoRA head) replaces it in the HF model too.
    `.hf` is the HF model itself, e.g. for save_pretrained."""

    def __init__(self, hf_model: nn.Module, block_size: int) -> None:
        super().__init__()
        for slot in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            object.__setattr__(self, slot, getattr(hf_model, slot))
        # object.__setattr__: nn.Module.__setattr__ would register it as a child, i.e. put the HF
        # model into its own (shared) _modules
        object.__setattr__(self, "hf", hf_model)
        self.config = hf_model.config
        self.vocab_size = int(hf_model.config.vocab_size)
        self.block_size = block_size
        self.train(hf_model.training)

    def train(self, mode: bool = True) -> "HFCausalLM":
        self.hf.training = mode  # the HF model's own flag: it is not one of the shared children
        return super().train(mode)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if idx.shape[1] > self.block_size:
            raise ValueError(f"a sequence of {idx.shape[1]} tokens is longer than the model's "
                             f"{self.block_size} positions; lower model.block_size")
        logits = self.hf(input_ids=idx, use_cache=False).logits
        if targets is None:
            return logits, None
        # the batches already hold the next token as target: no shift here (HF `labels` would shift)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss


def max_positions(config: object) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


_CONFIG_LIMIT = 1 << 20  # bytes of a config.json


def hf_config(path: str) -> object:
    """The config of the model directory `path`: the one loader every entry point (the model, its
    tokenizer, `data prepare --tokenizer hf:`, eval) reads it through, checked before anything is
    allocated: a regular file (never a FIFO, which would block) of readable JSON of sane depth and
    size, a model type transformers knows, whole sizes that divide, weights that fit this machine."""
    tf = transformers_module()
    where = str(Path(path) / "config.json")
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError("not a regular file")
            data = f.read(_CONFIG_LIMIT + 1)
        if len(data) > _CONFIG_LIMIT or not isinstance(json.loads(data), dict):
            raise ValueError(f"not a JSON object of at most {_CONFIG_LIMIT} bytes")
        config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers' own checks raise their own kinds: any of them means the same
        raise ConfigError([f"model.hf: {where} is not a usable Hugging Face config ({type(exc).__name__}: "
                           f"{str(exc)[:200]})"], source="model") from None
    sizes = {k: getattr(config, k, None) for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers")}
    most = {"vocab_size": 1 << 24, "hidden_size": 1 << 17, "num_attention_heads": 1 << 12, "num_hidden_layers": 1 << 12}
    bad = [f"{k} is {v!r}, not a whole number in [1, {most[k]}]" for k, v in sizes.items()
           if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= most[k])]
    if not bad and sizes["hidden_size"] and sizes["num_attention_heads"] and sizes["hidden_size"] % sizes["num_attention_heads"]:
        bad.append(f"hidden_size {sizes['hidden_size']} is not divisible by num_attention_heads {sizes['num_attention_heads']}")
    if not bad and None not in (sizes["vocab_size"], sizes["hidden_size"], sizes["num_hidden_layers"]):
        d = sizes["hidden_size"]
        weights = 4 * (2 * sizes["vocab_size"] * d + 12 * sizes["num_hidden_layers"] * d * d)  # fp32, a rough count
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if weights > memory:
            bad.append(f"its fp32 weights alone would take about {weights / 1e9:.0f} GB, more than this machine's "
                       f"{memory / 1e9:.0f} GB")
    if bad:
        raise ConfigError([f"model.hf: {where}: {b}" for b in bad], source="model")
    return config


def build(cfg: ModelConfig, pretrained: bool = True) -> HFCausalLM:
    """The model at cfg.hf: its weights (pretrained) or its architecture only, in float32."""
    tf = transformers_module()
    path = _directory(cfg)
    config = hf_config(path)
    limit = max_positions(config)
    if limit is not None and cfg.block_size > limit:
        raise ConfigError([f"model.block_size is {cfg.block_size}, but the Hugging Face model at {path} has "
                           f"{limit} positions: set model.block_size <= {limit}"], source="model")
    if pretrained:
        check_weights(path, config)
        model = tf.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True,
                                                        **_dtype_kw(tf))
    else:
        model = tf.AutoModelForCausalLM.from_config(config, **_dtype_kw(tf))
    return HFCausalLM(model, limit or cfg.block_size)


_WEIGHTS, _WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"


def check_weights(path: str, config: object) -> None:
    """The weights of the model directory `path` checked before transformers reads them: safetensors
    only (a .bin is a pickle), each file regular (never a FIFO or a folder; a link a user made, as
    the Hugging Face cache does, is followed to a regular file), its header checked by islands' one
    reader (core.checkpoint.TensorFile: size, offsets, dtypes), every tensor the model has shaped as
    the model of its config wants (a transposed matrix is named). CheckpointError naming the file."""
    from core.checkpoint import TensorFile
    storage = Storage(path, follow_links=True)  # the folder a user names
    names = [_WEIGHTS]
    if storage.exists(_WEIGHTS_INDEX) and not storage.exists(_WEIGHTS):  # sharded: the files its index names
        try:
            index = json.loads(storage.read_bytes(_WEIGHTS_INDEX, limit=_CONFIG_LIMIT))
            names = sorted(set(index["weight_map"].values()))
            if not all(isinstance(n, str) and n == posixpath.basename(n) and n.endswith(".safetensors") for n in names):
                raise ValueError("it names a file outside the folder, or one that is not .safetensors")
        except Exception as exc:  # noqa: BLE001 - any damage to the index is the same refusal
            raise CheckpointError(f"{path}/{_WEIGHTS_INDEX} is not a usable index of safetensors files "
                                  f"({type(exc).__name__}: {str(exc)[:120]})") from None
    tf = transformers_module()
    with torch.device("meta"):  # the model's shapes, no memory
        want = {k: tuple(t.shape) for k, t in tf.AutoModelForCausalLM.from_config(config).state_dict().items()}
    for name in names:
        label = f"Hugging Face weights {path}/{name}"
        if storage.kind(name) is None:
            raise CheckpointError(f"{label}: missing; islands reads a model's weights from safetensors files "
                                  "(save_pretrained writes them)")
        with TensorFile(storage, name, None, label) as f:
            bad = [f"tensor {k} has shape {list(sp.shape)}, the model of its config.json wants {list(want[k])}"
                   for k, sp in f.specs.items() if k in want and tuple(sp.shape) != want[k]]
        if bad:
            raise CheckpointError(f"{label} does not fit the model of its config.json: " + "; ".join(bad[:4]))


def _directory(cfg: ModelConfig) -> str:
    path = os.path.expanduser(cfg.hf or "")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError([f"model.hf: {path} is not a Hugging Face model directory (no config.json); give a "
                           "local directory written by save_pretrained: islands never downloads a model"],
                          source="model")
    return path


class HFTokenizer:
    """A Hugging Face tokenizer as worker/data.py uses it: its `name` (a hash of the whole
    tokenizer, so another tokenizer never reuses this one's corpus cache), the token placed
    between documents (end-of-text) and batch encoding without special tokens."""

    def __init__(self, tokenizer: object, path: str) -> None:
        self.tok = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)  # fast (Rust) tokenizers
        self.separator = _separator(tokenizer, path)
        if self.backend is not None:
            blob = self.backend.to_str()
        else:  # a slow (Python) tokenizer: its vocabulary and class stand for it
            blob = json.dumps([type(tokenizer).__name__, sorted(tokenizer.get_vocab().items())])
        digest = hashlib.sha256(f"{blob}\n{self.separator}".encode()).hexdigest()
        self.name = f"hf-tokenizer-{digest[:24]}"

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.backend is not None:
            # encode_batch_fast (tokenizers >= 0.21): the same ids without the character offsets nobody reads here
            encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        return self.tok(texts, add_special_tokens=False)["input_ids"]


def _separator(tokenizer: object, path: str) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        return eos
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    if len(newline) == 1:
        return newline[0]
    raise IslandsError(f"the tokenizer at {path} has no end-of-text token and no single token for a newline, so "
                       "documents cannot be separated; give it an eos_token (tokenizer.eos_token = ...) and save it")


def load_tokenizer(path: str) -> HFTokenizer:
    """The tokenizer saved in the model directory `path`; its ids must fit the model's vocabulary."""
    tf = transformers_module()
    path = _directory(ModelConfig(hf=path))
    config = hf_config(path)  # transformers' tokenizer reads config.json too: checked here first
    try:
        tok = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises its own kinds for a bad tokenizer folder
        raise IslandsError(f"model.hf: no usable tokenizer in {path} ({type(exc).__name__}: {str(exc)[:200]}); save "
                           "the model's tokenizer there (tokenizer.save_pretrained)") from None
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and len(tok) > vocab:
        raise IslandsError(f"model.hf: the tokenizer in {path} has {len(tok)} tokens, more than the model's "
                           f"vocab_size {vocab}: they do not belong together")
    return HFTokenizer(tok, path)


def save_pretrained_dir(model: Any, source: str | None, storage: Storage, key: str) -> list[str]:
    """Write `model` (a transformers PreTrainedModel) into the directory `key` of `storage` as a
    Hugging Face model directory: save_pretrained (safetensors, tied weights once, as transformers
    does), plus the tokenizer of the directory `source` if given. config.json is written last, so a
    directory with it is complete. Returns the keys written."""
    tf = transformers_module()
    with tempfile.TemporaryDirectory(prefix="islands-hf-") as tmp:
        model.save_pretrained(tmp)
        if source is not None:
            tf.AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(tmp)
        names = sorted((n for n in os.listdir(tmp) if os.path.isfile(os.path.join(tmp, n))),
                       key=lambda n: (n == "config.json", n))
        written = []
        for name in names:
            dest = posixpath.join(key, name)
            with open(os.path.join(tmp, name), "rb") as fin, storage.open_atomic(dest) as fout:
                while chunk := fin.read(_COPY_CHUNK):
                    fout.write(chunk)
            written.append(dest)
    return written
