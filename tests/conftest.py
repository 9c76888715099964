from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `bench` and `tests` helpers import from the checkout
# The local cluster's nodes claim more CPUs than this machine has, so a Slurm job's torch threads
# (executor.cpus_per_task) outnumber the cores; OpenMP's default busy-wait between parallel regions
# then burns the cores the other threads need (a documented example's first round: 48 s, 20 s
# without). Every job inherits this (sbatch exports the environment); it changes no result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from core.storage import Storage  # noqa: E402

_ids = itertools.count()

try:  # an S3-compatible server for the suite: moto's server mode + s3fs (the `test` extra)
    import moto.server
    import s3fs  # noqa: F401
    S3_SKIP = ""
except ImportError as _exc:
    S3_SKIP = f"the s3 backend needs moto[server] and s3fs: pip install -e .[test] ({_exc})"


# The files whose tests submit to the local Slurm cluster. Under pytest-xdist (tests/run.sh: -n 2)
# they run one after another on one worker while the other runs the rest: side by side they would
# queue for the same nodes, and test_queuewait compares squeue before and after.
SLURM_FILES = frozenset({"test_chaos.py", "test_documented_runs.py", "test_local_cluster.py", "test_queuewait.py",
                         "test_slurm_e2e.py"})


@pytest.hookimpl(optionalhook=True)  # xdist's hook; absent without pytest-xdist
def pytest_xdist_make_scheduler(config, log):
    """xdist's loadscope with one scope for the Slurm files and one per test elsewhere. (Its own
    `--dist loadgroup` does not group under pytest 9: it renames item._nodeid, which pytest 9 ignores.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SlurmTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "slurm" if nodeid.split("::")[0].rsplit("/", 1)[-1] in SLURM_FILES else nodeid

    return SlurmTogether(config, log)


def pytest_collection_modifyitems(items):
    """SLURM_FILES restates what the `slurm` marker says (xdist's controller sees node ids, not
    markers): a marked test in another file would queue beside the Slurm scope, so refuse it here."""
    stray = sorted({item.path.name for item in items if item.get_closest_marker("slurm")} - SLURM_FILES)
    if stray:
        raise pytest.UsageError(f"tests marked slurm in {', '.join(stray)}: add the file(s) to SLURM_FILES in tests/conftest.py")


def pytest_terminal_summary(terminalreporter, config):
    """How many worker jobs the suite started as processes (local or Slurm): each costs an
    interpreter and torch's imports (~5 CPU-s), where an inline job (a thread) costs none. Counted
    from submitit's job pickles under the session's temporary folder, whoever submitted them."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller counts for the session
        return
    base = config._tmp_path_factory.getbasetemp()
    jobs = sum(1 for _ in base.rglob("*_submitted.pkl"))
    terminalreporter.write_line(f"worker jobs started as processes (local or Slurm, under {base}): {jobs}")


