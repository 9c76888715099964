"""Hugging Face causal LMs (`model: hf:PATH`): config, model view, tokenized corpus, LoRA heads, whole runs.

The model is a tiny Llama built from a config and the tokenizer a tiny byte-level BPE trained here
on a few strings: nothing is downloaded.
"""
from __future__ import annotations

import json
import os
import re
import math

import numpy as np
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import yaml  # noqa: E402
from safetensors.torch import save as save_safetensors  # noqa: E402

from core.checkpoint import load_checkpoint  # noqa: E402
from core.config import config_from_dict, load_config, to_yaml  # noqa: E402
from core.dataset import DatasetError  # noqa: E402
from core.errors import ConfigError  # noqa: E402
from core.layout import RunLayout  # noqa: E402
from core.storage import Storage  # noqa: E402
from worker import data, lora  # noqa: E402
from worker.hf import HFCausalLM, load_tokenizer  # noqa: E402
from worker.params import make_optimizer  # noqa: E402
from worker.train import load_run_config  # noqa: E402
from worker.weights import build_model, load_model, load_weights, weights_of  # noqa: E402

L = RunLayout()
SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
    "if x is None:\n    raise ValueError('x is missing')\n",
    "while True:\n    line = f.readline()\n    if not line:\n        break\n",
]


def _texts(root: Path) -> Path:
    """16 small Python-like files in 4 packages: enough for 2 workers and a held-out document."""
    for i in range(16):
        path = root / f"pkg{i % 4}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(SNIPPETS[(i + k) % len(SNIPPETS)] for k in range(12)) + f"# file {i}\n")
    return root


