"""Storage faults, the run lock and killed writers, injected for real where we can.

Real: a full disk (a 1 MiB tmpfs, as root), processes SIGKILLed mid-write, a lock left by a dead
process. Simulated at the fsspec boundary: transient I/O errors and a slow shared filesystem.
Figures and the fault matrix: docs/reliability.md.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from core.checkpoint import build_header, load_checkpoint, open_checkpoint, read_manifest
from core.checkpoint_writer import write_checkpoint
from core.config import OuterConfig
from core.errors import CheckpointError, RunError, StorageError
from core.layout import RunLayout, manifest_key
from core.storage import Storage, sweep_temporaries
from merge.rounds import Contribution, merge_round
from merge.round_spec import RoundSpec
from merge.manual import ManualMerge, MergeError, manual_merge
from orchestrator import lease as leases
from orchestrator.lease import LeaseLost, acquire
from orchestrator.runstate import arrived_workers

ROOT = Path(__file__).resolve().parent.parent
L = RunLayout()
TENSORS = {f"t{i:02d}": torch.full((64, 64), float(i)) for i in range(4)}


# -- transient errors: retried with back-off, then a clear failure ---------------------------------
def _flaky(monkeypatch, fs, method: str, failures: int | None):
    """Make fs.<method> raise EIO `failures` times (None: forever), then behave."""
    real, calls = getattr(fs, method), []

    def flaky(*a, **k):
        calls.append(time.monotonic())
        if failures is None or len(calls) <= failures:
            raise OSError(errno.EIO, "Input/output error")
        return real(*a, **k)
    monkeypatch.setattr(fs, method, flaky)
    return calls


@pytest.fixture
def slept(monkeypatch) -> list[float]:
    """The back-off sleeps the storage asks for, recorded instead of slept."""
    pauses: list[float] = []
    monkeypatch.setattr("core.storage.time.sleep", pauses.append)
    return pauses


def test_default_back_off_schedule(tmp_path, monkeypatch, slept):
    s = Storage(str(tmp_path / "run"))
    s.write_bytes("x.bin", b"data")
    _flaky(monkeypatch, s.files, "open_fd", None)  # local reads open a descriptor themselves (core.local_files)
    with pytest.raises(StorageError) as info:
        s.read_bytes("x.bin")
    assert slept == [0.2, 0.4, 0.8, 1.6]  # 5 attempts, 3.0 s of back-off before giving up
    assert str(info.value).startswith(f"could not read x.bin in {tmp_path / 'run'} after 5 attempts over ")
    assert str(info.value).endswith(": Input/output error; check that the storage is reachable and retry")


def test_transient_write_errors_are_retried_and_leave_no_temporary(tmp_path, monkeypatch, caplog, slept):
    s = Storage(str(tmp_path / "run"), backoff_s=0.02)
    calls = _flaky(monkeypatch, os, "rename", 2)  # the publishing rename fails twice (NFS server hiccup)
    with caplog.at_level(logging.WARNING, logger="core.storage"):
        s.write_json("a/b.json", {"k": 1})
    assert s.read_json("a/b.json") == {"k": 1} and len(calls) == 3
    assert slept == [0.02, 0.04]  # back-off doubles
    assert "publish a/b.json failed" in caplog.text and "retry 2/4" in caplog.text
    assert os.listdir(tmp_path / "run" / "a") == ["b.json"]


def test_persistent_errors_fail_after_the_retries_with_what_where_how(tmp_path, monkeypatch, slept):
    s = Storage(str(tmp_path / "run"), retries=3, backoff_s=0.02)
    calls = _flaky(monkeypatch, s.fs, "ls", None)
    with pytest.raises(StorageError, match=r"could not list rounds/00000/contrib in .*/run after 4 attempts "
                                           r"over \d+\.\ds: Input/output error; check that the storage is reachable"):
        s.list("rounds/00000/contrib")
    assert len(calls) == 4 and slept == [0.02, 0.04, 0.08]


def test_an_operation_not_permitted_is_reported_at_once(tmp_path, slept):
    """EPERM (here a real immutable file, chattr +i, as root) is no fault a retry can fix."""
    import shutil
    import subprocess
    s = Storage(str(tmp_path / "run"))
    s.write_json("a.json", {"k": 1})
    target = tmp_path / "run" / "a.json"
    if os.geteuid() != 0 or shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(target)]).returncode:
        pytest.skip("making a file immutable needs root and chattr on a filesystem that has the attribute")
    try:
        with pytest.raises(StorageError, match=r"could not publish a.json in .*: Operation not permitted; the "
                                               r"operation is not permitted: check the run directory's owner"):
            s.write_json("a.json", {"k": 2})
    finally:
        subprocess.run(["chattr", "-i", str(target)], check=True)
    assert slept == []


# -- a real full disk ------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path, mount_tmpfs):
    """A 1 MiB tmpfs mounted for the test (needs root); unmounted afterwards."""
    return mount_tmpfs(tmp_path / "disk")


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_checkpoint_bigger_than_the_disk(small_disk, slept):
    s = Storage(str(small_disk / "run"))
    key = L.contribution(0, 1)
    big = {"w": torch.zeros(512 * 1024)}  # 2 MiB of float32 on a 1 MiB disk
    with pytest.raises(StorageError, match=r"could not write checkpoint rounds/00000/contrib/worker_001.safetensors "
                                           r"in .*: No space left on device; the disk is full: free space on it, "
                                           r"then try again \(a run: `orchestrate resume` it\)"):
        write_checkpoint(s, key, big, manifest={"round": 0, "worker": 1})
    assert slept == []  # reported at once: no retry can free space
    assert os.listdir(small_disk / "run" / "rounds" / "00000" / "contrib") == []  # no temporary, no manifest
    assert s.list(L.contributions_dir(0)) == [] and arrived_workers(s, 0) == []
    with pytest.raises(CheckpointError, match="no manifest"):
        open_checkpoint(s, key)
    assert _free_bytes(small_disk) == 1 << 20  # every byte given back


def test_disk_full_at_the_manifest_publishes_nothing_and_resumes(small_disk):
    s = Storage(str(small_disk / "run"))
    key = L.contribution(0, 1)
    s.fs.makedirs(s.path(L.contributions_dir(0)))  # folders first: only the file's pages count below
    # A checkpoint that takes exactly the space left: its data lands, its manifest cannot.
    free = fill = _free_bytes(small_disk)
    for _ in range(3):
        fill = free - len(build_header([("w", "U8", (fill,), fill)], None)[0])
    with pytest.raises(StorageError, match="disk is full.*orchestrate resume"):
        write_checkpoint(s, key, {"w": torch.zeros(fill, dtype=torch.uint8)}, manifest={"round": 0, "worker": 1})
    names = os.listdir(small_disk / "run" / "rounds" / "00000" / "contrib")
    assert names == ["worker_001.safetensors"]  # whole data, but no manifest and no temporary
    assert read_manifest(s, key) is None and arrived_workers(s, 0) == []
    with pytest.raises(CheckpointError, match="no manifest"):
        load_checkpoint(s, key)
    # Free the space and do it again (what `orchestrate resume` does): the rewrite publishes.
    s.remove(key)
    write_checkpoint(s, key, {"w": torch.zeros(fill // 2, dtype=torch.uint8)}, manifest={"round": 0, "worker": 1})
    assert arrived_workers(s, 0) == [1]


def test_merge_output_bigger_than_the_disk_leaves_nothing(tmp_path, small_disk):
    """A full disk fails the merge naming the output, and gives every byte back."""
    inputs = []
    for i in range(2):
        write_checkpoint(Storage(str(tmp_path)), f"in{i}.safetensors", {"w": torch.full((512 * 1024,), float(i))})
        inputs.append(str(tmp_path / f"in{i}.safetensors"))  # 2 MiB each, for a 1 MiB disk
    with pytest.raises(MergeError, match=r"merged\.safetensors.*No space left on device"):
        manual_merge(ManualMerge(inputs, str(small_disk / "out" / "merged.safetensors")))
    assert os.listdir(small_disk / "out") == []  # no temporary, no output
    assert _free_bytes(small_disk) == 1 << 20


# -- a slow shared filesystem ----------------------------------------------------------------------
class LaggyListingFS(LocalFileSystem):
    """Simulates NFS attribute caching (acdirmin/acregmin): a file that appears on the server is
    invisible to this client (listing, exists, open, cat) until `lag` polls after it first could
    have been seen. `tick()` is one poll of the reader."""

    cachable = False  # a fresh instance (fresh caches) per test, not fsspec's shared one

    def __init__(self, lag: int) -> None:
        super().__init__()
        self.lag, self.now, self.first_seen = lag, 0, {}

    def tick(self) -> None:
        self.now += 1

    def _visible(self, path: str) -> bool:
        path = self._strip_protocol(path)
        if not os.path.exists(path):
            return False
        seen = self.first_seen.setdefault(path, self.now)
        return self.now - seen >= self.lag

    def ls(self, path, detail=False, **kwargs):
        out = super().ls(path, detail=detail, **kwargs)
        return [e for e in out if self._visible(e["name"] if detail else e)]

    def exists(self, path, **kwargs):
        return self._visible(path)

    def cat_file(self, path, *a, **k):
        if not self._visible(path):
            raise FileNotFoundError(path)
        return super().cat_file(path, *a, **k)

    def _open(self, path, mode="rb", *a, **k):
        if "r" in mode and not self._visible(path):
            raise FileNotFoundError(path)
        return super()._open(path, mode, *a, **k)


def test_files_appearing_late_do_not_break_manifest_readers(tmp_path):
    writer = Storage(str(tmp_path / "run"))
    reader = Storage(str(tmp_path / "run"))
    reader.fs = LaggyListingFS(lag=3)
    key = L.contribution(0, 2)
    write_checkpoint(writer, L.contribution(0, 0), TENSORS, manifest={"round": 0})

    seen: list[list[int]] = []
    for poll in range(10):
        reader.fs.tick()
        if poll == 1:  # worker 2's data lands; its manifest comes 3 polls later
            with writer.open_atomic(key) as f:
                f.write(writer.read_bytes(L.contribution(0, 0)))
        if poll == 4:  # the same bytes, so worker 0's manifest with worker 2's file name
            m = writer.read_json(manifest_key(L.contribution(0, 0)))
            writer.write_json(manifest_key(key), {**m, "file": key.rsplit("/", 1)[-1]})
        arrived = arrived_workers(reader, 0)
        seen.append(arrived)
        for w in arrived:  # whatever a reader takes for arrived is whole
            load_checkpoint(reader, L.contribution(0, w))
    # Worker 0 shows 3 polls late; worker 2's data is visible from poll 4 but it counts only once
    # its manifest is (poll 7): a reader that trusts manifests waits, it never reads too early.
    assert seen == [[], [], [], [0], [0], [0], [0], [0, 2], [0, 2], [0, 2]]


# -- the run's lease (orchestrator.lease) -----------------------------------------------------------
_SECOND_SERVICE = """
import sys
from core.errors import RunError
from core.storage import Storage
from orchestrator.lease import acquire
try:
    acquire(Storage(sys.argv[1]))
