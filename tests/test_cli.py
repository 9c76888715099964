"""What a person meets at the command line: help for every option, and a reader that goes away."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from core.config import config_from_dict
from core.storage import Storage
from orchestrator.cli import build_parser
from orchestrator.runstate import create_run

ROOT = Path(__file__).resolve().parent.parent


def _parsers(parser: argparse.ArgumentParser, name: str = "orchestrate"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _parsers(p, f"{name} {sub}")


def test_every_option_of_the_run_commands_says_what_it_does():
    for name, parser in _parsers(build_parser()):
        if name.split()[1:2] not in ([], ["submit"], ["resume"], ["status"], ["cancel"]):
            continue
        bare = [a.dest for a in parser._actions if not a.help and not isinstance(a, argparse._SubParsersAction)]
        assert bare == [], f"{name}: no help for {bare}"
    text = build_parser()._subparsers._group_actions[0].choices["submit"].format_help()
    assert "(default 4)" in text and "(default diloco)" in text and "(default auto)" in text


def test_a_reader_that_goes_away_gets_no_traceback(tmp_path, corpus_cache):
    cfg = config_from_dict({"model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32},
                            "data": {"cache_dir": corpus_cache}, "run_dir": str(tmp_path / "run")})
    create_run(Storage(cfg.run_dir), cfg)
    # `orchestrate status RUN --json | head`, with the reader gone before a byte is written
    code = ("import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1); from orchestrator.cli import main; "
            f"sys.exit(main(['status', {cfg.run_dir!r}, '--json']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr
