"""A round's merge latency after the last worker lands: folding contributions as they arrive vs not.

K contributions (fp32, shaped like a small Llama: bench.merge_throughput's shapes) and the round's
global weights and outer state are written to a run-like layout on local disk. One DiLoCo round
(Nesterov outer step, the outer state read and written) is then merged three ways, alternating,
each with every file evicted from the page cache first (posix_fadvise DONTNEED), so every read
comes from the disk:

- streamed: the round's global weights and outer state are read into memory and contributions
  0..K-2 folded into the running sum before the clock starts (the service does that while it
  waits for the last worker); timed: `merge_round`, which folds the last one while the outer step
  takes the mean slice by slice and writes the new global; the latency ends when the new global
  is published. The new outer state is written after that, as the service does after the round's
  record (`defer_state`): the time until it is written too is reported beside. The step runs in
  place in the held global weights and state. For reference, the same merge with the step on
  copies of them, then also writing the state before it returns (as until 2026-11-23), and
  folding one contribution alone (`RunningSum.add`);
- at the end: `merge_round` with no running sum (`round.stream_merge: false`, or a resumed service):
  K - 1 folded after the last one landed, the last beside the outer step;
- all at once: the merge engine streaming the K inputs side by side (the round merge before the
  running sum; merge.rounds._merge_once), for reference.

The baseline is the raw read of one checkpoint (16 MiB `readinto`), measured in the same run: the
streamed latency should be about one checkpoint read plus the outer step's maths and the global's
write. So a second reference is what the disk needs for that I/O alone: one checkpoint read
(dropped behind) while a file of its size is written with O_DIRECT, as the new global is
(bench.merge_throughput's "read + write").
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.merge_throughput import READ_WRITE, evict, llama_shapes
from bench.merge_throughput import raw_read as read_and_write
from core.checkpoint import write_checkpoint
from core.config import OuterConfig
from core.storage import Storage
from merge.rounds import Contribution, _merge_once, merge_round
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


def merged(s: Storage, contribs: list[Contribution], out: str, acc: RunningSum | None = None,
           defer: bool = True) -> Any:
    res = merge_round(s, "g1.safetensors", contribs, out, OUTER, state_in_key="s1.safetensors",
                      state_out_key="s2.safetensors", accumulator=acc, defer_state=defer)
    assert res.merged == [c.worker for c in contribs], res.rejected
    return res.pending_state


def fresh(root: Path, out: str) -> None:
    """The merge's outputs not there yet, and nothing in the page cache."""
    for name in (out, "s2.safetensors"):
        (root / name).unlink(missing_ok=True)
        (root / name).with_suffix(".json").unlink(missing_ok=True)
    evict(files(root))


def timed(run: Callable[[], Any]) -> tuple[float, float, float]:
    """(seconds until `run` returns: the new global published, CPU seconds of the process meanwhile,
    seconds until the outer state it left pending is written too)."""
    t0, c0 = time.perf_counter(), time.process_time()
    pending = run()
    lat, cpu = time.perf_counter() - t0, time.process_time() - c0
    if pending is not None:
        pending.wait()
    return lat, cpu, time.perf_counter() - t0


def streamed(s: Storage, root: Path, contribs: list[Contribution], defer: bool = True,
             in_place: bool = True) -> tuple[float, float, float]:
    acc = RunningSum(s, "g1.safetensors", state_key="s1.safetensors", preload=True,  # as the service does
                     step_in_place=in_place)
    for c in contribs[:-1]:
        assert acc.add(c)
    fresh(root, "streamed.safetensors")
    # the last contribution folds beside the outer step
    return timed(lambda: merged(s, contribs, "streamed.safetensors", acc, defer))


def fold_alone(s: Storage, root: Path, contribs: list[Contribution]) -> float:
    alone = RunningSum(s, "g1.safetensors")
    evict(files(root))
    t0 = time.perf_counter()
    assert alone.add(contribs[-1])
    return time.perf_counter() - t0


def at_the_end(s: Storage, root: Path, contribs: list[Contribution]) -> tuple[float, float, float]:
    fresh(root, "end.safetensors")
    return timed(lambda: merged(s, contribs, "end.safetensors"))


def all_at_once(s: Storage, root: Path, contribs: list[Contribution]) -> tuple[float, float, float]:
    fresh(root, "engine.safetensors")
    return timed(lambda: _merge_once(s, "g1.safetensors", contribs, "engine.safetensors", OUTER, "s1.safetensors",
                                     "s2.safetensors", "average", None, None, True).pending_state)


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
        names = ["streamed: last fold beside the outer step in place, state written after",
                 "streamed, the step on copies, state written after",
                 "streamed, the step on copies, state written before the global is published",
                 "(for reference: folding one contribution alone)",
                 "at the end: K folds + outer step", "all at once: engine, K lanes"]
        times: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
        raws, rws = [], []
        for _ in range(args.repeats):
            evict(files(root))
            raws.append(raw_read(root / "w0.safetensors"))
            evict(files(root))
            rws.append(read_and_write([root / "w0.safetensors"], READ_WRITE))
            runs = [streamed(s, root, contribs), streamed(s, root, contribs, in_place=False),
                    streamed(s, root, contribs, defer=False, in_place=False)]
            alone = fold_alone(s, root, contribs)
            runs += [(alone, float("nan"), float("nan")), at_the_end(s, root, contribs), all_at_once(s, root, contribs)]
            for n, r in zip(names, runs):
                times[n].append(r)
            print(f"repeat: raw {raws[-1]:.2f}s, read + write {rws[-1]:.2f}s, streamed {runs[0][0]:.2f}s (state written at {runs[0][2]:.2f}s), "
                  f"on copies {runs[1][0]:.2f}s, state before publishing {runs[2][0]:.2f}s, one fold alone {alone:.2f}s, "
                  f"at the end {runs[4][0]:.2f}s, all at once {runs[5][0]:.2f}s", flush=True)
        same = (root / "streamed.safetensors").read_bytes() == (root / "end.safetensors").read_bytes()
        raw, rw = statistics.median(raws), statistics.median(rws)
        end_t = statistics.median(t[0] for t in times[names[4]])
        print(f"K={args.k} contributions of {size / 2**20:.0f} MiB (fp32), Nesterov outer step with state; "
              f"median of {args.repeats}, page cache evicted before each; raw read of one checkpoint "
              f"{raw:.2f} s ({size / raw / 1e9:.2f} GB/s); read while one is written {rw:.2f} s\n")
        print("| merge latency after the last worker lands (new global published) | seconds | x one raw read | "
              "x read + write | x at the end | CPU-s | outer state written at |")
        print("|---|---|---|---|---|---|---|")
        for n in names:
            lat, cpu, done = (statistics.median(t[i] for t in times[n]) for i in range(3))
            print(f"| {n} | {lat:.2f} | {lat / raw:.1f} | {lat / rw:.1f} | {lat / end_t:.2f} | {cpu:.1f} | {done:.2f} |")
        print(f"\nstreamed and at-the-end results bitwise identical (same order): {same}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
