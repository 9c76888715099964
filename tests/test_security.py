"""What a run directory cannot be used for: no field of a manifest or a safetensors header is used
unchecked (path traversal, absolute paths, URLs, wrong types, absurd sizes), every bad input gives
a clear IslandsError (fuzzed with hypothesis), and a local run directory is private to its owner.
Pickles: nothing is ever unpickled from storage (checkpoints are safetensors, state is JSON).
"""
from __future__ import annotations

import dataclasses
import json
import os
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.checkpoint import TensorFile, open_checkpoint, read_manifest
from core.checkpoint_writer import write_checkpoint
from core.config import Config, config_from_dict, load_config
from core.errors import CheckpointError, ConfigError
from core.layout import manifest_key
from core.manifest import check_manifest
from core.storage import Storage

ROOT = Path(__file__).resolve().parent.parent
SHA = "a" * 32
KEY = "rounds/00001/contrib/worker_002.safetensors"
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
                    max_leaves=20)


# -- manifests ---------------------------------------------------------------------------------
def test_a_worker_manifest_passes():
    m = {"round": 1, "worker": 2, "digest": SHA, "base_digest": SHA, "bytes": 10, "tensors": 1, "tokens": 4096,
         "file": "worker_002.safetensors", "base": "global/round_00001.safetensors", "waited_s": None,
         "losses": [1.0, 0.9], "job_id": "12_3", "written_at": 1.7e9}
    assert check_manifest(m, "x", KEY) is m


@pytest.mark.parametrize("field, value, why", [
    ("file", "../../../etc/passwd", "not a plain file name"),
    ("file", "/etc/passwd", "not a plain file name"),
    ("file", "worker_003.safetensors", "is not this checkpoint's name"),
    ("base", "../other-run/global/round_00001.safetensors", "not a relative path inside the run"),
    ("base", "/etc/shadow", "not a relative path inside the run"),
    ("base", "s3://bucket/x.safetensors", "not a relative path inside the run"),
    ("base", "global\\..\\x", "not a relative path inside the run"),
    ("worker", -1, "not an integer in"),
    ("worker", "2", "not an integer in"),
    ("worker", True, "not an integer in"),
    ("round", 10**12, "not an integer in"),
    ("digest", "A" * 64, "is not a digest"),
    ("base_digest", "abc", "is not a digest"),
    ("bytes", -5, "not an integer in"),
    ("tokens", float("nan"), "not a finite number"),
])
def test_every_manifest_field_is_validated(field, value, why):
    m = {"round": 1, "worker": 2, "digest": SHA, "file": "worker_002.safetensors", field: value}
    with pytest.raises(CheckpointError, match=why) as info:
        check_manifest(m, "worker 2's manifest", KEY)
    assert "worker 2's manifest is invalid" in str(info.value) and "delete it" in str(info.value)


def test_oversized_and_deeply_nested_manifests_are_refused(mem):
    write_checkpoint(mem, KEY, {"w": torch.ones(2)})
    mem.write_bytes(manifest_key(KEY), b"[" * 100_000 + b"]" * 100_000)  # RecursionError inside json
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_manifest(mem, KEY)
    mem.write_bytes(manifest_key(KEY), json.dumps({"digest": SHA, "pad": "x" * (17 << 20)}).encode())
    with pytest.raises(CheckpointError, match="over the limit"):
        read_manifest(mem, KEY)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(JSON)
def test_fuzzed_manifests_give_a_clear_checkpoint_error(value):
    """Random JSON where a manifest should be: a valid manifest or a CheckpointError, nothing else."""
    s = Storage("memory://fuzz-manifest")
    s.write_bytes(manifest_key(KEY), json.dumps(value).encode())
    try:
        m = read_manifest(s, KEY)
    except CheckpointError as exc:
        assert "manifest of" in str(exc)
        return
    assert isinstance(m, dict) and "digest" in m


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["round", "worker", "digest", "file", "base", "bytes", "tokens", "attempt"]),
                       JSON, min_size=1))
def test_fuzzed_manifest_fields_give_a_clear_checkpoint_error(fields):
    try:
        check_manifest({"digest": SHA, **fields}, "fuzz", KEY)
    except CheckpointError as exc:
        assert str(exc).startswith("manifest of fuzz")


