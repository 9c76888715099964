"""Weights & Biases and MLflow: the numbers the report plots, sent through the official clients.

`--set log.wandb=PROJECT` and `--set log.mlflow=URI` turn them on (docs/observability.md). The merge
service opens one tracker run per islands run when it starts (a resumed service continues the same
W&B run, and finds its MLflow run by the tag `islands.run`), and sends each round's metrics lines once
the round is evaluated: the scalars TensorBoard gets (metrics.tensorboard_scalars), losses against
the inner step, a round's costs against the round. A tracker that fails is switched off with one
warning: a dashboard never stops a run, and metrics/, the report and TensorBoard keep everything.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
import re
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from core.config import Config
from core.layout import RunLayout
from core.records import RunInfo
from core.storage import Storage
from orchestrator.observe.metrics import tensorboard_scalars

log = logging.getLogger(__name__)
L = RunLayout()
ROUND_AXIS, STEP_AXIS = "round", "inner_step"
MLFLOW_BATCH = 1000  # MLflow's limit of metrics per log_batch call
CLOSE_WAIT_S = 30.0  # how long a service that ends waits for trackers still opening
EXTRAS = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}  # setting -> (module, islands extra)


class Tracker(Protocol):
    name: str

    def send(self, scalars: list[tuple[str, int, float]]) -> None: ...

    def close(self, ended: str) -> None: ...


def axis(tag: str) -> str:
    """The x axis of a scalar: a round's costs (`round/...`) per round, losses per inner step."""
    return ROUND_AXIS if tag.startswith("round/") else STEP_AXIS


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, a broken package
        return False


def tracker_problems(cfg: Config) -> list[str]:
    """What `submit` refuses before anything is made: a tracker asked for whose client is missing."""
    p = []
    for key, (module, extra) in EXTRAS.items():
        if getattr(cfg.log, key) and not _installed(module):
            p.append(f"log.{key}: the {module} client is not installed here: pip install 'islands[{extra}]' "
                     f"(or drop log.{key})")
    uri = cfg.log.mlflow or ""
    if uri.startswith("sqlite:") and _installed("mlflow") and not _installed("sqlalchemy"):
        p.append(f"log.mlflow: {uri} is a database store, which needs SQLAlchemy: pip install 'islands[mlflow]'")
    return p


@dataclasses.dataclass(frozen=True)
class RunName:
    """How the trackers name an islands run: its folder's name, and an id stable across resumes."""
    name: str
    id: str

    @classmethod
    def of(cls, storage: Storage) -> RunName:
        name = storage.display().rstrip("/").rsplit("/", 1)[-1] or "run"
        created = RunInfo.load(storage).created_at
        digest = hashlib.sha256(f"{storage.display()}|{created}".encode()).hexdigest()[:8]
        return cls(name, f"{re.sub(r'[^A-Za-z0-9_-]', '-', name)[:48]}-{digest}")


def flat_config(cfg: Config) -> dict[str, Any]:
    """The run's config as dotted keys, for a tracker's run parameters."""
    out: dict[str, Any] = {}

    def walk(obj: Mapping[str, Any], prefix: str) -> None:
        for k, v in obj.items():
            if isinstance(v, Mapping) and v:
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v
    walk(dataclasses.asdict(cfg), "")
    return out


class WandbTracker:
    name = "W&B"

    def __init__(self, storage: Storage, cfg: Config, run: RunName) -> None:
        import wandb  # the optional extra: imported only when asked for
        folder = storage.local_path("")
        if folder is not None:
            with storage.local_folder(L.WANDB):  # made private (0700), and refused if it is a link
                pass
        settings = wandb.Settings(console="off", silent=True, **({"mode": cfg.log.wandb_mode} if cfg.log.wandb_mode else {}))
        wandb.setup(settings)  # silent before init: no login prompt that would stop the service on a terminal
        self.run = wandb.init(project=cfg.log.wandb, id=run.id, name=run.name, resume="allow", config=flat_config(cfg),
                              dir=folder, settings=settings)
        self.run.define_metric(STEP_AXIS)
        self.run.define_metric(ROUND_AXIS)
        for prefix in ("eval_", "train_loss/"):
            self.run.define_metric(f"{prefix}*", step_metric=STEP_AXIS)
        self.run.define_metric("round/*", step_metric=ROUND_AXIS)

    def send(self, scalars: list[tuple[str, int, float]]) -> None:
        # one row per (axis, step): W&B's own step only grows, so each row names its x value instead
        rows: dict[tuple[str, int], dict[str, float]] = {}
        for tag, step, value in scalars:
            rows.setdefault((axis(tag), step), {})[tag] = value
        for (x, step), values in sorted(rows.items(), key=lambda item: (item[0][1], item[0][0])):
            self.run.log({x: step, **values})

    def close(self, ended: str) -> None:
        self.run.finish(exit_code=0 if ended == "FINISHED" else 1)


