"""Who may drive a run: one merge service at a time, fenced, in a directory nobody else can steer.

The lease lives in storage, like everything else (no server):

    lease/epoch_00003.json   created exclusively by whoever takes epoch 3, never rewritten: one
                             winner per epoch, and a record of who took the run from whom and why
    lock.json                the holder's epoch, pid, host and heartbeat, renewed every HEARTBEAT_S

A service holding epoch N is *fenced* once lease/epoch_{N+1} exists: every commit it makes (the
new global, the outer state, a round record, jobs.json; anything written through the Storage that
`Lease.storage` returns) first checks that file, and a fenced service stops before that commit,
naming who took the run. The check and the rename that follows it are two operations: a takeover
landing between them (microseconds, and only once the holder looks dead or someone forced it)
lets one last commit through; object stores offer no conditional rename for it either (S3's
conditional writes guard creation, which the epoch files use, not replacement).

A lease lapses when its holder's process is gone (same host) or its heartbeat is older than
STALE_S (clocks of a Slurm cluster agree within seconds: munge refuses credentials otherwise).
`--force` takes a live lease, loudly; nothing takes one silently.
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from typing import Any

from core import trust
from core.errors import RunError
from core.layout import RunLayout
from core.storage import Storage
from core.records import number, text

log = logging.getLogger(__name__)
L = RunLayout()
HEARTBEAT_S = 10.0
"""How often the holder renews lock.json's heartbeat."""
STALE_S = 60.0
"""A heartbeat this old means its service is gone: the lease may be taken without --force."""
LAPSING_S = 2 * HEARTBEAT_S
"""A heartbeat older than this (missed beats) is waited for until STALE_S rather than refused at once."""


class LeaseLost(RunError):
    """This service's lease was taken: it must not commit anything more."""


