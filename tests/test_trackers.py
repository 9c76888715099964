"""W&B and MLflow logging (log.wandb, log.mlflow): a real run sends its metrics through the real
clients, offline (W&B's offline mode, MLflow's local SQLite store), read back with their own formats."""
from __future__ import annotations

import contextlib
import io
import math
import struct
import sys
from pathlib import Path

import pytest

from core.config import load_config
from core.storage import Storage
from orchestrator.cli import main
from orchestrator.observe.metrics import read_metrics, tensorboard_scalars
from orchestrator.observe.trackers import MlflowTracker, RunName, Trackers, axis
from orchestrator.runstate import load_run

wandb = pytest.importorskip("wandb")
pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")
TINY = ["--set", "model.n_layer=1", "--set", "model.n_embd=16", "--set", "model.n_head=2", "--set", "model.block_size=16",
        "--set", "inner.batch_size=2", "--set", "data.eval_batches=2", "--set", "round.poll_s=0.2"]


def wandb_rows(folder: Path) -> list[dict[str, float]]:
    """The history rows of W&B's offline runs under `folder`, from its transaction log (a LevelDB log
    of the client's own protobuf records: 32 KiB blocks of chunks with 7-byte headers)."""
    from wandb.proto import wandb_internal_pb2 as pb
    rows = []
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, chunk = path.read_bytes(), 7, b""  # after the file's header (":W&B", magic, version)
        assert data.startswith(b":W&B")
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            if left < 7:  # a block's tail too short for a header: padding
                pos += left
                continue
            _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if n == 0 and kind == 0:
                pos += left
                continue
            chunk, pos = chunk + data[pos + 7:pos + 7 + n], pos + 7 + n
            if kind in (1, 4):  # a whole record, or a record's last chunk
                record = pb.Record()
                record.ParseFromString(chunk)
                chunk = b""
                if record.WhichOneof("record_type") == "history":
                    items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                    rows.append({k: float(v) for k, v in items.items() if not k.startswith("_")})
    return rows


def expected(run: Path) -> dict[tuple[str, int], float]:
    storage = Storage(str(run))
    return {(tag, step): value for line in read_metrics(storage, load_run(storage)) for tag, step, value in tensorboard_scalars(line)}


@pytest.mark.slow
def test_a_run_sends_what_the_report_plots_to_wandb_and_mlflow(tmp_path, corpus_cache):
    run, db = tmp_path / "run", tmp_path / "mlflow.db"
    argv = ["submit", "--executor", "inline", "--run-dir", str(run), "--workers", "2", "--rounds", "2", "--inner-steps", "3",
            "--set", f"data.cache_dir={corpus_cache}", *TINY, "--set", "log.wandb=islands-test",
            "--set", "log.wandb_mode=offline", "--set", f"log.mlflow=sqlite:///{db}"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    want = expected(run)
    tags = {tag for tag, _ in want}
    assert {"eval_loss", "train_loss/worker_000", "train_loss/worker_001", "round/merge_seconds"} <= tags
    assert ("eval_loss", 0) in want and ("eval_loss", 6) in want and ("round/merged", 2) in want  # initial, last, per round

    # W&B: every scalar in a row that names its own x value (the inner step, or the round)
    got = {}
    for row in wandb_rows(run):
        (x, step), = [(k, row.pop(k)) for k in ("inner_step", "round") if k in row]
        assert all(axis(tag) == x for tag in row), row
        got.update({(tag, int(step)): value for tag, value in row.items()})
    assert got.keys() == want.keys() and all(math.isclose(got[k], want[k], rel_tol=1e-12) for k in want)

    # MLflow: one run, tagged with the islands run, the config as parameters, each metric's history
    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("islands").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["islands.run"] == RunName.of(Storage(str(run))).id
    assert runs[0].data.params["workers"] == "2" and runs[0].data.params["inner.steps"] == "3"
    got = {(tag, m.step): m.value for tag in tags for m in client.get_metric_history(runs[0].info.run_id, tag)}
    assert got == want

    # a resumed service continues the same runs: no second MLflow run, the same W&B id
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["resume", str(run)]) == 0
    assert len(client.search_runs([client.get_experiment_by_name("islands").experiment_id])) == 1
    ids = {p.name.rsplit("-", 2)[-2:][-1] for p in (run / "wandb").glob("offline-run-*")}
    assert len(list((run / "wandb").glob("offline-run-*"))) == 2 and len(ids) == 1
    assert "mlflow" not in printed.getvalue().lower() and "wandb" not in printed.getvalue().lower()  # nothing on screen