class MlflowTracker:
    name = "MLflow"

    def __init__(self, storage: Storage, cfg: Config, run: RunName) -> None:
        from mlflow.tracking import MlflowClient  # the optional extra: imported only when asked for
        logging.getLogger("mlflow").setLevel(logging.WARNING)  # not its INFO lines on the run's screen
        self.client = MlflowClient(cfg.log.mlflow)
        experiment = self.client.get_experiment_by_name(cfg.log.mlflow_experiment)
        eid = experiment.experiment_id if experiment else self.client.create_experiment(cfg.log.mlflow_experiment)
        found = self.client.search_runs([eid], filter_string=f"tags.`islands.run` = '{run.id}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(eid, run_name=run.name, tags={"islands.run": run.id,
                                                                                 "islands.run_dir": storage.display()}).info.run_id
            self._params(cfg)

    def _params(self, cfg: Config) -> None:
        from mlflow.entities import Param
        params = [Param(k, str(v)[:6000]) for k, v in flat_config(cfg).items()]
        for i in range(0, len(params), 100):  # MLflow's limit of parameters per call
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def send(self, scalars: list[tuple[str, int, float]]) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        metrics = [Metric(tag, value, now, step) for tag, step, value in scalars]
        for i in range(0, len(metrics), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + MLFLOW_BATCH])

    def close(self, ended: str) -> None:
        self.client.set_terminated(self.run_id, status=ended)


class Trackers:
    """The trackers the run's config asks for, each switched off at its first failure."""

    def __init__(self, trackers: Iterable[Tracker] = ()) -> None:
        self.live = list(trackers)
        self._opening: threading.Thread | None = None
        self._pending: list[tuple[str, int, float]] = []  # scalars sent while the trackers were opening

    @classmethod
    def open(cls, storage: Storage, cfg: Config) -> Trackers:
        """The trackers of `cfg.log`, opened in the background: a client's imports and its store's
        set-up take seconds, which the run's first round need not wait for; the first send does."""
        out = cls()
        kinds = [k for k, on in ((WandbTracker, cfg.log.wandb), (MlflowTracker, cfg.log.mlflow)) if on]
        if kinds:
            out._opening = threading.Thread(target=out._open, args=(storage, cfg, kinds), name="trackers", daemon=True)
            out._opening.start()
        return out

    def _open(self, storage: Storage, cfg: Config, kinds: list[type]) -> None:
        run = RunName.of(storage)
        for kind in kinds:
            try:
                self.live.append(kind(storage, cfg, run))
            except Exception as exc:  # noqa: BLE001 -- a client's failure, whatever its type, never stops a run
                log.warning("%s logging is off for this service: %s (%s); the run goes on, its metrics/ and "
                            "`orchestrate report` have every figure", kind.name, _one_line(exc), type(exc).__name__)

    def ready(self, timeout: float | None = None) -> bool:
        """Wait for the trackers to be opened (at most `timeout` seconds); whether they are."""
        if self._opening is not None:
            self._opening.join(timeout)
            if self._opening.is_alive():
                return False
            self._opening = None
        return True

    def send(self, lines: list[dict[str, Any]]) -> None:
        """One round's metrics lines (metrics.round_metrics) to every live tracker; kept for the next
        call while the trackers are still opening (a slow server never holds a round up)."""
        if not self.live and self._opening is None:  # none asked for, or all switched off: nothing to build
            return
        self._pending += [s for line in lines for s in tensorboard_scalars(line)]
        if not self.ready(0):
            return
        scalars, self._pending = self._pending, []
        for tracker in list(self.live):
            self._call(tracker, lambda t: t.send(scalars))

    def close(self, ended: str = "FINISHED") -> None:
        """Send what is kept and end the tracker runs as the service ended: FINISHED, KILLED (Ctrl-C,
        cancel) or FAILED; a resumed service takes them up again."""
        if not self.ready(CLOSE_WAIT_S):  # a client still connecting (a server that does not answer)
            log.warning("trackers still starting after %.0fs: not waited for", CLOSE_WAIT_S)
            return
        self.send([])
        for tracker in list(self.live):
            self._call(tracker, lambda t: t.close(ended))
        self.live = []

    def _call(self, tracker: Tracker, action: Any) -> None:
        try:
            action(tracker)
        except Exception as exc:  # noqa: BLE001 -- as in open: a dashboard never stops a run
            self.live.remove(tracker)
            log.warning("%s logging stopped: %s (%s); the run goes on", tracker.name, _one_line(exc),
                        type(exc).__name__)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:1000]  # one line, whatever the client's layout
