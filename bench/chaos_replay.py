"""After a chaos run: check that nothing invalid was merged, and replay the recorded merges offline.

The replay starts from the run's global_0 and, round by round, merges exactly the contributions
each record lists (`merged` with the recorded weights, and the `folded` late contributions
re-based onto the replayed global) in the recorded `merge_order` (the running sum's arrival order:
floating-point sums depend on it) with the merge engine's own functions, writing
under `replay/` in the run directory. Every contribution's digest must still be the one recorded at
the merge (nothing merged was replaced since), and every replayed global checkpoint must hash to
the one the run published: "replay identical" means bit for bit, every round.
"""
from __future__ import annotations

from typing import Any

import torch

from core.checkpoint import load_checkpoint, read_manifest
from core.config import Config
from core.layout import RunLayout, manifest_key
from core.storage import Storage
from merge.rounds import merge_round
from orchestrator.late import rebase
from orchestrator.outer_state import recorded_inputs
from worker.weights import model_metadata

L = RunLayout()
PREFIX = "replay"


def _g(r: int) -> str:
    return f"{PREFIX}/{L.global_weights(r)}"


def _s(r: int) -> str:
    return f"{PREFIX}/{L.outer_state(r)}"


def _folded(r: int, fold: dict[str, Any]) -> str:
    return f"{PREFIX}/{L.folded_contribution(r, fold['worker'], fold['from_round'])}"


def invalid_merges(storage: Storage, rounds: int) -> list[str]:
    """Every merged (or folded) contribution that is not whole, finite and shaped like the model."""
    ref = load_checkpoint(storage, L.global_weights(0))[0]
    problems = []
    for r in range(rounds):
        rec = storage.read_json(L.round_record(r)) or {}
        keys = [(w, L.contribution(r, w)) for w in rec.get("merged", [])]
        keys += [(f["worker"], f["source"]) for f in rec.get("folded", [])]
        for w, key in keys:
            try:
                tensors = load_checkpoint(storage, key)[0]  # digest verified against the manifest
            except Exception as exc:  # noqa: BLE001 - any failure is a finding, reported with its key
                problems.append(f"round {r} worker {w}: {key} unreadable: {exc}")
                continue
            if set(tensors) != set(ref) or any(tensors[n].shape != ref[n].shape or tensors[n].dtype != ref[n].dtype
                                               for n in ref):
                problems.append(f"round {r} worker {w}: {key} does not match the model's tensors")
            elif not all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point()):
                problems.append(f"round {r} worker {w}: {key} has NaN or Inf")
    return problems


def replay(storage: Storage, cfg: Config, rounds: int) -> dict[str, Any]:
    """Replay every recorded merge; {'identical': bool, 'rounds': [...], 'problems': [...]}."""
    storage.remove(PREFIX, recursive=True)
    storage.copy(L.global_weights(0), _g(0))
    storage.write_json(manifest_key(_g(0)), read_manifest(storage, L.global_weights(0)))
    metadata = model_metadata(cfg.model)
    out, problems = [], []
    for r in range(rounds):
        rec = storage.read_json(L.round_record(r))
        for w in rec["merged"]:
            if (read_manifest(storage, L.contribution(r, w)) or {}).get("digest") != rec["contrib_digest"][str(w)]:
                problems.append(f"round {r}: worker {w}'s contribution changed since it was merged")
        for f in rec.get("folded", []):
            if (read_manifest(storage, f["source"]) or {}).get("digest") != f["source_digest"]:
                problems.append(f"round {r}: the late contribution {f['source']} changed since it was folded")
            if f["base"] != L.global_weights(f["from_round"]):
                problems.append(f"round {r}: folded {f['source']} was trained from {f['base']}, not a global checkpoint")
            rebase(storage, _g(r), f["source"], _g(f["from_round"]), _folded(r, f))
        # the same inputs in the same order as the run: a float sum depends on it (merge/rounds.py)
        contribs, problem = recorded_inputs(rec, fold_key=lambda f: _folded(r, f))
        if problem:
            problems.append(f"round {r}: {problem}")
        res = merge_round(storage, _g(r), contribs, _g(r + 1), cfg.outer, state_in_key=_s(r) if r > 0 else None,
                          state_out_key=_s(r + 1), min_inputs=len(contribs), metadata=metadata,
                          manifest={"round": r + 1})
        same = res.manifest["digest"] == rec["global_digest"] == read_manifest(storage, L.global_weights(r + 1))["digest"]
        out.append({"round": r, "inputs": len(contribs), "identical": same})
        if not same:
            problems.append(f"round {r}: replayed global_{r + 1} differs from the run's")
    return {"identical": not problems and all(x["identical"] for x in out), "rounds": out, "problems": problems}