def _tiny_hf(directory: Path, positions: int = 64) -> Path:
    """A tiny Llama (tied embeddings, as SmolLM2) and a byte-level BPE tokenizer, save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SNIPPETS * 4, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=len(fast),
                                      max_position_embeddings=positions, tie_word_embeddings=True,
                                      eos_token_id=fast.eos_token_id, bos_token_id=fast.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return _tiny_hf(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    return _texts(tmp_path_factory.mktemp("texts"))


def _cfg(hf_dir: Path, **extra):
    return config_from_dict({"model": {"hf": str(hf_dir), "block_size": 32}, **extra})


# -- config ---------------------------------------------------------------------------------------
def test_model_hf_shorthand_set_and_checks(hf_dir, tmp_path, monkeypatch):
    yml = tmp_path / "c.yaml"
    yml.write_text(f"model: hf:{hf_dir}\n")
    cfg = load_config(str(yml), sets=["model.block_size=32"])  # --set model.x keeps the shorthand's hf
    assert cfg.model.hf == str(hf_dir) and cfg.model.block_size == 32
    assert load_config(sets=[f"model.hf={hf_dir}"]).model == config_from_dict({"model": {"hf": str(hf_dir)}}).model
    assert load_config(sets=[f"model=hf:{hf_dir}", "model.block_size=32"]).model == cfg.model
    assert config_from_dict(yaml.safe_load(to_yaml(cfg))) == cfg  # what a resumed run reads back
    monkeypatch.chdir(hf_dir.parent)  # a relative path is made absolute: workers may start elsewhere
    assert config_from_dict({"model": f"hf:{hf_dir.name}"}).model.hf == str(hf_dir)
    (tmp_path / "empty").mkdir()
    for value, why in {"gpt2": "is not a model", "hf:": "is not a model"}.items():
        with pytest.raises(ConfigError, match=why):
            config_from_dict({"model": value})
    for value, why in {"nowhere": "does not exist", "empty": "has no config.json"}.items():
        with pytest.raises(ConfigError, match=why):  # refused where a run is asked for
            load_config(sets=[f"model.hf={tmp_path / value}"])
    # ... but a stored config naming a directory this machine cannot see still loads (status, report)
    assert config_from_dict({"model": f"hf:{tmp_path / 'nowhere'}"}).model.hf == str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="model.n_layer describe the built-in model"):
        config_from_dict({"model": {"hf": str(hf_dir), "n_layer": 4}})
    # lte.rank is checked against the HF model's layers (worker/lora.py), not model.n_embd
    assert _cfg(hf_dir, algorithm="lte", lte={"rank": 200}).lte.rank == 200
    with pytest.raises(ConfigError, match="model.block_size is 128, but the Hugging Face model .* has 64 positions"):
        build_model(config_from_dict({"model": f"hf:{hf_dir}"}).model)


# -- the model --------------------------------------------------------------------------------------
def test_view_has_hf_names_and_the_same_loss_as_hf_labels(hf_dir):
    model = build_model(_cfg(hf_dir).model)
    assert isinstance(model, HFCausalLM) and model.vocab_size == len(load_tokenizer(str(hf_dir)).tok)
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    ref_sd = reference.state_dict()
    w = weights_of(model)
    # HF names; the tied lm_head is stored once, under the embedding's name
    assert set(w) == set(ref_sd) - {"lm_head.weight"} and all(torch.equal(w[k], ref_sd[k]) for k in w)
    save_safetensors(w)  # safetensors refuses shared tensors: none are left
    seq = torch.randint(0, model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    logits, loss = model(seq[:, :-1], seq[:, 1:])
    # our batches hold next tokens as targets; HF's labels are shifted inside its own loss
    assert logits.shape == (2, 16, model.vocab_size)
    torch.testing.assert_close(loss, reference(input_ids=seq, labels=seq).loss)
    # loading weights goes into the HF model itself (the view shares its parameters)
    changed = {k: v + 1.0 for k, v in w.items()}
    load_weights(model, changed, "test")
    assert torch.equal(model.hf.lm_head.weight, changed["model.embed_tokens.weight"])
    model.eval()
    assert not model.hf.training and not model.hf.model.training


def test_weight_decay_groups_for_hf(hf_dir):
    model = build_model(_cfg(hf_dir).model)
    opt, names = make_optimizer(model, _cfg(hf_dir))
    decayed = set(names[: len(opt.param_groups[0]["params"])])
    assert "model.layers.0.self_attn.q_proj.weight" in decayed and "model.layers.1.mlp.down_proj.weight" in decayed
    assert "model.embed_tokens.weight" not in decayed  # the embedding (and the lm_head tied to it)
    assert not any("norm" in n for n in decayed) and "lm_head.weight" not in names


# -- the corpus -----------------------------------------------------------------------------------
def test_tokenized_corpus_has_its_own_cache(hf_dir, texts, tmp_path, monkeypatch):
    tok = load_tokenizer(str(hf_dir))
    cache = tmp_path / "cache"
    byte = data.dataset_for(config_from_dict({"data": {"source": str(texts), "cache_dir": str(cache)}}))
    ids = data.dataset_for(_cfg(hf_dir, data={"source": str(texts), "cache_dir": str(cache)}))
    assert byte.url != ids.url and len(list((cache / "data").iterdir())) == 2
    assert byte.index.dtype == "uint8" and ids.index.dtype == "uint16" and ids.index.tokenizer.name == tok.name
    for shard in ids.index.shards:  # each document is its file, tokenized, then the end-of-text token
        tokens = np.frombuffer(ids.storage.read_bytes(shard.key), dtype="<u2")
        ends = np.frombuffer(ids.storage.read_bytes(shard.docs_key), dtype="<u8")
        assert int(tokens.max()) > 255 and all(int(tokens[e - 1]) == tok.separator == tok.tok.eos_token_id for e in ends)
        decoded = {tok.tok.decode(tokens[a:b - 1].tolist()) for a, b in zip([0, *ends[:-1]], ends)}
        assert decoded <= {p.read_text() for p in texts.rglob("*.py")}
    monkeypatch.setattr(data, "prepare", lambda *a, **k: pytest.fail("prepared again although it is cached"))
    assert data.dataset_for(_cfg(hf_dir, data={"source": str(texts), "cache_dir": str(cache)})).url == ids.url


def test_a_dataset_of_another_tokenizer_is_refused_naming_both(hf_dir, texts, tmp_path):
    byte = data.dataset_for(config_from_dict({"data": {"source": str(texts), "cache_dir": str(tmp_path)}}))
    with pytest.raises(DatasetError, match=r"prepared with tokenizer bytes, but the model at .* reads hf-tokenizer-"):
        data.dataset_for(_cfg(hf_dir, data={"source": byte.url}))


# -- LoRA heads -----------------------------------------------------------------------------------
def test_lte_heads_on_every_linear_of_the_hf_model(hf_dir):
    cfg = _cfg(hf_dir, algorithm="lte", lte={"rank": 4})
    model = build_model(cfg.model)
    linears = sorted(n for n, m in model.named_modules() if type(m) is nn.Linear)
    headed = lora.attach_heads(model, cfg.lte, seed=0)
    assert headed == [n for n in linears if n != "lm_head"] and len(headed) == 2 * 7  # lm_head is the embedding
    assert isinstance(model.hf.model.layers[0].self_attn.q_proj, lora.LoRALinear)  # in the HF model itself
    published = lora.contribution_tensors(model)
    assert {k: tuple(v.shape) for k, v in published.items()} == lora.contribution_shapes(cfg, 4)
    assert "model.embed_tokens.weight" in published and "lm_head.weight" not in published
    x = torch.randint(0, model.vocab_size, (2, 8))
    _, loss = model(x, x)
    loss.backward()
    assert model.hf.model.layers[0].self_attn.q_proj.lora_B.grad is not None


# -- whole runs through the local executor --------------------------------------------------------
def _submit(run: Path, hf_dir: Path, texts: Path, cache: str, *extra: str) -> list[str]:
    return ["submit", "--executor", "inline", "--workers", "2", "--rounds", "2", "--inner-steps", "4",
            "--run-dir", str(run), "--set", f"model=hf:{hf_dir}", "--set", "model.block_size=32",
            "--set", f"data.source={texts}", "--set", f"data.cache_dir={cache}", "--set", "data.heldout_fraction=0.1",
            "--set", "inner.batch_size=4", "--set", "inner.warmup_steps=2", "--set", "data.eval_batches=2",
            "--set", "round.poll_s=0.2", *extra]


def _status(run: Path, capsys) -> dict:
    from orchestrator.cli import main
    capsys.readouterr()
    assert main(["status", str(run), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_diloco_two_workers_two_rounds_exports_a_hf_directory(hf_dir, texts, tmp_path, capsys):
    from orchestrator.cli import main
    run = tmp_path / "run"
    assert main(_submit(run, hf_dir, texts, str(tmp_path / "cache"))) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "initial eval loss (nats/token)" in said and f"as a Hugging Face folder: {run / L.FINAL_HF}" in said, said
    st = _status(run, capsys)
    assert st["state"] == "done" and [r["merged"] for r in st["rounds"]] == [[0, 1], [0, 1]]
    assert all(j["state"] != "RUNNING" for r in st["rounds"] for j in r["jobs"].values()), st["rounds"]  # right after done
    losses = [st["initial_eval_loss"]] + [r["eval_loss"] for r in st["rounds"]]
    assert all(math.isfinite(v) for v in losses) and losses[2] < losses[0], losses
    s = Storage(str(run))
    assert load_run_config(s).model.hf == str(hf_dir)
    final, _, _ = load_checkpoint(s, L.FINAL)
    assert "lm_head.weight" not in final and "model.layers.0.self_attn.q_proj.weight" in final
    manifest = s.read_json("rounds/00001/contrib/worker_000.json")
    assert manifest["tokens"] == 4 * 4 * 32
    # the Hugging Face export loads on its own and holds the final global weights
    assert st["final_hf"] == str(run / L.FINAL_HF)
    exported = transformers.AutoModelForCausalLM.from_pretrained(st["final_hf"], local_files_only=True)
    sd = exported.state_dict()
    assert set(sd) - set(final) == {"lm_head.weight"} and set(final) <= set(sd)
    assert all(torch.equal(sd[k], final[k]) for k in final)
    assert torch.equal(sd["lm_head.weight"], final["model.embed_tokens.weight"])
    from orchestrator.observe.checkpoint_eval import evaluate_checkpoints  # `orchestrate eval`: same tokens, same loss
    evaluated = evaluate_checkpoints([str(run)])
    assert evaluated["models"][0]["loss"] == pytest.approx(losses[-1], abs=1e-4)
    assert evaluated["data"]["loss_per"] == "token" and "bits_per_token" in evaluated["models"][0]
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0  # off a terminal: plain lines, in the tokenizer's unit
    out = capsys.readouterr().out
    assert "x 32 tokens" in out and "bits/token" in out and "byte" not in out.replace(str(run), "")
    assert main(["eval", str(run / L.FINAL_HF), "--json"]) == 0  # the exported folder scores the final model's loss
    by_hf = json.loads(capsys.readouterr().out)
    assert by_hf["models"][0]["loss"] == pytest.approx(evaluated["models"][0]["loss"], abs=1e-5), by_hf
    assert by_hf["data"]["config"] == evaluated["data"]["config"]
    assert st["loss"] == "loss (nats/token)"
    main(["status", str(run)])
    assert "initial eval loss (nats/token)" in " ".join(capsys.readouterr().out.split())
    reloaded = load_model(st["final_model"])  # rebuilt from the checkpoint's metadata alone
    assert isinstance(reloaded, HFCausalLM) and all(torch.equal(v, final[k]) for k, v in weights_of(reloaded).items())
    tok = transformers.AutoTokenizer.from_pretrained(st["final_hf"], local_files_only=True)
    assert tok("def add(a, b):")["input_ids"] == load_tokenizer(str(hf_dir)).tok("def add(a, b):")["input_ids"]


@pytest.mark.slow
def test_lte_two_workers_two_rounds_on_a_hf_model(hf_dir, texts, tmp_path, capsys):
    from orchestrator.cli import main
    run = tmp_path / "run"
    assert main(_submit(run, hf_dir, texts, str(tmp_path / "cache"), "--set", "algorithm=lte",
                        "--set", "lte.rank=4", "--set", "lte.alpha=16", "--set", "lte.lr=3e-3")) == 0
    st = _status(run, capsys)
    assert st["state"] == "done" and st["algorithm"] == "lte"
    assert [r["merged"] for r in st["rounds"]] == [[0, 1], [0, 1]] and all(r["rejected"] == [] for r in st["rounds"])
    losses = [st["initial_eval_loss"]] + [r["eval_loss"] for r in st["rounds"]]
    assert all(math.isfinite(v) for v in losses) and losses[2] < losses[0], losses
    s = Storage(str(run))
    contrib, _, _ = load_checkpoint(s, L.contribution(1, 0))
    assert "model.layers.0.mlp.up_proj.lora_A" in contrib and "model.layers.0.mlp.up_proj.weight" not in contrib
    g1, g2 = (load_checkpoint(s, L.global_weights(r))[0] for r in (1, 2))
    assert not torch.equal(g1["model.layers.0.mlp.up_proj.weight"], g2["model.layers.0.mlp.up_proj.weight"])
    assert st["final_hf"] is not None


@pytest.mark.parametrize("change, says", [
    ({"vocab_size": 10**12}, r"vocab_size is 1000000000000, not a whole number"),
    ({"model_type": "no-such-model"}, "is not a usable Hugging Face config"),
    ({"hidden_size": 30, "num_attention_heads": 4}, "not a multiple of the number of attention heads|not divisible"),
    ({"num_hidden_layers": 10**6}, r"num_hidden_layers is 1000000, not a whole number"),
    ({"hidden_size": 65536, "intermediate_size": 4, "num_attention_heads": 1, "num_hidden_layers": 64}, "would take about"),
    ("[" * 100_000 + "]" * 100_000, "is not a usable Hugging Face config"),
    ("{not json", "is not a usable Hugging Face config"),
])
def test_a_hostile_hf_config_is_one_clear_error_before_anything_is_allocated(hf_dir, tmp_path, change, says):
    import shutil

    from worker.hf import build
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(change if isinstance(change, str) else json.dumps({**config, **change}))
    with pytest.raises(ConfigError, match=says):
        build(_cfg(bad).model, pretrained=False)


HOSTILE = {  # config.json -> what the one loader (worker.hf.hf_config) says
    "unknown-model-type": ({"model_type": "no-such-model"}, "is not a usable Hugging Face config"),
    "heads-do-not-divide": ({"hidden_size": 30, "num_attention_heads": 4}, "not divisible|not a multiple"),
    "deep": ("[" * 100_000 + "]" * 100_000, "is not a usable Hugging Face config"),
    "fifo": (None, "no config.json|not a regular file"),
}


def _hostile(hf_dir: Path, tmp_path: Path, case: str) -> Path:
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    change, _ = HOSTILE[case]
    if change is None:
        (bad / "config.json").unlink()
        os.mkfifo(bad / "config.json")
    else:
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(change if isinstance(change, str) else json.dumps({**config, **change}))
    return bad


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_every_entry_point_reads_a_hostile_hf_config_through_the_one_loader(hf_dir, tmp_path, capsys, case):
    """The model, its tokenizer, `data prepare --tokenizer hf:` and `submit --set model=hf:`: one clear
    error each, no traceback, nothing blocks on a FIFO."""
    from core.errors import IslandsError
    from orchestrator.cli import main
    from worker.hf import build, load_tokenizer
    bad, says = _hostile(hf_dir, tmp_path, case), HOSTILE[case][1]
    with pytest.raises(IslandsError, match=says):
        build(_cfg(bad).model, pretrained=False)
    with pytest.raises(IslandsError, match=says):
        load_tokenizer(str(bad))
    src = tmp_path / "src.txt"
    src.write_text("some text to prepare " * 50)
    capsys.readouterr()
    assert main(["data", "prepare", str(src), "--out", str(tmp_path / "ds"), "--tokenizer", f"hf:{bad}"]) == 2
    out = capsys.readouterr().out
    assert re.search(says, out) and "Traceback" not in out, out
    assert main(["submit", "--set", f"model=hf:{bad}", "--set", "model.block_size=32", "--executor", "inline",
                 "--run-dir", str(tmp_path / "run"), "--set", f"data.source={src}"]) == 2
    out = capsys.readouterr().out
    assert re.search(says, out) and "Traceback" not in out, out


def _weights_fifo(d: Path) -> None:
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")


def _weights_link(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to("/etc/passwd")


def _weights_bomb(d: Path) -> None:
    (d / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{" * 64)


def _weights_folder(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()


def _weights_transposed(d: Path) -> None:
    from safetensors.torch import load_file, save_file
    tensors = load_file(d / "model.safetensors")
    name = next(k for k, t in tensors.items() if t.dim() == 2 and t.shape[0] != t.shape[1])
    tensors[name] = tensors[name].t().contiguous()
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


HOSTILE_WEIGHTS = {
    "a FIFO": (_weights_fifo, "is a FIFO|not a regular file"),
    "a link to /etc/passwd": (_weights_link, "model.safetensors: .*(header|truncated|safetensors)"),
    "a header bomb": (_weights_bomb, "model.safetensors: .*header"),
    "a folder": (_weights_folder, "is a directory|not a regular file"),
    "a transposed matrix": (_weights_transposed, r"has shape \[(\d+), (\d+)\], the model of its config.json wants \[\2, \1\]"),
}


@pytest.fixture(scope="module")
def hf_run(hf_dir, texts, tmp_path_factory) -> Path:
    """A run directory of the tiny Llama (its config only: no round is trained), for `eval --run`."""
    from orchestrator.run_models import create_run
    run = tmp_path_factory.mktemp("hf-run") / "run"
    cfg = _cfg(hf_dir, data={"source": str(texts), "cache_dir": str(tmp_path_factory.mktemp("hf-cache"))},
               run_dir=str(run), workers=1, rounds=1)
    create_run(Storage(str(run)), cfg)
    return run


@pytest.mark.parametrize("case", sorted(HOSTILE_WEIGHTS))
def test_eval_of_a_hostile_hf_folder_is_one_clear_error(hf_dir, hf_run, tmp_path, capsys, case):
    """`orchestrate eval FOLDER --run RUN` reads the folder's weights through worker.hf.check_weights
    (islands' own safetensors reader) before transformers sees them: no traceback, nothing blocks."""
    import shutil
    from orchestrator.cli import main
    bad = tmp_path / "hf"
    shutil.copytree(hf_dir, bad)
    damage, says = HOSTILE_WEIGHTS[case]
    damage(bad)
    capsys.readouterr()
    assert main(["eval", str(bad), "--run", str(hf_run), "--batches", "1"]) != 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert re.search(says, text) and "Traceback" not in text, text