except RunError as exc:
    print(exc)
    sys.exit(3)
print("acquired")
"""


def _python(code: str, *args: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, **kw)


def test_second_service_is_refused_naming_pid_host_and_heartbeat(tmp_path):
    s = Storage(str(tmp_path / "run"))
    lease = acquire(s)
    second = _python(_SECOND_SERVICE, s.url)
    out, err = second.communicate(timeout=60)
    assert second.returncode == 3, err
    # the heartbeat's age is timing (a loaded machine starts the second process late): matched as a pattern
    assert re.search(rf"another merge service \(pid {os.getpid()} on {re.escape(socket.gethostname())}, epoch 1, "
                     rf"heartbeat \d+s ago\) drives {re.escape(s.url)}", out) and "--force" in out, out
    held = s.read_json(L.LOCK)
    assert held["pid"] == os.getpid() and held["epoch"] == 1 and s.list(L.LEASE) == ["epoch_00001.json"]
    lease.release()
    assert not s.exists(L.LOCK)


def _dead_pid() -> int:
    """The pid of a real process that has been SIGKILLed and reaped."""
    proc = subprocess.Popen(["sleep", "60"])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return proc.pid


def test_lease_of_a_dead_process_is_taken_over(tmp_path, caplog):
    s = Storage(str(tmp_path / "run"))
    live = subprocess.Popen(["sleep", "60"])
    try:  # a lock.json from before epochs: its `since` stands for its heartbeat
        s.write_json(L.LOCK, {"pid": live.pid, "host": socket.gethostname(), "since": time.time()})
        with pytest.raises(RunError, match=f"pid {live.pid} on {socket.gethostname()}"):
            acquire(s)
    finally:
        live.kill()
        live.wait()
    s.write_json(L.LOCK, {"pid": _dead_pid(), "host": socket.gethostname(), "since": time.time()})
    with caplog.at_level(logging.WARNING):
        acquire(s).release()
    assert "is gone" in caplog.text
    assert s.read_json(L.lease_epoch(1))["reason"].startswith("its process")


def test_lease_on_another_host_lapses_only_without_heartbeat(tmp_path, caplog):
    s = Storage(str(tmp_path / "run"))
    beat = {"pid": _dead_pid(), "host": "some-other-node", "epoch": 0, "since": 0.0}
    s.write_json(L.LOCK, {**beat, "heartbeat_at": time.time()})
    with pytest.raises(RunError, match="on some-other-node, epoch 0, heartbeat 0s ago.*pass --force"):
        acquire(s)  # its pid means nothing here: only its heartbeat tells
    s.write_json(L.LOCK, {**beat, "heartbeat_at": time.time() - leases.STALE_S - 1})
    with caplog.at_level(logging.WARNING):
        acquire(s).release()  # no heartbeat for a minute: it is gone
    assert "no heartbeat for 61s" in caplog.text
    s.write_json(L.LOCK, {**beat, "epoch": 1, "heartbeat_at": time.time()})
    with caplog.at_level(logging.WARNING):
        lease = acquire(s, force=True)
    assert "taking the run from a live merge service" in caplog.text and lease.epoch == 2
    assert s.read_json(L.LOCK)["host"] == socket.gethostname()
    lease.release()


def test_a_lapsing_heartbeat_is_waited_for(tmp_path, monkeypatch):
    """A holder that missed beats is neither refused at once nor taken at once: waited for until it
    lapses (here: scaled down to 1.5 s), and no longer. The sleeps are recorded as asked for, not
    timed, so that a loaded machine cannot fail the upper bound; the lower bound is counted from
    before the heartbeat was written, which load can only lengthen."""
    monkeypatch.setattr(leases, "STALE_S", 1.5)
    monkeypatch.setattr(leases, "LAPSING_S", 0.5)
    # recorded as the `slept` fixture does, but slept too: the heartbeat lapses only as time passes
    asked: list[float] = []
    sleep = time.sleep
    monkeypatch.setattr("orchestrator.lease.time.sleep", lambda s: (asked.append(s), sleep(s))[1])
    s = Storage(str(tmp_path / "run"))
    t0 = time.monotonic()
    s.write_json(L.LOCK, {"pid": 1, "host": "elsewhere", "epoch": 3, "since": 0.0, "heartbeat_at": time.time() - 0.6})
    lease = acquire(s)
    assert lease.epoch == 4 and time.monotonic() - t0 > 0.8  # it lapses 0.9 s after the write
    assert sum(asked) < leases.STALE_S  # till the lapse, not a beat's interval; none if load let it lapse first
    lease.release()


def test_the_older_service_is_fenced_at_its_next_commit(tmp_path):
    """Two services on one run: the one whose lease was taken writes nothing more, and says who took it."""
    s = Storage(str(tmp_path / "run"))
    old = acquire(s)
    old.storage.write_json("rounds/00000/jobs.json", {"by": "old"})  # while it holds: written
    s.write_json(L.LOCK, {**s.read_json(L.LOCK), "pid": _dead_pid()})  # as if it died: no --force needed
    new = acquire(s)
    assert new.epoch == 2
    for commit in (lambda st: st.write_json("rounds/00000/record.json", {"by": "old"}),
                   lambda st: write_checkpoint(st, "global/round_00001.safetensors", {"w": torch.zeros(2)}),
                   lambda st: st.move("rounds/00000/jobs.json", "elsewhere.json"),
                   lambda st: st.remove("rounds/00000/jobs.json")):
        with pytest.raises(LeaseLost, match=f"taken over by pid {os.getpid()} on {socket.gethostname()} .*epoch 2.*"
                                            "this merge service \\(epoch 1\\) stops before writing"):
            commit(old.storage)
    assert not s.exists("rounds/00000/record.json") and not s.exists("global/round_00001.safetensors")
    assert s.read_json("rounds/00000/jobs.json") == {"by": "old"}
    assert [n for n in os.listdir(tmp_path / "run" / "global")] == []  # no temporary left either
    old.release()  # the fenced one leaves the new holder's lock alone
    assert s.read_json(L.LOCK)["epoch"] == 2
    new.storage.write_json("rounds/00000/record.json", {"by": "new"})
    new.release()
    assert not s.exists(L.LOCK)


def test_heartbeat_renews_and_stops_once_fenced(tmp_path, monkeypatch):
    monkeypatch.setattr(leases, "HEARTBEAT_S", 0.05)
    s = Storage(str(tmp_path / "run"))
    lease = acquire(s)
    first = s.read_json(L.LOCK)["heartbeat_at"]
    time.sleep(0.3)
    assert s.read_json(L.LOCK)["heartbeat_at"] > first
    s.create_exclusive(L.lease_epoch(2), json.dumps({"pid": 1, "host": "h", "at": time.time(), "reason": "test"}).encode())
    s.write_json(L.LOCK, {"pid": 1, "host": "h", "epoch": 2, "heartbeat_at": time.time()})
    time.sleep(0.3)
    assert s.read_json(L.LOCK)["pid"] == 1  # the fenced holder no longer writes its heartbeat over it
    assert lease.lost and "by pid 1 on h" in lease.lost
    lease.release()
    assert s.read_json(L.LOCK)["pid"] == 1


def test_simultaneous_lock_creation_has_one_winner(tmp_path):
    s = Storage(str(tmp_path / "run"))
    barrier, won = threading.Barrier(8), {}

    def contend(i: int) -> None:
        barrier.wait()
        won[i] = s.create_exclusive(L.LOCK, json.dumps({"pid": i}).encode())
    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, w in won.items() if w]
    assert len(winners) == 1 and s.read_json(L.LOCK) == {"pid": winners[0]}
    assert s.list("") == ["lock.json"] and os.listdir(tmp_path / "run") == ["lock.json"]


def test_two_simultaneous_takeovers_of_a_stale_lease_have_one_winner(tmp_path, monkeypatch):
    """Every contender reads the same stale lease and decides to take it; only one may proceed."""
    s = Storage(str(tmp_path / "run"))
    s.write_json(L.LOCK, {"pid": _dead_pid(), "host": socket.gethostname(), "since": time.time()})
    real = leases._lapsed
    n = 6
    barrier, results = threading.Barrier(n), {}

    def slow_lapsed(holder):  # all contenders pass the staleness check before anyone claims
        why = real(holder)
        barrier.wait()
        return why
    monkeypatch.setattr(leases, "_lapsed", slow_lapsed)

    def contend(i: int) -> None:
        try:
            results[i] = acquire(s)
        except RunError as exc:
            results[i] = str(exc)
    threads = [threading.Thread(target=contend, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results.values() if not isinstance(r, str)]
    assert len(winners) == 1, results
    assert all("took " in r and "at this very moment" in r for r in results.values() if isinstance(r, str)), results
    assert s.list(L.LEASE) == ["epoch_00001.json"] and s.read_json(L.LOCK)["epoch"] == 1
    winners[0].release()


def test_sweep_deletes_old_temporaries_only(tmp_path):
    s = Storage(str(tmp_path / "run"))
    old = ["rounds/00001/contrib/.tmp-0123456789ab-worker_000.safetensors", "global/.tmp-aaaaaaaaaaaa-round_00002.json"]
    for key in old + ["jobs/.tmp-bbbbbbbbbbbb-x", "rounds/00001/contrib/.tmp-cccccccccccc-worker_001.safetensors"]:
        (tmp_path / "run" / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "run" / key).write_bytes(b"partial")
    for key in old + ["jobs/.tmp-bbbbbbbbbbbb-x"]:
        os.utime(tmp_path / "run" / key, (time.time() - 7200, time.time() - 7200))
    s.write_bytes("rounds/00001/contrib/worker_002.safetensors", b"whole")
    live, release = threading.Event(), threading.Event()

    def writer():  # a live writer, mid-write, holding its temporary open
        with s.open_atomic("rounds/00001/contrib/worker_003.safetensors") as f:
            f.write(b"half")
            f.flush()
            live.set()
            release.wait(30)
            f.write(b" and the rest")
    t = threading.Thread(target=writer)
    t.start()
    live.wait(10)
    gone = sweep_temporaries(s, 3600, skip=("jobs",))
    release.set()
    t.join()
    assert sorted(gone) == sorted(old)
    left = sorted(p.name for p in (tmp_path / "run").rglob(".tmp-*"))
    assert left == [".tmp-bbbbbbbbbbbb-x", ".tmp-cccccccccccc-worker_001.safetensors"]  # skipped; too young
    assert s.read_bytes("rounds/00001/contrib/worker_003.safetensors") == b"half and the rest"  # never disturbed
    assert s.read_bytes("rounds/00001/contrib/worker_002.safetensors") == b"whole"


# -- a worker killed while writing its checkpoint --------------------------------------------------
_WRITER = """
import sys, time, torch
from core.checkpoint_writer import write_checkpoint
from core.storage import Storage
url, key, phase = sys.argv[1:4]
s = Storage(url)
names = [f"t{i:02d}" for i in range(24)]
specs = [(n, "F32", (128 * 1024,), 512 * 1024) for n in names]  # 24 x 512 KiB = 12 MiB
def stream():
    for i, n in enumerate(names):
        if phase == "mid-write" and i == 12:
            print("half written", flush=True)
            time.sleep(120)
        yield n, torch.full((128 * 1024,), float(i))
