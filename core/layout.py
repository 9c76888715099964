"""Every path of a run directory, in one place. Nobody else formats a path.

Paths are keys relative to the run root, '/'-separated, so the same layout works on a local
filesystem, NFS/Lustre and object stores (joined with posixpath, never os.path).

    config.yaml                                   resolved config (what `resume` uses)
    lock.json                                     which merge service drives the run: epoch, heartbeat
    lease/epoch_00002.json                        who took epoch 2 of the lease (created once, never rewritten)
    CANCEL                                        marker: `orchestrate cancel` asked to stop
    STOP                                          marker: the service was interrupted (Ctrl-C): its local
                                                  workers save their state and end (resume clears it)
    failed.json                                   why the run stopped for good, if it did
    orchestrator.log                              every log record of the services that drove it (local runs)
    global/round_00003.safetensors (+ .json)      global weights that round 3 starts from
    outer/state_00003.safetensors (+ .json)       outer-optimizer state the merge of round 3 reads
    rounds/00003/jobs.json                        jobs submitted for round 3 (ids, attempts, bases)
    rounds/00003/contrib/worker_001.safetensors   worker 1's weights after round 3 (+ .json manifest)
    rounds/00003/record.json                      the round's commit record, written last
    rounds/00003/rejected/                        contributions refused by the merge, each with .reason.json
    rounds/00003/folded/worker_001_from_00002...  a late contribution of round 2 folded into round 3
    rounds/00003/rebuild/global.safetensors       round 3's merge redone to rebuild outer/state_00004 (+ state;
                                                  removed after)
    workers/worker_001/state_00003.safetensors    worker 1's inner optimizer state after round 3
    workers/worker_001/inflight_00003.safetensors mid-round checkpoint of a preempted worker
    workers/worker_001/state_00003-rank0of4...    a sharded worker's: one file per rank, the set's
                                                  state_00003.json written last (core/shards.py)
    workers/worker_001/progress.json              heartbeat of the running worker (step, loss)
    final/model.safetensors                       the exported final model
    final/hf/                                     the same, as a Hugging Face model directory (model.hf runs)
    jobs/                                         submitit's folder (job scripts, logs)
    metrics/round_00003.jsonl                     round 3's metrics as JSON lines (docs/observability.md)
    tensorboard/                                  TensorBoard event files, when tensorboard is installed
    wandb/                                        the W&B client's files, with log.wandb (an offline run to sync)
"""
from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path

SAFETENSORS = ".safetensors"


def local_cache_root() -> Path:
    """This machine's cache, outside any run: prepared corpora (data/), report statistics (report/).
    $ISLANDS_CACHE, else ~/.cache/islands."""
    return Path(os.environ.get("ISLANDS_CACHE") or Path.home() / ".cache" / "islands")


def manifest_key(checkpoint_key: str) -> str:
    """The manifest sits beside its checkpoint and is written after it: it is the commit."""
    if not checkpoint_key.endswith(SAFETENSORS):
        raise ValueError(f"not a checkpoint key: {checkpoint_key}")
    return checkpoint_key[: -len(SAFETENSORS)] + ".json"