@dataclass(frozen=True)
class S3Server:
    """moto's S3 server on 127.0.0.1 (a random free port) and one bucket on it."""

    endpoint_url: str
    bucket: str = "islands-test"
    key: str = "testing"
    secret: str = "testing"

    def storage(self, name: str) -> Storage:
        return Storage(f"s3://{self.bucket}/{name}", key=self.key, secret=self.secret,
                       client_kwargs={"endpoint_url": self.endpoint_url, "region_name": "us-east-1"})

    def objects(self, storage: Storage) -> list[str]:
        """Keys under `storage`'s root, then its unfinished multipart uploads, asked of the server."""
        import boto3
        c = boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.key,
                         aws_secret_access_key=self.secret, region_name="us-east-1")
        prefix = storage.root.split("/", 1)[1] + "/"
        keys = [o["Key"] for o in c.list_objects_v2(Bucket=self.bucket, Prefix=prefix).get("Contents", [])]
        uploads = [u["Key"] for u in c.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix).get("Uploads", [])]
        return sorted(k[len(prefix):] for k in keys) + [f"(upload in progress) {k[len(prefix):]}" for k in uploads]

    def env(self) -> dict[str, str]:
        """Environment that points every boto-based client at this server (what workers inherit)."""
        return {"AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ACCESS_KEY_ID": self.key,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def s3_server() -> S3Server:
    if S3_SKIP:
        pytest.skip(S3_SKIP)
    import boto3
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = moto.server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = S3Server(f"http://{host}:{port}")
    boto3.client("s3", endpoint_url=s3.endpoint_url, aws_access_key_id=s3.key, aws_secret_access_key=s3.secret,
                 region_name="us-east-1").create_bucket(Bucket=s3.bucket)
    yield s3
    server.stop()


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.skipif(bool(S3_SKIP), reason=S3_SKIP))])
def storage(request, tmp_path) -> Storage:
    """The same tests on a local directory, fsspec's memory:// and S3 (moto's server + s3fs)."""
    if request.param == "local":
        yield Storage(str(tmp_path / "run"))
        return
    if request.param == "s3":
        s = request.getfixturevalue("s3_server").storage(f"run-{next(_ids)}")
    else:
        s = Storage(f"memory://islands-test-{next(_ids)}")
    yield s
    if s.fs.exists(s.root):
        s.fs.rm(s.root, recursive=True)


@pytest.fixture
def mem() -> Storage:
    return Storage(f"memory://islands-mem-{next(_ids)}")


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> str:
    """One prepared corpus cache for every end-to-end test of the session."""
    return str(tmp_path_factory.mktemp("corpus-cache"))


@pytest.fixture(scope="session")
def dense_run(tmp_path_factory, corpus_cache) -> Path:
    """The suite's standard run (tests/runs.py: DiLoCo, 2 workers x 2 rounds x 3 steps, dense, every
    round kept), made once per session with inline workers, for the tests that only read a run;
    one that changes it copies it first."""
    from orchestrator.cli import main
    from runs import DENSE, submit_tiny
    run = tmp_path_factory.mktemp("dense") / "run"
    assert main(submit_tiny(run, corpus_cache, *DENSE, executor="inline")) == 0
    return run


@pytest.fixture
def mount_tmpfs():
    """`mount_tmpfs(path)`: a real 1 MiB disk (tmpfs) mounted at `path` for the test, to fill; needs
    root (the test is skipped otherwise); unmounted afterwards."""
    mounted: list[Path] = []

    def mount(mnt: Path) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs to fill needs root")
        mnt.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.fixture
def stall_reads(monkeypatch):
    """`stall_reads(key)`: reads of that file's data (past its header) by a reader thread block until
    the test ends, as on a hung NFS server; merge.reading.STALL_S is 0.3 s meanwhile. A read of it on
    the test's own thread (the service's, which would hang there for good) fails the test instead."""
    import threading

    from core.checkpoint import TensorFile
    from merge import reading
    monkeypatch.setattr(reading, "STALL_S", 0.3)
    release, keys, caller, on_caller = threading.Event(), set(), threading.current_thread(), []
    real = TensorFile._read_exact

    def hang(self, offset, view):
        if self.key in keys and offset >= getattr(self, "data_start", 1 << 62):
            if threading.current_thread() is caller:
                on_caller.append(self.key)
                raise OSError(f"{self.key} read on the caller's thread after its storage stalled")
            release.wait(30)
        return real(self, offset, view)
    monkeypatch.setattr(TensorFile, "_read_exact", hang)
    yield keys.add
    release.set()
    assert not on_caller, f"read on the service's own thread after they stalled (it would hang there): {on_caller}"


@pytest.fixture
def round_record():
    """make(r, **fields): a round record as the service writes one, every field there (empty) but
    `fields`; for tests that plant a record (core/records.py refuses one with a field missing)."""
    import typing

    from core.records import RoundRecord
    hints = typing.get_type_hints(RoundRecord)
    empty = {k: {list: [], dict: {}}.get(typing.get_origin(t), {str: "", float: 0.0, int: 0}.get(t)) for k, t in hints.items()}
    return lambda r, **fields: {**empty, "round": r, **fields}
