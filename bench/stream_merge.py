"""A round's merge latency after the last worker lands: folding contributions as they arrive vs not.

K contributions (fp32, shaped like a small Llama: bench.merge_throughput's shapes) and the round's
global weights and outer state are written to a run-like layout on local disk. One DiLoCo round
(Nesterov outer step, the outer state read and written) is then merged two ways, alternating, each
with every file evicted from the page cache first (posix_fadvise DONTNEED), so every read comes
from the disk:

- streamed: the round's global weights and outer state are read into memory and contributions
  0..K-2 folded into the running sum before the clock starts (the service does that while it
  waits for the last worker); timed: `merge_round`, which folds the last one, takes the outer step
  tensor by tensor and writes the new global weights and outer state; the latency ends when both
  are published. For reference, folding one contribution alone (`RunningSum.add`);
- at the end: `merge_round` with no running sum (`round.stream_merge: false`, or a resumed
  service): all K folded after the last one landed, then the step.

The baseline is the raw read of one checkpoint (16 MiB `readinto`), measured in the same run; a
second reference is what the disk needs for the streamed merge's I/O: one checkpoint read (dropped
behind) while a file of its size is written, as the new global is (bench.merge_throughput's
"read + write"). Every output is deleted before each merge, as in a run, where round r+1's files do
not exist yet.

With `--aggregate median` (or trimmed_mean) the outer step takes each tensor's element-wise median
of the contributions, read again from storage (merge/robust.py), in place of the running sum's mean.

    python -m bench.stream_merge [--k 8] [--hidden 1024 --layers 4] [--repeats 2] [--dir /tmp] [--aggregate median]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.merge_throughput import READ_WRITE, evict, llama_shapes
from bench.merge_throughput import raw_read as read_and_write
from core.checkpoint_writer import write_checkpoint
from core.config import OuterConfig
from core.storage import Storage
from merge.rounds import Contribution, RunningSum, merge_round
from merge.round_spec import RoundSpec

OUTER = OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9)


def setup(root: Path, k: int, dims: tuple[int, int, int, int]) -> tuple[Storage, list[Contribution]]:
    s = Storage(str(root))
    shapes = llama_shapes(*dims)
    g = torch.Generator().manual_seed(0)
    base = {n: torch.rand(sh, generator=g) - 0.5 for n, sh in shapes.items()}
    write_checkpoint(s, "g0.safetensors", base, manifest={"round": 0})
    contribs = []
    for i in range(k):
        write_checkpoint(s, f"w{i}.safetensors", {n: t + 0.01 * (torch.rand(t.shape, generator=g) - 0.5)
                                                  for n, t in base.items()}, manifest={"round": 0, "worker": i})
        contribs.append(Contribution(i, f"w{i}.safetensors", 1000.0 + i, BOUND))  # checked as the service does
    del base
    merge_round(s, RoundSpec(base="g0.safetensors", out="g1.safetensors", outer=OUTER, state_out="s1.safetensors"),
                contribs)  # round 0 makes the outer state that round 1 reads
    return s, contribs


BOUND = 1.0
"""Each contribution's bound on an outer-gradient entry (core.codec.max_update), as the service
passes it: every fold checks it (weights against the held global)."""


def files(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors"))


def raw_read(p: Path) -> float:
    buf = bytearray(16 << 20)
    t0 = time.perf_counter()
    with open(p, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def merged(s: Storage, contribs: list[Contribution], out: str, aggregate: str, acc: RunningSum | None = None) -> None:
    res = merge_round(s,
                      RoundSpec(base="g1.safetensors", out=out, outer=OUTER, state_in="s1.safetensors",
                                state_out="s2.safetensors", aggregate=aggregate), contribs, acc)
    assert res.merged == [c.worker for c in contribs], res.rejected


def fresh(root: Path, out: str) -> None:
    """The merge's outputs not there yet, and nothing in the page cache."""
    for name in (out, "s2.safetensors"):
        (root / name).unlink(missing_ok=True)
        (root / name).with_suffix(".json").unlink(missing_ok=True)
    evict(files(root))


