"""A worker's memory and start-up do not grow with the dataset; prepare throughput against `datasets`.

Generates two JSON-lines corpora (random words from a fixed vocabulary, documents of ~2 KB): a
small one and a large one (2 GB by default), prepares both (bytes tokenizer, 2 processes), then,
each in a fresh process, opens the dataset as a worker does (iid share of 4 workers), builds the
built-in model and takes one training step:

- peak RSS rise from the process's start (after imports) to its first step, and to its 100th, large / small
  (goal <= 1.1);
- seconds from start to the first step, large / small (goal <= 1.5);
- training tokens/s reading windows from the shards / the same shards read whole into memory first (the
  in-memory path a corpus had before; goal >= 0.95), on the small corpus, alternating runs.

Then prepare throughput (MB of JSON lines per second, 2 processes, a byte-level BPE tokenizer trained
here) against `datasets.load_dataset("json").map(tokenize, batched=True, num_proc=2)` with the same
tokenizer on the same file, and the largest process's peak RSS of each (ratio goal >= 1.0).

    python -m bench.data_scale [--large-gb 2] [--small-mb 10] [--compare-mb 200] [--steps 200]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the of and to in is was for on that with by as at from his her an were are which this be or has had not "
         "but what all when there can more if no out so said who them some could time into two like then first "
         "water been call people over day down now find long way may part").split()

_PROBE = r"""
import json, resource, sys, time
t0 = time.monotonic()
import numpy as np, torch
from worker.data import BatchSampler, Dataset
from worker.model import GPT
torch.manual_seed(0)
url, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t_start = time.monotonic()
ds = Dataset(url)
if mode == "memory":  # the shards read whole into memory first: the in-memory path of before
    arrays = {s.key: np.fromfile(ds.storage.path(s.key), dtype=ds.dtype) for s in ds.index.split("train")}
    ds._read = lambda picks, dtype: [arrays[k][a:b] for k, a, b in picks]
sampler = BatchSampler(ds, 128, 16, seed=0, worker=0, num_workers=4)
model = GPT(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=128)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
def step(i):
    x, y = sampler.batch(i)
    _, loss = model(x, y)
    opt.zero_grad(); loss.backward(); opt.step()
step(0)
first = time.monotonic() - t_start
rise = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
t1 = time.monotonic()
for i in range(1, steps + 1):
    step(i)
tps = steps * 16 * 128 / (time.monotonic() - t1)
later = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
print(json.dumps({"first_step_s": first, "rss_rise_mb": rise / 1024, "rss_rise_later_mb": later / 1024,
                  "tokens_per_s": tps}))
"""


def _corpus(path: Path, megabytes: float, seed: int) -> Path:
    """JSON lines of random-word documents; a 16 MB block of lines repeated, each copy with its own ids."""
    rng = random.Random(seed)
    block = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(200, 500))) for _ in range(4000)]
    target, written, copy = int(megabytes * 1e6), 0, 0
    with open(path, "w") as f:
        while written < target:
            for i, text in enumerate(block):
                line = json.dumps({"id": f"{copy}-{i}", "source": f"s{i % 8}", "text": text}) + "\n"
                f.write(line)
                written += len(line)
                if written >= target:
                    break
            copy += 1
    return path


_WRAP = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)")


def _run(cmd: list[str], env: dict | None = None) -> tuple[str, float, float]:
    """stdout, the seconds it took, and the peak RSS (MB) of its largest process (pool processes included)."""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _WRAP, *cmd], check=True, capture_output=True, text=True, env=env)
    return done.stdout, time.monotonic() - t0, int(done.stderr.strip().splitlines()[-1]) / 1024


def _prepare(src: Path, out: Path, tokenizer: str = "bytes") -> tuple[float, float]:
    _, seconds, rss = _run([sys.executable, "-m", "orchestrator.cli", "data", "prepare", str(src), "--out", str(out),
                       "--procs", "2", "--tokenizer", tokenizer])
    return seconds, rss


def _probe(url: Path, mode: str, steps: int) -> dict:
    out, _, _ = _run([sys.executable, "-c", _PROBE, str(url), mode, str(steps)])
    return json.loads(out.strip().splitlines()[-1])


def _tokenizer(folder: Path, sample: Path) -> Path:
    """A byte-level BPE of 8k tokens trained on the corpus, saved as a Hugging Face model folder's tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    lines = (json.loads(line)["text"] for _, line in zip(range(2000), open(sample)))
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    config = transformers.GPT2Config(vocab_size=len(fast), n_positions=128, n_embd=32, n_layer=1, n_head=2,
                                     bos_token_id=fast.eos_token_id, eos_token_id=fast.eos_token_id)
    config.save_pretrained(folder)
    return folder


