"""A round as the model grows: each phase's seconds per GB of the weights, and each process's peak
memory in W (the fp32 weights), through the real CLI, against the disk's own floor.

For each shape (--shapes LAYERSxWIDTH,...: the built-in GPT on bytes, 12 L d^2 parameters and a
little), `orchestrate submit` runs 2 persistent workers on the local executor, as a user runs it:
--rounds rounds of 2 inner steps (so that I/O shows), top-k deltas (round.codec topk), once with
`round.replica=never` (every base read) and once with `always` (every base replayed), each process
reporting its peak RSS (ISLANDS_IO_REPORT, core/iostat.py). From the run's manifests and records,
over rounds 1 and on (round 0 holds the jobs' start), medians of:

- read / replay: a worker's seconds from asking for its base to having it in the model;
- publish: a worker's seconds to encode and write its contribution (from its base in the model
  to its manifest written, less its training);
- merge: the service's merge seconds, and last contribution landed -> commit (what the round waits for);
- RSS / W: the largest worker's and the service's peak.

Baseline in the same run: the floor, W bytes written (fsync'd) to and read back from a file in the
same folder, through the page cache as the runs' files are. Not measured here: the state snapshot
(written in the background) and the service's eval (after the commit, off the round's path).

    python -m bench.round_scale [--shapes 4x512,8x768,8x1024,10x1152] [--rounds 4] [--dir /var/tmp]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GB = 1e9
RUN = ["--executor", "local", "--workers", "2", "--inner-steps", "2", "--set", "inner.batch_size=4",
       "--set", "inner.warmup_steps=1", "--set", "data.eval_batches=1", "--set", "model.block_size=128",
       "--set", "round.contribution=delta", "--set", "round.codec=topk"]


def floor(folder: Path, nbytes: int) -> tuple[float, float]:
    """Seconds to write `nbytes` (fsync'd) and to read them back: the disk's own cost of a W."""
    path, block = folder / "floor.bin", os.urandom(1 << 24)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(0, nbytes, len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    written = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass
    read = time.perf_counter() - t0
    path.unlink()
    return written, read


def one_run(folder: Path, layers: int, width: int, rounds: int, replica: str) -> dict[str, float]:
    run, io = folder / f"{layers}x{width}-{replica}", folder / f"io-{layers}x{width}-{replica}"
    io.mkdir()
    cmd = [sys.executable, "-m", "orchestrator.cli", "submit", *RUN, "--rounds", str(rounds), "--run-dir", str(run),
           "--set", f"model.n_layer={layers}", "--set", f"model.n_embd={width}", "--set", f"model.n_head={width // 64}",
           "--set", f"round.replica={replica}"]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "ISLANDS_IO_REPORT": str(io)})
    w = json.loads((run / "global" / "round_00000.json").read_text())["bytes"]
    base, publish, merge, tail = [], [], [], []
    for r in range(1, rounds):
        rec = json.loads((run / "rounds" / f"{r:05d}" / "record.json").read_text())
        ms = [json.loads((run / "rounds" / f"{r:05d}" / "contrib" / f"worker_{x:03d}.json").read_text())
              for x in rec["merged"]]
        base += [m["base_s"] for m in ms]
        publish += [m["written_at"] - m["base_at"] - m["trained_s"] for m in ms]
        merge.append(rec["merge_seconds"])
        tail.append(rec["committed_at"] - max(m["written_at"] for m in ms))
    reports = [json.loads(p.read_text()) for p in io.glob("*.json")]
    rss = {role: max(x["maxrss"] for x in reports if x["role"] == role) / w for role in ("worker", "service")}
    return {"W": w, "base": statistics.median(base), "publish": statistics.median(publish),
            "merge": statistics.median(merge), "tail": statistics.median(tail), "worker_rss": rss["worker"],
            "service_rss": rss["service"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="4x512,8x768,8x1024,10x1152", help="LAYERSxWIDTH, comma-separated")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--dir", default=None, help="where the runs go (default: a temporary folder)")
    a = p.parse_args(argv)
    print("params | W | floor write / read s/GB | read s/GB | replay s/GB | publish s/GB | merge s/GB | "
          "last landed->commit s/GB | worker RSS/W | service RSS/W")
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        for shape in a.shapes.split(","):
            layers, width = (int(x) for x in shape.split("x"))
            read = one_run(Path(tmp), layers, width, a.rounds, "never")
            replay = one_run(Path(tmp), layers, width, a.rounds, "always")
            gb = read["W"] / GB
            fw, fr = floor(Path(tmp), read["W"])
            print(f"{read['W'] / 4e6:.1f}M | {gb:.2f} GB | {fw / gb:.2f} / {fr / gb:.2f} | "
                  f"{read['base'] / gb:.2f} ({read['base'] / fr:.1f}x the floor's read) | "
                  f"{replay['base'] / gb:.2f} ({replay['base'] / read['base']:.1f}x the read) | "
                  f"{read['publish'] / gb:.2f} ({read['publish'] / fw:.1f}x the floor's write) | {read['merge'] / gb:.2f} | "
                  f"{read['tail'] / gb:.2f} | {read['worker_rss']:.1f} ({replay['worker_rss']:.1f} replaying) | "
                  f"{read['service_rss']:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