real_write_json = s.write_json
def write_json(k, obj):
    if phase == "before-manifest":
        print("data published", flush=True)
        time.sleep(120)
    real_write_json(k, obj)
s.write_json = write_json
write_checkpoint(s, key, specs=specs, stream=stream, manifest={"round": 0, "worker": 1})
print("finished", flush=True)
"""


def _kill_writer_at(url: str, key: str, phase: str, expect: str, env: dict[str, str] | None = None) -> None:
    proc = _python(_WRITER, url, key, phase, env=env)
    try:
        line = proc.stdout.readline().strip()
        assert line == expect, (line, proc.stderr.read() if proc.poll() is not None else "")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(params=["local", "s3"])
def kill_target(request, tmp_path):
    """(Storage, S3 server or None, environment for the writer process): a local directory, S3."""
    if request.param == "local":
        return Storage(str(tmp_path / "run")), None, {}
    s3 = request.getfixturevalue("s3_server")
    # 5 MiB parts (fsspec's config from the environment) so that the killed writer has a multipart
    # upload in flight, not just a buffer in memory.
    env = {**s3.env(), "FSSPEC_S3": json.dumps({"default_block_size": 5 << 20})}
    return s3.storage(f"killed-{tmp_path.name}"), s3, env


def test_worker_killed_mid_write_publishes_nothing(kill_target):
    s, s3, env = kill_target
    key = L.contribution(0, 1)
    _kill_writer_at(s.url, key, "mid-write", "half written", env)
    assert s.list(L.contributions_dir(0)) == [] and not s.exists(key) and read_manifest(s, key) is None
    assert arrived_workers(s, 0) == []
    with pytest.raises(CheckpointError, match="worker_001.safetensors: no manifest, so the checkpoint is incomplete"):
        open_checkpoint(s, key)
    if s.is_local:  # what SIGKILL leaves: a partial temporary that no listing shows
        (tmp,) = os.listdir(s.local_path(L.contributions_dir(0)))
        assert tmp.startswith(".tmp-") and 0 < os.path.getsize(s.local_path(L.contributions_dir(0) + "/" + tmp)) < 12 << 20
    else:  # on S3: an unfinished multipart upload, which is no object at all
        assert s3.objects(s) == [f"(upload in progress) {key}"]


def test_worker_killed_between_data_and_manifest_is_never_merged(tmp_path):
    s = Storage(str(tmp_path / "run"))
    base = {f"t{i:02d}": torch.zeros(128 * 1024) for i in range(24)}
    write_checkpoint(s, L.global_weights(0), base, manifest={"round": 0})
    write_checkpoint(s, L.contribution(0, 0), {k: v + 1 for k, v in base.items()}, manifest={"round": 0, "worker": 0})
    _kill_writer_at(s.url, L.contribution(0, 1), "before-manifest", "data published")
    assert s.list(L.contributions_dir(0)) == ["worker_000.json", "worker_000.safetensors", "worker_001.safetensors"]
    assert arrived_workers(s, 0) == [0]  # the poller does not count it
    contributions = [Contribution(0, L.contribution(0, 0), 1.0), Contribution(1, L.contribution(0, 1), 1.0)]
    result = merge_round(s,
                         RoundSpec(base=L.global_weights(0), out=L.global_weights(1),
                                   outer=OuterConfig(optimizer="sgd", lr=1.0)), contributions)
    assert result.merged == [0] and "no manifest" in result.rejected[1]
    merged = load_checkpoint(s, L.global_weights(1))[0]
    assert all(torch.equal(merged[k], base[k] + 1) for k in base)  # worker 0 alone, nothing of worker 1


def test_export_final_copies_once_and_replaces_a_stale_final(tmp_path):
    """A resumed finished run exports nothing again; a final/ left from other weights is replaced."""
    from core.config import config_from_dict
    from orchestrator.run_models import export_final
    s, lay = Storage(str(tmp_path)), RunLayout()
    cfg = config_from_dict({"workers": 1, "rounds": 2, "run_dir": str(tmp_path)})
    write_checkpoint(s, lay.global_weights(2), {"w": torch.ones(3)})
    export_final(s, cfg)
    first = read_manifest(s, lay.FINAL)
    assert first["file"] == "model.safetensors" and first["digest"] == read_manifest(s, lay.global_weights(2))["digest"]
    mtime = os.stat(s.local_path(lay.FINAL)).st_mtime_ns
    export_final(s, cfg)
    assert os.stat(s.local_path(lay.FINAL)).st_mtime_ns == mtime  # already exported: not copied again
    write_checkpoint(s, lay.FINAL, {"w": torch.zeros(3)})  # a final of other weights
    export_final(s, cfg)
    assert torch.equal(load_checkpoint(s, lay.FINAL)[0]["w"], torch.ones(3))
