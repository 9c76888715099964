"""Checkpoint manifests: the JSON file written after a checkpoint's data, which makes it whole.

A manifest comes from shared storage that any worker, or anyone else with write access, may have
written, so every field islands reads from one is checked before use; a bad one raises a
CheckpointError saying what is wrong and how to recover (delete it, so it is written again).
"""
from __future__ import annotations

import json
import logging
import math
import posixpath
import re
from collections.abc import Callable
from typing import Any

from core.errors import CheckpointError
from core.layout import manifest_key
from core.storage import Storage

log = logging.getLogger(__name__)

HASH = "xxh3_128"
"""The digest of every checkpoint islands writes (manifest fields `hash` and `digest`): it guards
against accidents (a truncated copy, a flipped bit, a half-written file), not against an attacker,
who could rewrite the manifest too (docs/benchmarks.md, Merge, for why XXH3)."""
DIGEST_HEX = 32
OLD_HASHES = ("blake3", "sha256")
"""What islands 0.1 hashed with before 2026-11-24: such a run directory is refused, naming it."""


def read_manifest(storage: Storage, key: str, label: str = "", *, plain: bool = False) -> dict[str, Any] | None:
    """The manifest of checkpoint `key`, or None when there is none (not yet, or never, whole).

    Everything in it is checked (check_manifest) before anyone uses it: it comes from shared
    storage that any worker, or anyone else with write access, may have written. `plain`: `key` is
    a safetensors file from elsewhere (`orchestrate merge`'s inputs), whose neighbour `X.json` may
    be anything: one that is not a manifest of ours (no digest) is ignored, not refused."""
    label = label or storage.display(key)
    try:
        raw = storage.read_bytes(manifest_key(key), limit=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None
    except CheckpointError as exc:  # too big, or not a regular file
        raise CheckpointError(f"manifest of {label}: {exc}") from None
    m = parse_manifest(raw, label)
    if plain and not (isinstance(m, dict) and ("digest" in m or "sha256" in m)):  # sha256: refused below, named
        log.warning("%s: ignoring %s, which is not a manifest (no digest)", label, manifest_key(key))
        return None
    return check_manifest(m, label, key)


def parse_manifest(raw: bytes, label: str) -> Any:
    """JSON of at most MAX_MANIFEST_BYTES, nested at most a few levels; CheckpointError otherwise."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"manifest of {label} is {len(raw)} bytes, over the limit of {MAX_MANIFEST_BYTES}: "
                              "not written by islands; delete it and its checkpoint")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise CheckpointError(f"manifest of {label} is damaged: not valid JSON ({type(exc).__name__}: "
                              f"{str(exc)[:200]}); delete it so the checkpoint is rewritten") from None


def check_manifest(m: Any, label: str, key: str | None = None) -> dict[str, Any]:
    """Validate every field islands reads from a manifest; return it, or raise one CheckpointError
    listing every problem. Ids and rounds are small non-negative integers, digests are lowercase hex
    of their hash's length, names are plain file names of this checkpoint (no folders, no `..`),
    keys are relative paths inside the run (no absolute paths, no `..`, no URLs); other fields are
    free but size-limited."""
    if not isinstance(m, dict):
        raise CheckpointError(f"manifest of {label} is not a JSON object ({type(m).__name__}); delete it so the "
                              "checkpoint is rewritten")
    old = m.get("hash") if m.get("hash") in OLD_HASHES else "sha256" if "sha256" in m and "digest" not in m else None
    if old:
        raise CheckpointError(
            f"manifest of {label} names hash {old}: it was written "
            f"by islands 0.1 before 2026-11-24, and islands 0.2 reads only {HASH} manifests; finish that run with the "
            "islands that began it, or start it again")
    if "digest" not in m:
        raise CheckpointError(f"manifest of {label} lacks a digest; delete it so the checkpoint is rewritten")
    problems = []
    for name, check in _MANIFEST_FIELDS.items():
        if m.get(name) is not None and (why := check(m[name])):
            problems.append(f"{name} {str(m[name])[:80]!r} {why}")
    if not _hash_name(m.get("hash", HASH)) and not _digest(m["digest"]) and len(m["digest"]) != DIGEST_HEX:
        problems.append(f"digest has {len(m['digest'])} hex digits where {HASH} has {DIGEST_HEX}")
    if key is not None and isinstance(m.get("file"), str) and m["file"] != posixpath.basename(key):
        problems.append(f"file {m['file'][:80]!r} is not this checkpoint's name {posixpath.basename(key)!r}")
    if problems:
        raise CheckpointError(f"manifest of {label} is invalid: " + "; ".join(problems) + "; it was not written by "
                              "islands or was damaged: delete it and its checkpoint so the worker writes them again")
    return m


def _int_in(lo: int, hi: int) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        return "" if isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi else f"is not an integer in [{lo}, {hi}]"
    return check


def _number(v: Any) -> str:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    return "" if ok else "is not a finite number >= 0"


def _digest(v: Any) -> str:
    return "" if isinstance(v, str) and _HEX.fullmatch(v) else "is not a digest (32 or 64 lowercase hex digits)"


def _hash_name(v: Any) -> str:
    return "" if v == HASH else f"is not {HASH}, the only hash islands writes"


def _file_name(v: Any) -> str:
    return "" if isinstance(v, str) and _NAME.fullmatch(v) and v not in (".", "..") else \
        "is not a plain file name (letters, digits, . _ -; no folders)"


def _run_key(v: Any) -> str:
    """A key inside the run directory: relative, '/'-separated, no '..', no URL, no backslash."""
    ok = (isinstance(v, str) and 0 < len(v) <= 1024 and not v.startswith("/") and "://" not in v and "\\" not in v
          and all(_NAME.fullmatch(part) and part not in (".", "..") for part in v.split("/")))
    return "" if ok else "is not a relative path inside the run directory"


def _overlap(v: Any) -> str:
    """round.overlap's record in a contribution's manifest (worker/train.py publish)."""
    if not isinstance(v, dict):
        return "is not an object"
    for key, check in (("adopted_at_step", _int_in(0, 1 << 40)), ("ahead_s", _number)):
        if v.get(key) is not None and (why := check(v[key])):
            return f"has {key} that {why}"
    return ""


_HEX = re.compile(r"[0-9a-f]{32}|[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
MAX_ID = 1 << 20
"""Largest worker id, round or step count a manifest may name."""
MAX_MANIFEST_BYTES = 16 << 20
"""A manifest is small (the longest part is a round's per-step losses): anything bigger is refused unread."""
_MANIFEST_FIELDS: dict[str, Callable[[Any], str]] = {
    "hash": _hash_name, "digest": _digest, "base_digest": _digest, "source_digest": _digest, "file": _file_name, "base": _run_key,
    "round": _int_in(0, MAX_ID), "worker": _int_in(0, MAX_ID), "from_round": _int_in(0, MAX_ID),
    "attempt": _int_in(0, MAX_ID), "steps": _int_in(0, 1 << 40), "steps_done": _int_in(0, 1 << 40), "adopted_at_step": _int_in(0, 1 << 40),
    "tensors": _int_in(0, 1 << 32), "bytes": _int_in(0, 1 << 50), "tokens": _number, "waited_s": _number, "trained_s": _number, "ahead_s": _number,
    "written_at": _number, "overlap": _overlap, "io_read": _int_in(0, 1 << 60), "io_written": _int_in(0, 1 << 60),
    "base_s": _number, "base_at": _number,
}