_HF_MAP = r"""
import sys, datasets, transformers
tok = transformers.AutoTokenizer.from_pretrained(sys.argv[2])
ds = datasets.load_dataset("json", data_files=sys.argv[1], split="train", cache_dir=sys.argv[3])
ds.map(lambda b: {"ids": tok(b["text"], add_special_tokens=False)["input_ids"]}, batched=True, num_proc=2,
       remove_columns=ds.column_names)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--large-gb", type=float, default=2.0)
    p.add_argument("--small-mb", type=float, default=10.0)
    p.add_argument("--compare-mb", type=float, default=200.0, help="the JSON lines prepared against datasets.map")
    p.add_argument("--steps", type=int, default=200, help="training steps of the tokens/s comparison")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="islands-data-scale-") as tmp:
        t = Path(tmp)
        small, large = _corpus(t / "small.jsonl", args.small_mb, 0), _corpus(t / "large.jsonl", args.large_gb * 1e3, 1)
        (s_prep, _), (l_prep, l_rss) = _prepare(small, t / "ds-small"), _prepare(large, t / "ds-large")
        print(f"prepared {args.small_mb:.0f} MB in {s_prep:.1f}s and {args.large_gb * 1e3:.0f} MB in {l_prep:.1f}s "
              f"({args.large_gb * 1e3 / l_prep:.1f} MB/s, bytes tokenizer, 2 procs; largest process {l_rss:.0f} MB)")
        probes = {name: [_probe(t / f"ds-{name}", "read", 100) for _ in range(args.repeats)] for name in ("small", "large")}
        med = lambda rows, key: sorted(r[key] for r in rows)[len(rows) // 2]  # noqa: E731
        for key, goal in (("rss_rise_mb", 1.1), ("rss_rise_later_mb", 1.1), ("first_step_s", 1.5)):
            a, b = med(probes["small"], key), med(probes["large"], key)
            print(f"{key}: small {a:.1f}, large {b:.1f}: large/small {b / a:.3f} (goal <= {goal})")
        speeds = {"read": [], "memory": []}
        for _ in range(args.repeats):
            for mode in speeds:
                speeds[mode].append(_probe(t / "ds-small", mode, args.steps)["tokens_per_s"])
        rd, mem = sorted(speeds["read"])[args.repeats // 2], sorted(speeds["memory"])[args.repeats // 2]
        print(f"training tokens/s: windows read from the shards {rd:.0f}, from the shards in memory {mem:.0f}: "
              f"{rd / mem:.3f} (goal >= 0.95)")
        cmp_src = _corpus(t / "compare.jsonl", args.compare_mb, 2)
        tok = _tokenizer(t / "tok", cmp_src)
        mb = cmp_src.stat().st_size / 1e6
        ours, ours_rss = _prepare(cmp_src, t / "ds-bpe", f"hf:{tok}")
        _, theirs, theirs_rss = _run([sys.executable, "-c", _HF_MAP, str(cmp_src), str(tok), str(t / "hf-cache")],
                         env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
        print(f"prepare {mb:.0f} MB of JSON lines with an 8k BPE, 2 procs: islands {mb / ours:.1f} MB/s, "
              f"datasets.map {mb / theirs:.1f} MB/s: {theirs / ours:.2f}x (goal >= 1.0); largest process's peak RSS: "
              f"islands {ours_rss:.0f} MB, datasets {theirs_rss:.0f} MB")


if __name__ == "__main__":
    main()
