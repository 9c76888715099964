"""The service's own JSON records in a run directory, planted or damaged: each read through a checked
loader (orchestrator/lease.py `_read` for lock.json and the lease epochs), never a hang or a traceback.
Real files, the real lease."""
from __future__ import annotations

import json
import threading

import pytest

from core.layout import RunLayout
from core.storage import Storage
from orchestrator.lease import acquire

L = RunLayout()


def _acquire_within(s: Storage, seconds: float):
    """The lease, or a failure if taking it blocks longer than `seconds` (a NaN heartbeat made it wait for ever)."""
    got: list = []
    t = threading.Thread(target=lambda: got.append(acquire(s)), daemon=True)
    t.start()
    t.join(seconds)
    assert got, f"acquire() still waiting after {seconds}s"
    return got[0]


@pytest.mark.parametrize("lock", [
    b'{"pid": 1, "host": "elsewhere", "epoch": 1, "heartbeat_at": NaN}',
    b'{"pid": 1, "host": "elsewhere", "epoch": 1, "heartbeat_at": Infinity}',
    b'{"pid": 1, "host": "elsewhere", "epoch": 1, "heartbeat_at": 1e300}',
    b'{"pid": 1, "host": "elsewhere", "epoch": 1, "heartbeat_at": "now"}',
    b'{"pid": 1, "host": "elsewhere", "epoch": 1, "heartbeat_at": [1, 2]}',
    b'{"pid": "1", "host": ["x"], "epoch": "one", "heartbeat_at": null}',
    b'[1, 2, 3]',
    b'{"epoch": 1' + b"[" * 5000,
])
def test_a_damaged_lock_is_no_live_holder(tmp_path, lock):
    s = Storage(str(tmp_path / "run"))
    s.write_bytes(L.LOCK, lock)
    lease = _acquire_within(s, 20)
    assert lease.epoch >= 1
    lease.release()


def test_a_damaged_epoch_claim_is_no_live_holder(tmp_path):
    s = Storage(str(tmp_path / "run"))
    s.write_bytes(L.lease_epoch(3), json.dumps({"pid": 1, "host": "elsewhere", "at": float("nan")}).encode())
    lease = _acquire_within(s, 20)
    assert lease.epoch == 4
    lease.release()


def test_a_live_holder_is_named_without_its_planted_escape_sequences(tmp_path):
    from core.errors import RunError
    s = Storage(str(tmp_path / "run"))
    held = acquire(s)
    raw = s.read_json(L.LOCK)
    s.write_bytes(L.LOCK, json.dumps({**raw, "host": "evil\x1b]0;pwned\x07\x1b[2J"}).encode())
    with pytest.raises(RunError) as info:
        acquire(s)
    assert "\x1b" not in str(info.value) and "\x07" not in str(info.value) and "evil]0;pwned[2J" in str(info.value)
    held.release()
