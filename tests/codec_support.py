"""What the codec tests share (tests/test_codec.py, tests/test_topk.py): a delta contribution
against g0 written as a worker writes it, and one round merged from g0 as the service merges it."""
from __future__ import annotations

import json

from core import codec
from core.checkpoint_writer import write_checkpoint
from core.config import OuterConfig
from merge.round_spec import RoundSpec
from merge.rounds import merge_round

NESTEROV = OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9)


def publish_delta(mem, key: str, g: dict, w: dict, enc: codec.Encoding) -> str:
    tensors, meta, _ = codec.encode(g, w, enc)
    write_checkpoint(mem, key, tensors, metadata=meta, manifest={"round": 0, "base": "g0.safetensors"})
    return key


def merge_g0(mem, contribs, out="g1.safetensors", accumulator=None):
    return merge_round(mem, RoundSpec(base="g0.safetensors", out=out, outer=NESTEROV, state_out="state_" + out),
                       contribs, accumulator)


def meta_changed(**changes):
    """A damage for the hostile-file tests: the coding metadata with `changes` made to it."""
    def damage(tensors, meta):
        d = json.loads(meta[codec.META])
        d.update(changes)
        return {codec.META: json.dumps(d)}
    return damage