def test_a_tracker_that_fails_is_switched_off_with_one_warning(tmp_path, caplog, monkeypatch):
    storage = Storage(str(tmp_path / "run"))
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    down = load_config(sets=["log.mlflow=http://127.0.0.1:9"])  # nothing listens on the discard port
    opened = Trackers.open(storage, down)
    assert opened.ready() and opened.live == []
    assert "MLflow logging is off for this service" in caplog.text and "the run goes on" in caplog.text

    caplog.clear()
    cfg = load_config(sets=[f"log.mlflow=sqlite:///{tmp_path / 'mlflow.db'}"])
    trackers = Trackers.open(storage, cfg)
    assert trackers.ready()
    (tracker,) = trackers.live
    assert isinstance(tracker, MlflowTracker)
    tracker.client.delete_run(tracker.run_id)  # MLflow refuses metrics for a deleted run
    line = {"kind": "run", "step": 0, "eval_loss": 1.5, "eval_metrics": {}}
    trackers.send([line])
    assert trackers.live == [] and caplog.text.count("MLflow logging stopped") == 1
    trackers.send([line])
    trackers.close()  # nothing left to send to: no second warning, no error
    assert caplog.text.count("MLflow logging stopped") == 1


def test_wandb_online_without_a_login_never_prompts_on_a_terminal(tmp_path):
    """W&B's client asks for a login on a terminal; the service must not stop there (a pty, as a person runs it)."""
    from terminal_support import in_a_terminal
    script = ("from core.config import load_config; from core.storage import Storage; "
              "from orchestrator.observe.trackers import Trackers; import logging; logging.basicConfig(); "
              f"t = Trackers.open(Storage({str(tmp_path / 'run')!r}), load_config(sets=['log.wandb=p', 'log.wandb_mode=online'])); "
              "t.ready(); print('trackers open:', len(t.live))")
    env = ["env", "-u", "WANDB_API_KEY", "-u", "WANDB_MODE", f"HOME={tmp_path}"]  # no login anywhere
    _, screen = in_a_terminal([*env, sys.executable, "-c", script], 80, 24, timeout=120)
    text = " ".join(screen)
    assert "trackers open: 0" in text and "W&B logging is off" in text and "wandb login" in text
    assert "Enter your choice" not in text


@pytest.mark.parametrize("key, module, extra", [("wandb", "wandb", "wandb"), ("mlflow", "mlflow", "mlflow")])
def test_submit_names_the_extra_of_a_missing_client_before_anything_is_made(tmp_path, capsys, monkeypatch, key, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    run = tmp_path / "run"
    assert main(["submit", "--executor", "inline", "--run-dir", str(run), "--set", f"log.{key}=somewhere"]) == 2
    err = capsys.readouterr()
    assert f"log.{key}: the {module} client is not installed here: pip install 'islands[{extra}]'" in err.out + err.err
    assert not run.exists()


def test_wandb_mode_is_one_of_the_clients_modes():
    with pytest.raises(Exception, match="log.wandb_mode"):
        load_config(sets=["log.wandb_mode=sometimes"])


def test_a_service_that_stops_ends_its_tracker_runs_as_it_ended(tmp_path):
    """Ctrl-C or cancel: KILLED; an error: FAILED (drive passes how it ended); a resumed service takes
    the same MLflow run up again, RUNNING."""
    from mlflow.tracking import MlflowClient
    storage = Storage(str(tmp_path / "run"))
    cfg = load_config(sets=[f"log.mlflow=sqlite:///{tmp_path / 'mlflow.db'}"])
    client = MlflowClient(cfg.log.mlflow)
    for ended in ("KILLED", "FAILED"):
        trackers = Trackers.open(storage, cfg)
        assert trackers.ready()
        (tracker,) = trackers.live
        assert client.get_run(tracker.run_id).info.status == "RUNNING"
        trackers.close(ended)
        assert client.get_run(tracker.run_id).info.status == ended
    assert len(client.search_runs([client.get_experiment_by_name("islands").experiment_id])) == 1


def test_a_tracker_server_that_does_not_answer_never_holds_a_round_up(tmp_path, caplog, monkeypatch):
    """A tracking server that takes the connection and never answers (a real socket): the round's
    send returns while the client still waits (its metrics kept); the connection reset, the tracker
    is switched off with one warning."""
    import socket
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)  # the kernel accepts connections; nobody reads or answers them
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")  # far longer than two statements take, however loaded
    try:
        cfg = load_config(sets=[f"log.mlflow=http://127.0.0.1:{server.getsockname()[1]}"])
        trackers = Trackers.open(Storage(str(tmp_path / "run")), cfg)
        trackers.send([{"kind": "run", "step": 0, "eval_loss": 1.5, "eval_metrics": {}}])
        assert not trackers.ready(0) and trackers._pending == [("eval_loss", 0, 1.5)]  # returned while it waits
        server.close()  # the waiting connection is reset: the client fails now rather than at its timeout
        trackers.close()
        assert trackers.live == [] and "MLflow logging is off for this service" in caplog.text
    finally:
        server.close()
