"""Every command the README and the subcommands' help show a user, checked as written.

The examples are read from where a user reads them (README.md's code blocks, `orchestrate CMD
--help`), not copied here: an example that no longer parses, names a key that does not exist or a
value the config refuses fails this test. Each is parsed by the real parser and, for `submit`, its
config built and checked as `submit` builds it (every --set key and value), before anything would
run. Every merge and `data prepare` example on local paths then runs as written, by bash (merges
of checkpoints, fine-tunes and LoRA adapters, corpora prepared from a file, a glob and prompt /
response pairs with a Hugging Face tokenizer, each checked with `data check`; to and from S3); `/shared/`
and `/models/` are the only paths replaced, by a temporary folder; the S3 examples' buckets are made
on the suite's local S3 server. The `submit` examples run as written in test_documented_runs.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.checkpoint_writer import write_checkpoint
from core.config import load_config
from core.storage import Storage
from orchestrator.cli import _overrides, build_parser

ROOT = Path(__file__).resolve().parent.parent
SUBCOMMANDS = (["submit"], ["merge"], ["data", "prepare"], ["data", "check"])


def _commands(text: str) -> list[str]:
    """`orchestrate ...` commands in `text`: continuation lines joined, trailing comments dropped."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if pending:
            line = pending + " " + line
        elif not line.startswith("orchestrate "):
            continue
        if line.endswith("\\"):
            pending = line[:-1].strip()
            continue
        pending = ""
        out.append(re.sub(r"\s+#.*$", "", line).strip())
    return out


def _help(words: list[str]) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, type(parser._subparsers._group_actions[0])))
    p = sub.choices[words[0]]
    for w in words[1:]:
        p = next(a for a in p._actions if hasattr(a, "choices") and isinstance(a.choices, dict)).choices[w]
    return p.format_help()


def documented() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```\n(.*?)```", readme, flags=re.S)
    found = [c for b in blocks for c in _commands(b)]
    found += [c for words in SUBCOMMANDS for c in _commands(_help(words))]
    return list(dict.fromkeys(found))


EXAMPLES = documented()


def test_the_examples_are_found_where_users_read_them():
    assert "orchestrate submit --workers 4 --rounds 8" in EXAMPLES  # the README's main command
    assert any(c.startswith("orchestrate merge ") for c in EXAMPLES)
    assert any(c.startswith("orchestrate data prepare ") for c in EXAMPLES)
    assert len(EXAMPLES) >= 15, EXAMPLES


def parsed(command: str) -> argparse.Namespace:
    """`command` (`orchestrate ...`) as the real parser reads it."""
    return build_parser().parse_args(shlex.split(command)[1:])


def local(command: str, folder: Path) -> str:
    """`command` with the examples' absolute folders (/shared/..., /models/...) moved under `folder`."""
    return command.replace("/shared/", f"{folder}/shared/").replace("hf:/models/", f"hf:{folder}/models/")


@pytest.mark.parametrize("command", EXAMPLES)

def test_every_documented_command_parses_and_its_config_is_valid(command, monkeypatch, tmp_path):
    monkeypatch.setenv("USER", "alice")
    model = tmp_path / "models/llama"  # `model=hf:DIR` is checked to hold a config.json
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                                                   "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256}))
    argv = shlex.split(os.path.expandvars(local(command, tmp_path)))[1:]
    args = build_parser().parse_args(argv)  # argparse exits (SystemExit) on anything it does not take
    if args.command == "submit":
        cfg = load_config(args.config, _overrides(args), args.sets)  # every --set key and value checked
        assert cfg.workers >= 1 and cfg.rounds >= 1


def _checkpoints(folder: Path) -> None:
    """What the merge examples name: two checkpoints, three fine-tunes of one base and two LoRA
    adapters of it (PEFT's layout, test_merge_lora's), in `folder`."""
    from test_merge_lora import _adapter
    base = {"proj.weight": torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), "proj.bias": torch.zeros(8)}
    for i, name in enumerate(("a.safetensors", "b.safetensors")):
        write_checkpoint(Storage(str(folder)), name, {k: v + i for k, v in base.items()})
    write_checkpoint(Storage(str(folder / "pretrained")), "model.safetensors", base)
    for i in (1, 2, 3):
        tuned = {k: v + 0.1 * i * torch.randn(v.shape, generator=torch.Generator().manual_seed(i)) for k, v in base.items()}
        write_checkpoint(Storage(str(folder / f"ft{i}")), "model.safetensors", tuned)
    for i in (1, 2):
        g = torch.Generator().manual_seed(10 + i)
        _adapter(folder / f"lora{i}", {"proj": (torch.randn(2, 8, generator=g), torch.randn(8, 2, generator=g))}, r=2, alpha=4)