class RunLayout:
    CONFIG = "config.yaml"
    LOCK = "lock.json"
    LEASE = "lease"
    CANCEL = "CANCEL"
    STOP = "STOP"
    FAILED = "failed.json"
    REPLAY = "replay.json"
    """A replay's schedule (core/replay.py): the source run's steps, adoption steps and merge order."""
    LOG = "orchestrator.log"
    FINAL = "final/model.safetensors"
    FINAL_HF = "final/hf"
    """With model.hf: the final model as a Hugging Face directory (from_pretrained loads it); its
    config.json is written last."""
    JOBS = "jobs"
    METRICS = "metrics"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"

    def lease_epoch(self, epoch: int) -> str:
        """Created exclusively by whoever takes epoch `epoch` of the run's lease (orchestrator.lease):
        its existence fences every holder of an earlier epoch."""
        return posixpath.join(self.LEASE, f"epoch_{epoch:05d}.json")

    def final_hf_file(self, name: str) -> str:
        return posixpath.join(self.FINAL_HF, name)

    def global_weights(self, round_: int) -> str:
        return f"global/round_{round_:05d}{SAFETENSORS}"

    def outer_state(self, round_: int) -> str:
        return f"outer/state_{round_:05d}{SAFETENSORS}"

    def round_dir(self, round_: int) -> str:
        return f"rounds/{round_:05d}"

    def round_jobs(self, round_: int) -> str:
        return posixpath.join(self.round_dir(round_), "jobs.json")

    def round_record(self, round_: int) -> str:
        return posixpath.join(self.round_dir(round_), "record.json")

    def contributions_dir(self, round_: int) -> str:
        return posixpath.join(self.round_dir(round_), "contrib")

    def contribution(self, round_: int, worker: int) -> str:
        return posixpath.join(self.contributions_dir(round_), f"worker_{worker:03d}{SAFETENSORS}")

    def rejected_contribution(self, round_: int, worker: int, attempt: int) -> str:
        """Where a rejected contribution is set aside (kept as evidence, never merged)."""
        return posixpath.join(self.round_dir(round_), "rejected", f"worker_{worker:03d}_attempt{attempt}{SAFETENSORS}")

    def rejected_reason(self, round_: int, worker: int, attempt: int) -> str:
        """Why that contribution was rejected (JSON), beside it."""
        return posixpath.join(self.round_dir(round_), "rejected", f"worker_{worker:03d}_attempt{attempt}.reason.json")

    def folded_contribution(self, round_: int, worker: int, from_round: int) -> str:
        """A late contribution of `from_round` re-based onto round `round_`'s global weights, the
        merge input that folds it in (round.late_policy: fold); kept so the merge can be replayed."""
        return posixpath.join(self.round_dir(round_), "folded",
                              f"worker_{worker:03d}_from_{from_round:05d}{SAFETENSORS}")

    def rebuild_dir(self, round_: int) -> str:
        """Round `round_`'s merge redone to rebuild the outer state it wrote (orchestrator.outer_state);
        removed after."""
        return posixpath.join(self.round_dir(round_), "rebuild")

    def rebuilt_global(self, round_: int) -> str:
        """The redone merge's global output, compared with the published one."""
        return posixpath.join(self.rebuild_dir(round_), f"global{SAFETENSORS}")

    def rebuilt_state(self, round_: int) -> str:
        """The redone merge's outer state, moved to outer/state_{round_+1} if the global matches."""
        return posixpath.join(self.rebuild_dir(round_), f"state{SAFETENSORS}")

    def worker_dir(self, worker: int) -> str:
        return f"workers/worker_{worker:03d}"

    def worker_state(self, worker: int, round_: int) -> str:
        return posixpath.join(self.worker_dir(worker), f"state_{round_:05d}{SAFETENSORS}")

    def worker_progress(self, worker: int) -> str:
        """Heartbeat of a running worker: round, step, last loss (for `orchestrate status`)."""
        return posixpath.join(self.worker_dir(worker), "progress.json")

    def worker_inflight(self, worker: int, round_: int) -> str:
        return posixpath.join(self.worker_dir(worker), f"inflight_{round_:05d}{SAFETENSORS}")

    def round_metrics(self, round_: int) -> str:
        """Round r's metrics as JSON lines, one file per round written whole (object stores cannot append)."""
        return posixpath.join(self.METRICS, f"round_{round_:05d}.jsonl")

    @staticmethod
    def parse_contribution(name: str) -> int | None:
        """Worker id from a contribution's file name, or None for anything else."""
        m = re.fullmatch(r"worker_(\d{3,})" + re.escape(SAFETENSORS), posixpath.basename(name))
        return int(m.group(1)) if m else None

    @staticmethod
    def parse_state(name: str, committed: bool = True) -> int | None:
        """Round of a worker's state snapshot from a file name: its manifest `state_00003.json`, the
        commit of a plain file or of a set of rank files (core/shards.py); `committed=False`: any file
        of one (data, rank files and their manifests, leftovers of an unfinished write)."""
        tail = r"\.json" if committed else r"(?:-rank\d+of\d+)?(?:\.json|" + re.escape(SAFETENSORS) + ")"
        m = re.fullmatch(r"state_(\d{5,})" + tail, posixpath.basename(name))
        return int(m.group(1)) if m else None

    @staticmethod
    def parse_round(name: str, prefix: str) -> int | None:
        """Round number from `round_00003.safetensors` / `state_00003.safetensors` style names."""
        m = re.fullmatch(re.escape(prefix) + r"_(\d{5,})" + re.escape(SAFETENSORS), posixpath.basename(name))
        return int(m.group(1)) if m else None
