"""The verdicts of a chaos run (bench/chaos.py), read from its run directory and a clean run's.

Each injected fault has its own check, which fails when that fault was not survived; the whole run
is compared with a clean run of the same seed and config by re-hashing every published global
checkpoint and the final model (their bytes, not the digests the service recorded).
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from core.checkpoint import load_checkpoint, read_manifest
from core.layout import RunLayout
from core.storage import Storage

L = RunLayout()
EXPECT = {"corrupt": "checksum does not match", "nan": "NaN or Inf", "shape": "is F32[",
          "fifo": "named pipe (FIFO)", "symlink": "symbolic link"}
"""What a rejection of each kind of planted file must say."""


def file_hash(s: Storage, key: str) -> str | None:
    """SHA-256 of the bytes stored under `key` (None if absent): independent of the service's digests."""
    if not s.exists(key):
        return None
    h = hashlib.sha256()
    with s.open_read(key) as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def compare_runs(run: Storage, clean: Storage, rounds: int) -> list[str]:
    """Where the run's published weights differ from the clean run's, bit for bit ([] if nowhere)."""
    keys = [L.global_weights(r) for r in range(rounds + 1)] + [L.FINAL]
    hashes = {key: (file_hash(run, key), file_hash(clean, key)) for key in keys}  # each file read once
    return [f"{key}: {mine} != clean {theirs}" for key, (mine, theirs) in hashes.items() if mine is None or mine != theirs]


def invalid_merges(storage: Storage, rounds: int) -> list[str]:
    """Every merged contribution that is not whole, finite and shaped like the model."""
    ref = load_checkpoint(storage, L.global_weights(0))[0]
    problems = []
    for r in range(rounds):
        rec = storage.read_json(L.round_record(r)) or {}
        for w in rec.get("merged", []):
            key = L.contribution(r, w)
            try:
                tensors = load_checkpoint(storage, key)[0]  # digest verified against the manifest
            except Exception as exc:  # noqa: BLE001 - any failure is a finding, reported with its key
                problems.append(f"round {r} worker {w}: {key} unreadable: {exc}")
                continue
            if set(tensors) != set(ref) or any(tensors[n].shape != ref[n].shape for n in ref):
                problems.append(f"round {r} worker {w}: {key} does not match the model's tensors")
            elif not all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point()):
                problems.append(f"round {r} worker {w}: {key} has NaN or Inf")
    return problems


def _jobs(s: Storage, r: int, w: int) -> dict[str, Any]:
    return ((s.read_json(L.round_jobs(r)) or {}).get("workers", {})).get(str(w), {})


def cancelled_job_survived(s: Storage, r: int, w: int, job: str) -> tuple[bool, str]:
    """The cancelled job was noted lost and a later attempt's contribution merged in its round."""
    e, rec = _jobs(s, r, w), s.read_json(L.round_record(r)) or {}
    noted = any(f.get("job_id") == job for f in e.get("failures", []))
    later = e.get("job_ids", [job])[-1] != job
    ok = noted and later and w in rec.get("merged", [])
    return ok, f"noted lost: {noted}; resubmitted as {e.get('job_ids', [])[1:]}; merged: {w in rec.get('merged', [])}"


def delivered_before(s: Storage, r: int, w: int, fault: dict[str, Any]) -> bool:
    """Whether the cancelled job published its contribution before it ended: it is still the
    worker's last job and its contribution is there. Slurm's scancel ends a job with SIGTERM, which
    submitit's tasks ignore, and SIGKILL KillWait later (30 s by default, 5 s on the local cluster):
    a job may publish in between."""
    e = _jobs(s, r, w)
    return e.get("job_ids", [None])[-1] == fault["job"] and read_manifest(s, L.contribution(r, w)) is not None


def planted_file_survived(s: Storage, r: int, w: int, kind: str, digest: str | None) -> tuple[bool, str]:
    """Rejected for the right reason, set aside, never merged; the worker's real work merged instead."""
    rec = s.read_json(L.round_record(r)) or {}
    why = " | ".join([rec.get("rejected_reasons", {}).get(str(w), "")]
                     + [f.get("rejected", "") for f in _jobs(s, r, w).get("failures", [])]).strip(" |")
    merged_it = digest is not None and rec.get("contrib_digest", {}).get(str(w)) == digest
    ok = EXPECT[kind] in why and not merged_it and w in rec.get("merged", [])
    return ok, why[:160]


def poisoned_file_survived(s: Storage, r: int, w: int, digest: str) -> tuple[bool, str]:
    """A well-formed contribution with the wrong weights: nothing in it says so, and only the
    comparison with the clean run can tell. Survived only if it was not merged."""
    rec = s.read_json(L.round_record(r)) or {}
    merged_it = rec.get("contrib_digest", {}).get(str(w)) == digest
    return not merged_it, "merged (well-formed, undetectable by the service)" if merged_it else "not merged"


def slow_worker_survived(s: Storage, w: int, rounds: int, deadline_s: float) -> tuple[bool, str]:
    """Waited for, as configured (the quorum is every worker): in every round it published after
    the deadline had passed, and the merge started after it had published and merged it."""
    waited = 0
    for r in range(rounds):
        rec = s.read_json(L.round_record(r)) or {}
        at = (read_manifest(s, L.contribution(r, w)) or {}).get("written_at") or 0.0
        late = at - rec.get("submitted_at", at) > deadline_s
        waited += bool(late and w in rec.get("merged", []) and rec.get("merge_started_at", 0) >= at)
    return waited == rounds, f"published past the {deadline_s:g}s deadline and merged in {waited}/{rounds} rounds"


def kill_survived(s: Storage, clean: Storage, r: int, snapshot: dict[int, Any]) -> tuple[bool, str]:
    """The committed records untouched by the resumed service, and the round being merged when it
    died (the one at risk of being applied twice) published the clean run's bytes."""
    unchanged = all(strip(s.read_json(L.round_record(q))) == snap for q, snap in snapshot.items())
    at_risk = L.global_weights(r + 1)
    same = file_hash(s, at_risk) is not None and file_hash(s, at_risk) == file_hash(clean, at_risk)
    return unchanged and same, f"earlier records unchanged: {unchanged}; global_{r + 1} as in the clean run: {same}"


def strip(rec: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (rec or {}).items() if k != "eval_loss"}


def counts(s: Storage, rounds: int) -> tuple[int, int]:
    """(contributions merged, contributions rejected) over the run, set-aside ones included."""
    accepted = rejected = 0
    for r in range(rounds):
        rec = s.read_json(L.round_record(r)) or {}
        accepted += len(rec.get("merged", []))
        for e in ((s.read_json(L.round_jobs(r)) or {}).get("workers", {})).values():
            rejected += sum(1 for f in e.get("failures", []) if "rejected" in f)  # every rejection is set aside
    return accepted, rejected
