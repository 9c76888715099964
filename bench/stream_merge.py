"""A round's merge latency after the last worker lands: folding contributions as they arrive vs not.

K contributions (fp32, shaped like a small Llama: bench.merge_throughput's shapes) and the round's
global weights and outer state are written to a run-like layout on local disk. One DiLoCo round
(Nesterov outer step, the outer state read and written) is then merged three ways, alternating,
each with every file evicted from the page cache first (posix_fadvise DONTNEED), so every read
comes from the disk:

- streamed: the round's global weights and outer state are read into memory and contributions
  0..K-2 folded into the running sum before the clock starts (the service does that while it
  waits for the last worker); timed: `merge_round`, which folds the last one while the outer step
  takes the mean tensor by tensor and writes the new global and state; for reference, folding
  one contribution alone (`RunningSum.add`) is timed too;
- at the end: `merge_round` with no running sum (`round.stream_merge: false`, or a resumed service):
  K - 1 folded after the last one landed, the last beside the outer step;
- all at once: the merge engine streaming the K inputs side by side (the round merge before the
  running sum; merge.engine._merge_once), for reference.

The baseline is the raw read of one checkpoint (16 MiB `readinto`), measured in the same run: the
streamed latency should be about one checkpoint read plus the outer step's maths and writes.
Every output is deleted before each merge, as in a run, where round r+1's files do not exist yet
(replacing a file by rename makes ext4 flush the new one first, which a run never pays).

    python -m bench.stream_merge [--k 8] [--hidden 1024 --layers 4] [--repeats 2] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.merge_throughput import evict, llama_shapes
from core.checkpoint import write_checkpoint
from core.config import OuterConfig
from core.storage import Storage
from merge.engine import Contribution, _merge_once, merge_round
from merge.incremental import RunningSum

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
        contribs.append(Contribution(i, f"w{i}.safetensors", 1000.0 + i))
    del base
    merge_round(s, "g0.safetensors", contribs, "g1.safetensors", OUTER, state_in_key=None,
                state_out_key="s1.safetensors")  # round 0 makes the outer state that round 1 reads
    return s, contribs


def files(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors"))


def raw_read(p: Path) -> float:
    buf = bytearray(16 << 20)
    t0 = time.perf_counter()
    with open(p, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def merged(s: Storage, contribs: list[Contribution], out: str, acc: RunningSum | None = None) -> None:
    res = merge_round(s, "g1.safetensors", contribs, out, OUTER, state_in_key="s1.safetensors",
                      state_out_key="s2.safetensors", accumulator=acc)
    assert res.merged == [c.worker for c in contribs], res.rejected


def fresh(root: Path, out: str) -> None:
    """The merge's outputs not there yet, and nothing in the page cache."""
    for name in (out, "s2.safetensors"):
        (root / name).unlink(missing_ok=True)
        (root / name).with_suffix(".json").unlink(missing_ok=True)
    evict(files(root))


def streamed(s: Storage, root: Path, contribs: list[Contribution]) -> tuple[float, float, float]:
    """(latency, CPU seconds of the process meanwhile, seconds to fold one contribution alone)."""
    acc = RunningSum(s, "g1.safetensors", state_key="s1.safetensors", preload=True)  # as the service does
    for c in contribs[:-1]:
        assert acc.add(c)
    fresh(root, "streamed.safetensors")
    t0, c0 = time.perf_counter(), time.process_time()
    merged(s, contribs, "streamed.safetensors", acc)  # the last contribution folds beside the outer step
    lat, cpu = time.perf_counter() - t0, time.process_time() - c0
    alone = RunningSum(s, "g1.safetensors")
    evict(files(root))
    t0 = time.perf_counter()
    assert alone.add(contribs[-1])
    return lat, cpu, time.perf_counter() - t0


def at_the_end(s: Storage, root: Path, contribs: list[Contribution]) -> tuple[float, float]:
    fresh(root, "end.safetensors")
    t0, c0 = time.perf_counter(), time.process_time()
    merged(s, contribs, "end.safetensors")
    return time.perf_counter() - t0, time.process_time() - c0


def all_at_once(s: Storage, root: Path, contribs: list[Contribution]) -> tuple[float, float]:
    fresh(root, "engine.safetensors")
    t0, c0 = time.perf_counter(), time.process_time()
    _merge_once(s, "g1.safetensors", contribs, "engine.safetensors", OUTER, "s1.safetensors", "s2.safetensors",
                "average", None, None)
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = p.parse_args()
    dims = (args.hidden, int(args.hidden * 2.6875), 32000, args.layers)
    root = Path(tempfile.mkdtemp(prefix="bench-stream-", dir=args.dir))
    try:
        s, contribs = setup(root, args.k, dims)
        size = (root / "w0.safetensors").stat().st_size
        names = ["streamed: last fold beside the outer step", "(for reference: folding one contribution alone)",
                 "at the end: K folds + outer step", "all at once: engine, K lanes"]
        times: dict[str, list[float]] = {n: [] for n in ["raw", *names]}
        cpu: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.repeats):
            evict(files(root))
            times["raw"].append(raw_read(root / "w0.safetensors"))
            (lat, c, fold), end, once = streamed(s, root, contribs), at_the_end(s, root, contribs), \
                all_at_once(s, root, contribs)
            for n, (t, c_) in zip(names, [(lat, c), (fold, float("nan")), end, once]):
                times[n].append(t)
                cpu[n].append(c_)
            print(f"repeat: raw {times['raw'][-1]:.2f}s, streamed {lat:.2f}s (one fold alone {fold:.2f}s), at the end "
                  f"{end[0]:.2f}s, all at once {once[0]:.2f}s", flush=True)
        same = (root / "streamed.safetensors").read_bytes() == (root / "end.safetensors").read_bytes()
        raw = statistics.median(times["raw"])
        end_t = statistics.median(times[names[2]])
        print(f"K={args.k} contributions of {size / 2**20:.0f} MiB (fp32), Nesterov outer step with state; "
              f"median of {args.repeats}, page cache evicted before each; raw read of one checkpoint "
              f"{raw:.2f} s ({size / raw / 1e9:.2f} GB/s)\n")
        print("| merge latency after the last worker lands | seconds | x one raw read | x at the end | CPU-s |")
        print("|---|---|---|---|---|")
        for n in names:
            t = statistics.median(times[n])
            print(f"| {n} | {t:.2f} | {t / raw:.1f} | {t / end_t:.2f} | {statistics.median(cpu[n]):.1f} |")
        print(f"\nstreamed and at-the-end results bitwise identical (same order): {same}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
