"""`orchestrate data prepare | check`: the command-line glue of worker/prepare.py (parsing and printing only)."""
from __future__ import annotations

import argparse
from typing import Any

from orchestrator.console import HelpFormatter, say

EXAMPLES = """examples:
  orchestrate data prepare corpus/*.jsonl.zst --out /shared/$USER/data/c4 \\
      --procs 8 --group-field url                      # groups: each URL's host
  orchestrate data prepare web.parquet --group-field url \\
      --out s3://bucket/data/web                       # non-iid by domain
  orchestrate data prepare pairs.jsonl --prompt-field prompt \\
      --response-field response --tokenizer hf:/models/llama \\
      --out /shared/$USER/data/sft                     # loss on responses only
  orchestrate submit --set data.source=/shared/$USER/data/c4 \\
      --set data.sharding=non-iid
  orchestrate data check /shared/$USER/data/c4         # every checksum
"""


def add_parser(subparsers: Any) -> None:
    data = subparsers.add_parser("data", help="prepare a corpus once into token shards that workers read in place",
                                 epilog=EXAMPLES, formatter_class=HelpFormatter)
    sub = data.add_subparsers(dest="data_command", required=True)
    p = sub.add_parser("prepare", help="tokenize sources into shards + index.json at --out (docs/data.md)",
                       epilog=EXAMPLES, formatter_class=HelpFormatter)
    p.add_argument("sources", nargs="+", metavar="SOURCE",
                   help="text files, *.jsonl[.gz|.zst], *.parquet, a Hugging Face datasets folder, or folders of these "
                        "(any fsspec URL)")
    p.add_argument("--out", "-o", required=True, help="the dataset's folder (any fsspec URL); a re-run resumes it")
    p.add_argument("--tokenizer", default="bytes", help="bytes (default), or hf:DIR: a Hugging Face model folder's tokenizer")
    p.add_argument("--text-field", default="text", help="the record field holding a document (default text)")
    p.add_argument("--prompt-field", help="with --response-field: fine-tuning pairs, the loss on the response only")
    p.add_argument("--response-field", help="the record field holding the response")
    p.add_argument("--messages-field", help="chat data: the field holding a list of {role, content} messages, rendered by "
                                            "the tokenizer's chat template; the loss on the assistant's turns only")
    p.add_argument("--group-field", help="documents with one value of this field form a group (data.sharding non-iid); "
                                         "a URL's host is its value")
    p.add_argument("--heldout", type=float, default=0.05, help="fraction of documents held out for eval (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="decides which documents are held out (default 0)")
    p.add_argument("--procs", type=int, default=1, help="processes preparing at once (default 1)")
    p.add_argument("--shard-tokens", type=int, default=1 << 25, help="most tokens in a shard (default 33554432)")
    p.add_argument("--skip-bad", action="store_true", help="skip and count a malformed record instead of stopping")
    p.set_defaults(data_handler=cmd_prepare)
    p = sub.add_parser("check", help="check a prepared dataset: its index, every file's size and checksum")
    p.add_argument("dataset", help="the dataset's folder (any fsspec URL)")
    p.set_defaults(data_handler=cmd_check)


def cmd_prepare(args: argparse.Namespace) -> int:
    import time

    from core.dataset import DatasetError
    from worker.prepare import PrepareSpec, prepare
    from worker.sources import Fields
    if (args.prompt_field is None) != (args.response_field is None):
        raise DatasetError("--prompt-field and --response-field go together: name both fields of a fine-tuning pair")
    if args.messages_field and args.response_field:
        raise DatasetError("--messages-field and --prompt-field/--response-field are two kinds of fine-tuning data: give one")
    spec = PrepareSpec(tuple(args.sources), args.out, args.tokenizer,
                       Fields(args.text_field, args.prompt_field, args.response_field, args.group_field,
                              args.messages_field),
                       args.heldout, args.seed, args.procs, args.shard_tokens, args.skip_bad)
    t0 = time.monotonic()
    try:
        index = prepare(spec)
    except KeyboardInterrupt:
        say(f"interrupted: the units finished so far are kept in {args.out}; the same command goes on from there")
        return 130
    tokens = index.to_json()["tokens"]
    empty = f", {index.empty} empty documents dropped" if index.empty else ""
    say(f"prepared {args.out}: {index.documents} documents ({index.skipped} bad records skipped{empty}), "
        f"{tokens['train']} train + {tokens['eval']} eval tokens ({index.dtype}) in "
        f"{len(index.shards)} shards, {len({s.group for s in index.shards})} group(s), {time.monotonic() - t0:.0f}s")
    say(f"train on it with: orchestrate submit --set data.source={args.out}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from core import dataset as fmt
    from worker.data import Dataset
    ds = Dataset(args.dataset, check_sizes=False)
    problems = [p for shard in ds.index.shards
                for p in fmt.verify_shard(shard, ds.storage.read_bytes, ds.index.width, ds.vocab_size)]
    if problems:
        raise fmt.DatasetError(f"{ds.url}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems[:20])
                               + "\nPrepare it again (the same command resumes only what is missing).")
    say(f"{ds.url}: {len(ds.index.shards)} shards, {ds.index.documents} documents: every size and checksum matches "
        "the index, every token id is inside the vocabulary")
    return 0