def timed(run: Callable[[], Any]) -> tuple[float, float]:
    """(seconds until `run` returns: the new global and state published, CPU seconds meanwhile)."""
    t0, c0 = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - t0, time.process_time() - c0


def streamed(s: Storage, root: Path, contribs: list[Contribution], aggregate: str) -> tuple[float, float]:
    acc = RunningSum(s, "g1.safetensors", state_key="s1.safetensors", preload=True)  # as the service does
    for c in contribs[:-1]:
        assert acc.add(c)
    fresh(root, "streamed.safetensors")
    return timed(lambda: merged(s, contribs, "streamed.safetensors", aggregate, acc))


def fold_alone(s: Storage, root: Path, contribs: list[Contribution]) -> float:
    alone = RunningSum(s, "g1.safetensors")
    evict(files(root))
    t0 = time.perf_counter()
    assert alone.add(contribs[-1])
    return time.perf_counter() - t0


def at_the_end(s: Storage, root: Path, contribs: list[Contribution], aggregate: str) -> tuple[float, float]:
    fresh(root, "end.safetensors")
    return timed(lambda: merged(s, contribs, "end.safetensors", aggregate))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--aggregate", default="mean", choices=["mean", "median", "trimmed_mean"],
                   help="round.aggregate: a robust one reads every contribution again for the outer step")
    args = p.parse_args()
    dims = (args.hidden, int(args.hidden * 2.6875), 32000, args.layers)
    root = Path(tempfile.mkdtemp(prefix="bench-stream-", dir=args.dir))
    try:
        s, contribs = setup(root, args.k, dims)
        size = (root / "w0.safetensors").stat().st_size
        names = ["streamed: the last fold, then the outer step (global and state written)",
                 "(for reference: folding one contribution alone)", "at the end: K folds + outer step"]
        times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        raws, rws = [], []
        for _ in range(args.repeats):
            evict(files(root))
            raws.append(raw_read(root / "w0.safetensors"))
            evict(files(root))
            rws.append(read_and_write([root / "w0.safetensors"], READ_WRITE))
            runs = [streamed(s, root, contribs, args.aggregate), (fold_alone(s, root, contribs), float("nan")),
                    at_the_end(s, root, contribs, args.aggregate)]
            for n, r in zip(names, runs):
                times[n].append(r)
            print(f"repeat: raw {raws[-1]:.2f}s, read + write {rws[-1]:.2f}s, streamed {runs[0][0]:.2f}s, "
                  f"one fold alone {runs[1][0]:.2f}s, at the end {runs[2][0]:.2f}s", flush=True)
        same = (root / "streamed.safetensors").read_bytes() == (root / "end.safetensors").read_bytes()
        raw, rw = statistics.median(raws), statistics.median(rws)
        end_t = statistics.median(t[0] for t in times[names[2]])
        print(f"K={args.k} contributions of {size / 2**20:.0f} MiB (fp32), aggregate {args.aggregate}, Nesterov outer step with state; "
              f"median of {args.repeats}, page cache evicted before each; raw read of one checkpoint "
              f"{raw:.2f} s ({size / raw / 1e9:.2f} GB/s); read while one is written {rw:.2f} s\n")
        print("| merge latency after the last worker lands | seconds | x one raw read | x read + write | x at the end | CPU-s |")
        print("|---|---|---|---|---|---|")
        for n in names:
            lat, cpu = (statistics.median(t[i] for t in times[n]) for i in range(2))
            print(f"| {n} | {lat:.2f} | {lat / raw:.1f} | {lat / rw:.1f} | {lat / end_t:.2f} | {cpu:.1f} |")
        print(f"\nstreamed and at-the-end results bitwise identical (same order): {same}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
