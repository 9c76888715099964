"""Every JSON (and YAML) a worker reads from storage goes through a checked, bounded loader: a
persistent top-k run with the replica (inline workers, the real CLI) is watched at Storage's two
read calls, and each read made on a worker's behalf must have one of the loaders below in its
stack and a size limit. What the run exercised is asserted too: the persistent wait, the
replica's record and manifests, the in-flight checkpoint's manifest, the config.
"""
from __future__ import annotations

import sys
import traceback

from core.storage import Storage
from orchestrator.cli import main
from runs import submit_tiny

LOADERS = {  # the checked loaders (each parses into typed, bounded values or refuses with a reason)
    "core.manifest.read_manifest",  # a checkpoint's manifest
    "core.records.RoundJobs.load", "core.records.RoundRecord.load", "core.records.RunInfo.load",
    "core.records.Failure.load",
    "core.trust.read_run_config",  # config.yaml, as a config
    "core.replay.Schedule.load",
    "worker.data.Dataset.__init__",  # a dataset's index (core.dataset.parse_index)
    "worker.prepare.prepare", "worker.prepare._finished",  # the data cache's own index and part records
}


def test_every_read_a_worker_makes_goes_through_a_checked_bounded_loader(tmp_path, corpus_cache, monkeypatch):
    reads: list[tuple[str, int | None, list[str]]] = []
    read_bytes = Storage.read_bytes

    def watched(self, key, limit=None):
        stack = [f"{f.f_globals.get('__name__')}.{f.f_code.co_qualname}" for f, _ in traceback.walk_stack(sys._getframe(1))]
        if any(s.startswith(("worker.train.", "worker.persistent.")) for s in stack):  # a worker job, not the service
            reads.append((key, limit, stack))
        return read_bytes(self, key, limit)

    monkeypatch.setattr(Storage, "read_bytes", watched)  # read_json reads through it too
    assert main(submit_tiny(tmp_path / "run", corpus_cache, "--workers", "2", "--rounds", "3", "--inner-steps", "2",
                            "--set", "round.contribution=delta", "--set", "round.codec=topk", "--set", "round.replica=always",
                            executor="inline")) == 0
    unchecked = [(key, stack[:4]) for key, _, stack in reads if not LOADERS & set(stack)]
    assert not unchecked, unchecked
    unbounded = [key for key, limit, _ in reads if limit is None]
    assert not unbounded, unbounded
    used = {next(s for s in stack if s in LOADERS) + (" (replica)" if "worker.replica.Replica._replay" in stack else "")
            for _, _, stack in reads}
    assert {"core.records.RoundJobs.load", "core.records.RoundRecord.load (replica)",
            "core.manifest.read_manifest (replica)", "core.trust.read_run_config"} <= used, used
    assert any(key.endswith("inflight_00001.json") for key, _, _ in reads)  # a requeue's resume point, checked