def _s3_inputs(s3, folder: Path) -> dict[str, str]:
    """The S3 examples' bucket and inputs: two workers' weights in s3://bucket, their base
    g.safetensors here, and web.parquet here. Returns the environment that reaches the server."""
    import boto3
    import pyarrow as pa
    import pyarrow.parquet as pq
    client = boto3.client("s3", endpoint_url=s3.endpoint_url, aws_access_key_id=s3.key, aws_secret_access_key=s3.secret,
                          region_name="us-east-1")
    if "bucket" not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket="bucket")
    g = {"proj.weight": torch.zeros(8, 8), "proj.bias": torch.zeros(8)}
    write_checkpoint(Storage(str(folder)), "g.safetensors", g)
    remote = Storage("s3://bucket", key=s3.key, secret=s3.secret, client_kwargs={"endpoint_url": s3.endpoint_url,
                                                                            "region_name": "us-east-1"})
    for w in (0, 1):
        write_checkpoint(remote, f"w{w}.safetensors", {k: v + 0.1 * (w + 1) for k, v in g.items()})
    texts = [f"<p>page {i}: " + "lorem ipsum dolor sit amet " * 20 + "</p>" for i in range(60)]
    pq.write_table(pa.table({"text": texts, "url": [f"https://site{i % 3}.example/{i}" for i in range(60)]}),
                   folder / "web.parquet")
    return s3.env()


def _corpus(folder: Path) -> None:
    """corpus.jsonl.zst, corpus/ of two such files, and pairs.jsonl of prompts and responses."""
    import zstandard
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 20, "source": f"site{i % 8}",
                         "url": f"https://site{i % 8}.example/{i}"}) for i in range(60)]
    data = zstandard.ZstdCompressor().compress("\n".join(lines).encode())
    (folder / "corpus.jsonl.zst").write_bytes(data)
    (folder / "corpus").mkdir()
    for name in ("a.jsonl.zst", "b.jsonl.zst"):
        (folder / "corpus" / name).write_bytes(data)
    pairs = [json.dumps({"prompt": f"What is {i} + {i}?", "response": f"The sum of {i} and {i} is {2 * i}."})
             for i in range(1500)]  # enough for a share of each of 4 workers (submit --help)
    (folder / "pairs.jsonl").write_text("\n".join(pairs) + "\n")


RUNNABLE = [c for c in EXAMPLES if c.startswith(("orchestrate merge ", "orchestrate data prepare "))]


@pytest.mark.parametrize("command", RUNNABLE)
def test_documented_commands_with_inputs_made_here_run_as_written(command, tmp_path, request, monkeypatch):
    """Run by bash, as typed (its globs too); a prepared corpus is then checked with `data check`,
    as the help shows. An s3:// example's buckets are made on the suite's local S3 server, which the
    command reaches through the environment (AWS_ENDPOINT_URL), as a user's reaches theirs."""
    monkeypatch.setenv("USER", "alice")
    _checkpoints(tmp_path)
    _corpus(tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    if "s3://" in command:
        env.update(_s3_inputs(request.getfixturevalue("s3_server"), tmp_path))
    if "hf:/models/llama" in command:  # the SFT example's tokenizer: a tiny one saved there
        pytest.importorskip("test_hf")._tiny_hf(tmp_path / "models" / "llama")
    line = os.path.expandvars(local(command, tmp_path))
    done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stdout + done.stderr, (line, done.stdout, done.stderr)
    out = parsed(line).out
    assert "s3://" in out or (tmp_path / out).exists(), (line, done.stdout)
    if "data prepare" in line:
        check = subprocess.run(["orchestrate", "data", "check", out], cwd=tmp_path, env=env, capture_output=True,
                               text=True, timeout=300)
        assert check.returncode == 0, check.stdout + check.stderr