class Lease:
    """Epoch `epoch` of a run's lease, held by this process; renewed by a daemon thread."""

    def __init__(self, storage: Storage, epoch: int) -> None:
        self.base, self.epoch = storage, epoch
        self.lost: str | None = None
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._renew, name="lease-heartbeat", daemon=True)
        self._thread.start()

    @property
    def storage(self) -> Storage:
        """The run's storage, fenced: each commit first checks that this lease still holds."""
        return self.base.fenced(self.check)

    def check(self, key: str = "") -> None:
        if self.lost is None and self.base.exists(L.lease_epoch(self.epoch + 1)):
            self.lost = _taken_by(self.base, self.epoch + 1)
        if self.lost is not None:
            what = f" before writing {key}" if key else ""
            raise LeaseLost(f"{self.base.display()} was taken over {self.lost}; this merge service (epoch {self.epoch}) "
                            f"stops{what}. The other service drives the run now: follow it with "
                            f"`orchestrate status {self.base.display()}`")

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        held = _read(self.base, L.LOCK)
        if self.lost is None and held.get("epoch") == self.epoch and not self.base.exists(L.lease_epoch(self.epoch + 1)):
            self.base.remove(L.LOCK)

    def _beat(self) -> None:
        self.base.write_json(L.LOCK, {**_me(), "epoch": self.epoch, "heartbeat_at": time.time(),
                                      "heartbeat_s": HEARTBEAT_S})

    def _renew(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.check()
                self._beat()
            except LeaseLost as exc:
                log.error("%s", exc)
                return
            except Exception as exc:  # noqa: BLE001 - a storage hiccup: the next beat tries again
                log.warning("lease: could not renew the heartbeat of %s: %s", self.base.display(L.LOCK), exc)


def acquire(storage: Storage, *, force: bool = False, wait_s: float = 0.0) -> Lease:
    """Take the run's lease: free, lapsed, or (with force) from a live holder. A holder whose
    heartbeat has missed beats is waited for until it lapses or beats again; with `wait_s`, any
    holder is waited for that long (a requeued service job whose earlier self just died elsewhere)."""
    until = time.monotonic() + wait_s
    while True:
        held = _read(storage, L.LOCK)
        epoch = _latest_epoch(storage, held)
        holder = _holder(storage, held, epoch)
        why = _lapsed(holder)
        if holder and why is None and not force:
            age = time.time() - float(holder.get("heartbeat_at") or 0)
            if age < LAPSING_S and time.monotonic() >= until:
                raise RunError(f"another merge service (pid {holder.get('pid')} on {holder.get('host')}, epoch {epoch}, "
                               f"heartbeat {age:.0f}s ago) drives {storage.display()}; stop it first, or pass --force "
                               "to take the run from it (it stops before its next commit)")
            log.warning("the merge service holding %s (pid %s on %s) beat %.0fs ago: waiting for its lease to "
                        "lapse (after %.0fs without a beat)", storage.display(), holder.get("pid"), holder.get("host"),
                        age, STALE_S)
            time.sleep(min(HEARTBEAT_S / 2, max(0.1, STALE_S - age)))
            continue
        reason = "free" if not holder else why or "forced with --force"
        if holder and why is None:
            log.warning("taking the run from a live merge service (pid %s on %s, epoch %d): it stops before its "
                        "next commit", holder.get("pid"), holder.get("host"), epoch)
        claim = {**_me(), "at": time.time(), "reason": reason,
                 "took_from": {k: holder.get(k) for k in ("pid", "host", "epoch")} if holder else None}
        if not storage.create_exclusive(L.lease_epoch(epoch + 1), json.dumps(claim).encode()):
            raise RunError(f"another merge service took {storage.display()} at this very moment "
                           f"{_taken_by(storage, epoch + 1)}; let it drive the run")
        if holder:
            log.warning("took the run lease from pid %s on %s (%s)", holder.get("pid"), holder.get("host"), reason)
        return Lease(storage, epoch + 1)


def driven(storage: Storage) -> bool:
    """Whether a merge service holds the run now (its lease taken, its heartbeat fresh, its process
    alive where this machine can tell); False once it stopped, however it stopped."""
    held = _read(storage, L.LOCK)
    holder = _holder(storage, held, _latest_epoch(storage, held))
    return bool(holder) and _lapsed(holder) is None


def _latest_epoch(storage: Storage, held: dict[str, Any]) -> int:
    epochs = [int(m.group(1)) for n in storage.list(L.LEASE) if (m := re.fullmatch(r"epoch_(\d+)\.json", n))]
    mine = held.get("epoch", 0)
    return max(epochs + [mine if isinstance(mine, int) else 0])


def _holder(storage: Storage, held: dict[str, Any], epoch: int) -> dict[str, Any]:
    """Who holds the lease ({} when free: a holder removes lock.json when it stops). A lock.json
    older than the latest epoch (a taker that died before writing its own) stands for that epoch's
    claimer, with the claim's time as its last heartbeat; one written before epochs existed beats
    at `since`."""
    if not held:
        return {}
    if held.get("epoch", 0) >= epoch:
        return {**held, "heartbeat_at": held.get("heartbeat_at", held.get("since"))}
    claim = _read(storage, L.lease_epoch(epoch))
    return {**claim, "epoch": epoch, "heartbeat_at": claim.get("at")}


def _lapsed(holder: dict[str, Any]) -> str | None:
    """Why the holder's lease has lapsed, or None while it holds."""
    if not holder:
        return None
    if holder.get("host") == socket.gethostname():
        try:
            os.kill(int(holder.get("pid", -1)), 0)
        except ProcessLookupError:
            return f"its process {holder.get('pid')} is gone"
        except (PermissionError, ValueError, TypeError):
            pass
    age = time.time() - float(holder.get("heartbeat_at") or 0)
    return f"no heartbeat for {age:.0f}s" if age >= STALE_S else None


def _taken_by(storage: Storage, epoch: int) -> str:
    c = _read(storage, L.lease_epoch(epoch))
    return (f"by pid {c.get('pid')} on {c.get('host')} at {time.strftime('%H:%M:%S', time.localtime(c.get('at') or 0))} "
            f"(epoch {epoch}, {c.get('reason')})")


_FIELDS = {"pid": int, "epoch": int, "host": str, "reason": str, "heartbeat_at": float, "at": float, "since": float}


def _read(storage: Storage, key: str) -> dict[str, Any]:
    """lock.json or an epoch's claim, checked: each field of the right type and range kept (times finite
    and not past tomorrow, text printable and short), anything else dropped as if absent. A damaged
    heartbeat then proves no live holder: a NaN one made every resume wait for ever."""
    try:
        value = json.loads(storage.read_bytes(key, limit=1 << 16))
    except (FileNotFoundError, UnicodeDecodeError, ValueError, RecursionError):
        return {}
    if not isinstance(value, dict):
        return {}
    out: dict[str, Any] = {}
    for name, kind in _FIELDS.items():
        v = value.get(name)
        if kind is int and type(v) is int and 0 <= v < 1 << 40:
            out[name] = v
        elif kind is float and number(v) is not None and 0 <= v <= time.time() + 86400:
            out[name] = float(v)
        elif kind is str and isinstance(v, str):
            out[name] = text(v, 256)
    return out


def _me() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}


# -- who else can write the run -------------------------------------------------------------------
def unsafe_paths(storage: Storage, *, allow_group: bool = False) -> list[str]:
    """Each part of a local run that someone else could change (core.trust): whoever can write
    config.yaml (executor.setup is a shell line), jobs/ (the scripts Slurm runs) or the folder
    holding them runs commands as the run's owner."""
    return trust.unsafe_paths(storage, ("", L.CONFIG, L.LOCK, L.JOBS), allow_group=allow_group)


def refuse_unsafe(storage: Storage, *, allow_group: bool = False) -> None:
    loose = unsafe_paths(storage, allow_group=allow_group)
    if loose:
        raise RunError("others can steer this run (anyone who can write its config or job scripts runs commands as "
                       "you):\n  " + "\n  ".join(loose) + "\nfix the modes above, or, for a directory your Unix group "
                       "shares on purpose, pass --allow-group-write (every member of the group can then run "
                       "commands as you through the run)")