# -- safetensors headers: checked before any tensor data is read ---------------------------------
def _raw_file(header: object, data: bytes = b"\0" * 16) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize("header, why", [
    ({"w": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}}, "malformed"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, "malformed"),
    ({"w": {"dtype": "PICKLE", "shape": [4], "data_offsets": [0, 16]}}, "malformed"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
     "overlap or leave gaps"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, "overlap or leave gaps"),
    ({"__metadata__": {"a": 1}, "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, "__metadata__"),
    ([1, 2], "not a JSON object"),
])
def test_bad_headers_are_refused_before_reading_data(mem, header, why):
    mem.write_bytes("x.safetensors", _raw_file(header))
    with pytest.raises(CheckpointError, match=why):
        TensorFile(mem, "x.safetensors", {"digest": SHA})


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=6), JSON, max_size=3) | JSON, st.binary(max_size=64))
def test_fuzzed_headers_give_a_clear_checkpoint_error(header, data):
    s = Storage("memory://fuzz-header")
    s.write_bytes("x.safetensors", _raw_file(header, data))
    try:
        TensorFile(s, "x.safetensors", {"digest": SHA}).close()
    except CheckpointError:
        pass


# -- configs -----------------------------------------------------------------------------------
def _known_keys(cls=Config, prefix="") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        sub = f.default_factory if dataclasses.is_dataclass(f.default_factory) else None
        out += _known_keys(sub, f"{prefix}{f.name}.") if sub else [prefix + f.name]
    return out


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(_known_keys()), JSON, min_size=1, max_size=4))
def test_fuzzed_config_values_give_a_config_error(values):
    """Existing tests fuzz valid configs and unknown keys; this one puts any JSON value on known keys."""
    raw: dict = {}
    for key, value in values.items():
        *parents, last = key.split(".")
        node = raw
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    try:
        assert isinstance(config_from_dict(raw), Config)
    except ConfigError as exc:
        assert exc.problems


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200))
def test_fuzzed_yaml_gives_a_config_error(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    try:
        load_config(str(path))
    except ConfigError:
        pass


# -- a private run directory ---------------------------------------------------------------------
def test_run_directory_is_private(tmp_path):
    s = Storage(str(tmp_path / "runs" / "r1"))
    write_checkpoint(s, "global/round_00000.safetensors", {"w": torch.ones(2)})
    s.create_exclusive("lock.json", b"{}")
    for p in [tmp_path / "runs", *(tmp_path / "runs").rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))
    assert open_checkpoint(s, "global/round_00000.safetensors").load_all()["w"].sum() == 2


def test_merge_outputs_are_private(tmp_path):
    from core.config import OuterConfig
    from merge.rounds import Contribution, merge_round
    from merge.round_spec import RoundSpec
    s = Storage(str(tmp_path / "run"))
    write_checkpoint(s, "g0.safetensors", {"w": torch.zeros(2)})
    write_checkpoint(s, "a.safetensors", {"w": torch.ones(2)})
    merge_round(s,
                RoundSpec(base="g0.safetensors", out="out/g1.safetensors", outer=OuterConfig(),
                          state_out="out/s1.safetensors"), [Contribution(0, "a.safetensors", 1.0)])
    for p in (tmp_path / "run" / "out").iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert stat.S_IMODE((tmp_path / "run" / "out").stat().st_mode) == 0o700


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def _made_run(tmp_path) -> Path:
    run = tmp_path / "run"
    from orchestrator.run_models import create_run
    create_run(Storage(str(run)), load_config(None, {"workers": 1, "rounds": 1, "run_dir": str(run)},
                                              ["model.n_layer=1", "model.n_embd=32", "model.n_head=2"]))
    return run


def test_status_warns_when_the_run_directory_is_writable_by_others(tmp_path):
    from orchestrator.lease import unsafe_paths
    run = _made_run(tmp_path)
    assert unsafe_paths(Storage(str(run))) == []
    os.chmod(run, 0o777)
    status = _cli("status", str(run), "--json")
    assert status.returncode == 0, status.stderr
    assert f"warning: others can steer this run: {run} is writable by other users (0o777): chmod -R go-w {run}" \
        in status.stderr


def test_submit_refuses_a_run_directory_others_can_write(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o777)
    os.chmod(run, 0o777)  # made beforehand, open to everyone
    out = _cli("submit", "--executor", "local", "--run-dir", str(run), "--rounds", "1")
    assert out.returncode == 2, out.stderr
    assert f"{run} is writable by other users (0o777): chmod -R go-w {run}" in out.stdout
    assert list(run.iterdir()) == []  # nothing written into it


