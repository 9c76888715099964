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


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))  # 9^9 values expanded


@pytest.mark.parametrize("yaml_text, says", [
    (BOMB, "aliases are expanded"),
    ("inner: !!python/object/apply:os.system [echo hi]\n", "a config takes no tags"),
    ("inner: !custom 1\n", "a config takes no tags"),
    ("inner: " + "[" * 200 + "]" * 200 + "\n", "nested deeper"),
])
def test_hostile_yaml_is_one_config_error_everywhere_it_is_read(tmp_path, capsys, yaml_text, says):
    from orchestrator.cli import main
    (tmp_path / "c.yaml").write_text(yaml_text)
    assert main(["submit", "--config", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "r1")]) == 2
    assert says in capsys.readouterr().out and not (tmp_path / "r1").exists()
    value = yaml_text.split(":", 1)[1].strip() if not yaml_text.startswith("a:") else "&a [1, 1]"
    assert main(["submit", "--set", f"inner.lr={value}", "--run-dir", str(tmp_path / "r2")]) == 2
    assert "Traceback" not in capsys.readouterr().out
    run = tmp_path / "planted"
    run.mkdir(mode=0o700)
    (run / "config.yaml").write_text(yaml_text)
    for command in (["status", str(run)], ["resume", str(run)]):
        assert main(command) == 2
        out = capsys.readouterr().out
        assert says in out and "Traceback" not in out


@pytest.mark.parametrize("args, says", [
    (["--workers", "100000", "--executor", "local"], "workers must be at most 4096"),
    (["--workers", "400", "--executor", "local"], "400 local workers would start 400 processes"),
    (["--set", "round.poll_s=.inf"], "round.poll_s must be a finite number, got inf"),
    (["--set", "inner.lr=.nan"], "inner.lr must be a finite number"),
    (["--set", "model.block_size=1000000000000"], "more than any model this runs"),
])
def test_numbers_that_would_exhaust_the_machine_are_refused_before_anything_is_made(tmp_path, capsys, args, says):
    from orchestrator.cli import main
    assert main(["submit", *args, "--run-dir", str(tmp_path / "run")]) == 2
    out = capsys.readouterr().out
    assert says in out and "Traceback" not in out and not (tmp_path / "run").exists()