def test_resume_refuses_a_config_another_user_could_have_replaced(tmp_path):
    """Another local user who can write config.yaml sets executor.setup (a shell line) and the owner's
    next resume would run it as the owner: refused, naming the file and the fix, before it is read."""
    run = _made_run(tmp_path)
    config = run / "config.yaml"
    config.write_text(config.read_text() + "\n")
    os.chmod(config, 0o620)
    out = _cli("resume", str(run))
    assert out.returncode == 2 and f"{config} is writable by your group (0o620): chmod go-w {config}" in out.stdout
    assert "--allow-group-write" in out.stdout and not (run / "lock.json").exists()
    os.chmod(config, 0o600)
    (run / "jobs").mkdir(exist_ok=True)
    os.chmod(run / "jobs", 0o757)
    out = _cli("resume", str(run))
    assert out.returncode == 2 and f"{run / 'jobs'} is writable by other users (0o757)" in out.stdout


def test_group_write_is_accepted_only_when_asked_for_and_never_other_write(tmp_path):
    from core.errors import RunError
    from orchestrator.lease import refuse_unsafe
    run = _made_run(tmp_path)
    os.chmod(run, 0o770)
    s = Storage(str(run))
    with pytest.raises(RunError, match="writable by your group"):
        refuse_unsafe(s)
    refuse_unsafe(s, allow_group=True)
    os.chmod(run, 0o772)
    with pytest.raises(RunError, match=f"writable by other users \\(0o772\\): chmod -R o-w {run}"):
        refuse_unsafe(s, allow_group=True)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_lock_owned_by_another_user_is_refused(tmp_path):
    from core.errors import RunError
    from orchestrator.lease import refuse_unsafe
    run = _made_run(tmp_path)
    (run / "lock.json").write_text("{}")
    os.chown(run / "lock.json", 65534, 65534)  # nobody
    with pytest.raises(RunError, match=f"{run / 'lock.json'} belongs to uid 65534, not you"):
        refuse_unsafe(Storage(str(run)))


def test_nothing_read_from_storage_is_unpickled():
    """No unpickling call anywhere in the library (submitit's own job pickles are outside the run
    directory's data path): checkpoints are safetensors, state and manifests JSON, config safe YAML."""
    import re
    banned = re.compile(r"\bpickle\.loads?\(|\btorch\.load\(|allow_pickle\s*=\s*True|\byaml\.(unsafe_)?load\(|\bmarshal\.loads?\(")
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for pkg in ("core", "merge", "orchestrator", "worker") for p in sorted((ROOT / pkg).rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if banned.search(line) and "SafeLoader" not in line]  # yaml.load(..., Loader=SafeLoader) is safe
    assert hits == []


# -- only regular files inside the run directory are read ----------------------------------------
def test_a_linked_folder_inside_the_run_is_not_followed_out_of_it(tmp_path):
    """O_NOFOLLOW guards the last name only: a folder of the run replaced by a link to elsewhere
    is caught by the opened file's real path. A run directory that is itself reached through a
    link (a scratch file system mounted elsewhere) is fine."""
    elsewhere = Storage(str(tmp_path / "elsewhere"))
    write_checkpoint(elsewhere, "contrib/worker_000.safetensors", {"w": torch.ones(2)})
    run = tmp_path / "run"
    (run / "rounds" / "00000").mkdir(parents=True)
    os.symlink(tmp_path / "elsewhere" / "contrib", run / "rounds" / "00000" / "contrib")
    s = Storage(str(run))
    with pytest.raises(CheckpointError, match="worker_000.json resolves to .*elsewhere.*outside the run directory"):
        open_checkpoint(s, "rounds/00000/contrib/worker_000.safetensors")  # its manifest is the first read
    with pytest.raises(CheckpointError, match="worker_000.safetensors resolves to .*outside the run directory"):
        TensorFile(s, "rounds/00000/contrib/worker_000.safetensors", None)
    os.symlink(run, tmp_path / "link-to-run")
    linked = Storage(str(tmp_path / "link-to-run"))
    write_checkpoint(linked, "global/round_00000.safetensors", {"w": torch.ones(2)})
    assert open_checkpoint(linked, "global/round_00000.safetensors").load_all()["w"].sum() == 2


@pytest.mark.parametrize("kind", ["fifo", "folder", "symlink"])
def test_reads_of_a_run_refuse_what_is_not_a_regular_file_without_blocking(tmp_path, kind):
    from core.errors import NotARegularFile
    s = Storage(str(tmp_path / "run"))
    s.write_bytes("real.json", b"{}")
    target = tmp_path / "run" / "x.json"
    {"fifo": lambda: os.mkfifo(target), "folder": lambda: target.mkdir(),
     "symlink": lambda: os.symlink(tmp_path / "run" / "real.json", target)}[kind]()
    with pytest.raises(NotARegularFile, match={"fifo": "named pipe", "folder": "a folder", "symlink": "symbolic link"}[kind]):
        s.read_json("x.json")
    with pytest.raises(CheckpointError, match="over the limit of 1 bytes"):
        s.read_bytes("real.json", limit=1)
