"""Merge throughput and memory: our streaming merge vs the raw read rate of the same files.

Creates N checkpoints shaped like a small Llama (39 tensors, ~1.02 GiB each in fp32 by default),
each a Hugging Face directory (model.safetensors + config.json) with our manifest beside the
weights, in a temporary directory on local disk (deleted at the end). Then, for K inputs:

- raw read: the same files read K at once in threads, through the page cache (16 MiB `readinto`;
  and 16 MiB reads each dropped from the cache behind them) and around it (O_DIRECT, 16 and 64 MiB
  reads), and one after another through the cache; the fastest is the physical limit the merges
  are compared with;
- read + write: the same files read dropped behind while one file of an input's size is written,
  as a merge must write its output: a second reference, not the limit;
- ours: `merge.manual.manual_merge` (average), digest of every input verified against its manifest;
- ours, plain files: the same with the manifests moved away (nothing to verify, as for files from
  elsewhere: that is what mergekit and the naive baseline do);
- ours, TIES (peak RSS only): `--method ties --density 0.2` with input 0 as the base, which reads
  every input twice (the trim thresholds first, then the stream);
- naive: `safetensors.torch.load_file` every checkpoint, then average, then `save_file`;
- mergekit: `mergekit-yaml` with `merge_method: linear` (float32), when it is installed.

This disk's rate drifts by tens of percent from one minute to the next, so each repeat measures
the raw reads and then every merge, and a merge's ratio is taken against the raw read of its own
repeat; the table reports medians over the repeats. Each merge runs in its own process; its wall
time minus the start-up of the same tool on a tiny merge gives the merge time, its peak RSS (wait4's ru_maxrss) is reported raw and minus that tiny
merge's. The inputs are dropped from the page cache before every measurement (posix_fadvise
DONTNEED on the input files; /proc/sys/vm/drop_caches once at the start when root),
so inputs come from the disk while the tools' libraries stay cached; where eviction is impossible
every measurement runs warm (the inputs read once before it).

    python -m bench.merge_throughput [--k 8] [--rss-k 2,8,16] [--dir /tmp] [--repeats 2]
        [--mergekit /path/to/mergekit-yaml] [--json results.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BUF = 16 << 20
TOOLS = {"ours": "ours", "ours-plain": "ours", "ours-ties": "ties", "naive": "naive", "mergekit": "mergekit"}
ROOT = Path(__file__).resolve().parent.parent


# -- checkpoints --------------------------------------------------------------------------------
def llama_shapes(hidden: int, inter: int, vocab: int, layers: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        for n in ("q", "k", "v", "o"):
            shapes[p + f"self_attn.{n}_proj.weight"] = (hidden, hidden)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def llama_config(hidden: int, inter: int, vocab: int, layers: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": max(1, hidden // 128),
            "num_key_value_heads": max(1, hidden // 128), "vocab_size": vocab, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "float32", "hidden_act": "silu"}


def make_checkpoints(folder: Path, n: int, dims: tuple[int, int, int, int], dtype: str) -> list[Path]:
    import torch

    from core.checkpoint_writer import write_checkpoint
    from core.storage import Storage

    shapes = llama_shapes(*dims)
    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    out = []
    for i in range(n):
        d = folder / f"ck_{i:02d}"
        if not (d / "model.json").exists():
            g = torch.Generator().manual_seed(i)
            tensors = {k: (torch.rand(s, generator=g) - 0.5).to(tdtype) for k, s in shapes.items()}
            write_checkpoint(Storage(str(d)), "model.safetensors", tensors, metadata={"format": "pt"})
            (d / "config.json").write_text(json.dumps(llama_config(*dims)))
            del tensors
        out.append(d)
    return out


# -- the page cache -----------------------------------------------------------------------------
def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict(files: list[Path]) -> bool:
    """Drop just these files from the page cache (the tools' own libraries stay cached), checked:
    this VM's kernel now and then leaves pages behind, so it is retried until none is found."""
    os.sync()
    try:
        for _ in range(5):
            for p in files:
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            if not any(cached_pages(p) for p in files):
                return True
        print("warning: some input pages stay in the page cache after 5 evictions", flush=True)
        return True
    except (OSError, AttributeError):
        return False


def cached_pages(p: Path) -> int:
    """Pages of the file in the page cache (util-linux's fincore: asking reads nothing), 0 where unknown."""
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "PAGES", str(p)],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return int(out[0]) if out else 0
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def warm(files: list[Path]) -> None:
    buf = bytearray(BUF)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# -- raw read -----------------------------------------------------------------------------------
def _read_file(p: Path) -> int:
    buf = memoryview(bytearray(BUF))
    n = 0
    with open(p, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            n += k
    return n


def _read_direct(p: Path, block: int) -> int:
    import mmap
    fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
    n = 0
    try:
        while k := os.preadv(fd, [buf], n):
            n += k
    finally:
        os.close(fd)
    return n


def _read_dropping(p: Path) -> int:
    """Through the page cache, each 16 MiB dropped from it once read (posix_fadvise DONTNEED): the
    kernel's read-ahead without the cache filling memory. On the development machine the fastest
    way to read these files (2.3-2.7 GB/s, 1.3 CPU-s for 8 GiB, where a plain buffered read fell to
    1.0 GB/s and 12 CPU-s once the cache had to reclaim memory)."""
    fd = os.open(p, os.O_RDONLY)
    buf = memoryview(bytearray(BUF))
    n = 0
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while k := os.preadv(fd, [buf], n):
            os.posix_fadvise(fd, n, k, os.POSIX_FADV_DONTNEED)
            n += k
    finally:
        os.close(fd)
    return n


RAW_MODES = {"sequential": None, "parallel": _read_file, "parallel, dropped behind": _read_dropping,
             "direct 16 MiB": lambda p: _read_direct(p, 16 << 20), "direct 64 MiB": lambda p: _read_direct(p, 64 << 20)}


def _write(p: Path, n: int) -> None:
    """n bytes (not zeros: nothing for the disk to skip) written to a new file in 8 MiB writes,
    then flushed to the disk, as a merge's output must reach it."""
    buf = os.urandom(8 << 20)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for at in range(0, n, len(buf)):
            os.pwrite(fd, buf, at)
        os.fsync(fd)
    finally:
        os.close(fd)
        p.unlink()


READ_WRITE = "dropped behind, one file written"
"""Not a raw read but what a merge must at least do with the disk: the inputs read as the fastest
raw read usually does, while a file of one input's size is written (the merged output)."""


def raw_read(files: list[Path], mode: str) -> float:
    """Seconds to read every byte of `files`: one after another, or all at once in threads (RAW_MODES);
    READ_WRITE: all at once, dropped behind, while one file of files[0]'s size is written beside them."""
    t0 = time.perf_counter()
    if mode == "sequential":
        for p in files:
            _read_file(p)
        return time.perf_counter() - t0
    read = _read_dropping if mode == READ_WRITE else RAW_MODES[mode]
    threads = [threading.Thread(target=read, args=(p,)) for p in files]
    if mode == READ_WRITE:
        out = files[0].parent.parent / "raw-write.tmp"
        threads.append(threading.Thread(target=_write, args=(out, files[0].stat().st_size)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


# -- children: one merge per process ------------------------------------------------------------
def child(argv: list[str]) -> None:
    if argv[0] == "make":  # the checkpoints are made in a child too: the parent stays small, so the
        # RSS that its forked children report is their own (fork counts the parent's pages)
        make_checkpoints(Path(argv[1]), int(argv[2]), tuple(int(x) for x in argv[3].split(",")), argv[4])
        return
    kind, out, inputs = argv[0], argv[1], argv[2:]
    import torch
    from safetensors.torch import load_file, save_file

    from merge.manual import ManualMerge, manual_merge
    t0 = time.perf_counter()
    if kind == "ours":
        manual_merge(ManualMerge(inputs, out))
    elif kind == "ties":
        manual_merge(ManualMerge(inputs, out, method="ties", base=inputs[0], params={"density": 0.2}))
    elif kind == "naive":
        models = [load_file(str(Path(p) / "model.safetensors")) for p in inputs]
        merged = {}
        for name in models[0]:
            acc = models[0][name].to(torch.float32, copy=True)
            for m in models[1:]:
                acc += m[name]
            merged[name] = (acc / len(models)).to(models[0][name].dtype)
        os.makedirs(out, exist_ok=True)
        save_file(merged, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})
    os.sync()  # the output on the disk, inside this merge's time, not the next measurement's
    print(json.dumps({"inner_s": time.perf_counter() - t0}))


# Children are started by a small launcher process, not by this one: on Linux a child's peak RSS
# (wait4's ru_maxrss) keeps the high-water mark of the address space it forked from, and this
# process holds hundreds of MiB of read buffers by then, which every child would report as its own.
_LAUNCHER = r"""
import json, os, subprocess, sys, threading, time
for line in sys.stdin:
    req = json.loads(line)
    t0 = time.perf_counter()
    proc = subprocess.Popen(req["cmd"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=req["cwd"])
    out, err = [], []
    readers = [threading.Thread(target=lambda: out.append(proc.stdout.read())),
               threading.Thread(target=lambda: err.append(proc.stderr.read()))]
    for r in readers:
        r.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    for r in readers:
        r.join()
    print(json.dumps({"wall": wall, "rss": usage.ru_maxrss * 1024, "cpu": usage.ru_utime + usage.ru_stime,
                      "rc": os.waitstatus_to_exitcode(status), "out": b"".join(out).decode(errors="replace"),
                      "err": b"".join(err).decode(errors="replace")[-3000:]}), flush=True)
"""
_launcher: subprocess.Popen | None = None


def start_launcher() -> None:
    global _launcher
    _launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)


def run_child(cmd: list[str]) -> tuple[float, int, float, str]:
    """(wall seconds, peak RSS bytes, CPU seconds, stdout) of one process, started by the launcher."""
    if _launcher is None:
        start_launcher()
    assert _launcher is not None and _launcher.stdin is not None and _launcher.stdout is not None
    _launcher.stdin.write(json.dumps({"cmd": cmd, "cwd": str(ROOT)}) + "\n")
    _launcher.stdin.flush()
    res = json.loads(_launcher.stdout.readline())
    if res["rc"] != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])}... failed ({res['rc']}):\n{res['err']}")
    return res["wall"], res["rss"], res["cpu"], res["out"]


def merge_cmd(kind: str, out: Path, inputs: list[Path], mergekit: str | None) -> list[str]:
    if kind == "mergekit":
        cfg = out.parent / f"{out.name}.yml"
        lines = ["merge_method: linear", "dtype: float32", "models:"]
        for p in inputs:
            lines += [f"  - model: {p}", "    parameters:", "      weight: 1.0"]
        cfg.write_text("\n".join(lines) + "\n")
        return [mergekit, str(cfg), str(out), "--no-copy-tokenizer", "--no-write-model-card", "--quiet",
                "--out-shard-size", "100B"]
    return [sys.executable, "-m", "bench.merge_throughput", "--child", kind, str(out), *map(str, inputs)]


def hide_manifests(dirs: list[Path], hide: bool) -> None:
    for d in dirs:
        a, b = d / "model.json", d / "model.json.hidden"
        if hide and a.exists():
            a.rename(b)
        elif not hide and b.exists():
            b.rename(a)


# -- the benchmark ------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    ap.add_argument("--k", type=int, default=8, help="inputs of the throughput comparison")
    ap.add_argument("--rss-k", default="2,8,16", help="input counts of the peak-RSS sweep")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="local disk for the temporary checkpoints")
    ap.add_argument("--dims", default="2048,5632,16384,4", help="hidden,intermediate,vocab,layers")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--repeats", type=int, default=3, help="runs per throughput measurement; medians are reported")
    ap.add_argument("--mergekit", default=shutil.which("mergekit-yaml"), help="mergekit-yaml executable")
    ap.add_argument("--naive-max-k", type=int, default=8, help="largest K for the naive baseline (it holds K models)")
    ap.add_argument("--keep", help="reuse/keep checkpoints in this folder instead of a temporary one")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.child is not None:
        child(args.child)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed benchmark still removes its files
    start_launcher()  # while this process is still small (see run_child)

    dims = tuple(int(x) for x in args.dims.split(","))
    rss_ks = [int(x) for x in args.rss_k.split(",")]
    n = max([args.k, *rss_ks])
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="islands-merge-bench-", dir=args.dir))
    folder.mkdir(parents=True, exist_ok=True)
    results: dict = {"command": " ".join(["python -m bench.merge_throughput", *sys.argv[1:]]), "dims": dims,
                     "dtype": args.dtype, "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}
    try:
        t0 = time.time()
        for sub, d in (("big", dims), ("tiny", (64, 128, 128, 4))):
            run_child([sys.executable, "-m", "bench.merge_throughput", "--child", "make", str(folder / sub), str(n),
                       ",".join(map(str, d)), args.dtype])
        dirs = [folder / "big" / f"ck_{i:02d}" for i in range(n)]
        tiny = [folder / "tiny" / f"ck_{i:02d}" for i in range(n)]
        files = [d / "model.safetensors" for d in dirs]
        size = files[0].stat().st_size
        results.update(checkpoint_bytes=size, tensors=len(llama_shapes(*dims)), created_s=round(time.time() - t0, 1))
        print(f"{n} checkpoints of {size / 2**30:.3f} GiB ({len(llama_shapes(*dims))} tensors, {args.dtype}) "
              f"in {folder}, made in {time.time() - t0:.0f}s", flush=True)
        dropped = drop_caches()
        cold = evict(files)
        results.update(drop_caches=dropped, cold=cold)
        print(("page cache dropped (/proc/sys/vm/drop_caches) once; " if dropped else "") +
              ("the inputs are evicted from the page cache (posix_fadvise DONTNEED) before every measurement: "
               "cold reads from disk" if cold else "cannot evict the inputs from the page cache: every measurement "
               "runs warm"), flush=True)

        def prepare(fs: list[Path]) -> None:
            if cold:
                evict(fs)
            else:
                warm(fs)

        kinds = ["ours", "ours-plain", "naive"] + (["mergekit"] if args.mergekit else [])
        if not args.mergekit:
            print("mergekit: not installed (pip install mergekit, then --mergekit PATH); skipped", flush=True)

        startup: dict[str, tuple[float, int]] = {}

        def measure(kind: str, k: int, big: bool = True) -> tuple[float, int, float, float | None]:
            """(wall s, peak RSS, CPU s, the merge's own time when it reports it) of one merge."""
            ins = (dirs if big else tiny)[:k]
            out = folder / f"out-{kind}"
            shutil.rmtree(out, ignore_errors=True)
            hide_manifests(ins, kind == "ours-plain")
            try:
                prepare([d / "model.safetensors" for d in ins])
                tool = TOOLS[kind]
                wall, rss, cpu, stdout = run_child(merge_cmd(tool, out, ins, args.mergekit))
            finally:
                hide_manifests(ins, False)
                shutil.rmtree(out, ignore_errors=True)
            report = json.loads(stdout.strip().splitlines()[-1]) if tool != "mergekit" else {}
            return wall, rss, cpu, report.get("inner_s")

        for kind in [*kinds, "ours-ties"]:  # start-up: the same tool merging 2 tiny checkpoints (median of 3)
            runs = [measure(kind, 2, big=False) for _ in range(3)]
            startup[kind] = (sorted(r[0] for r in runs)[1], sorted(r[1] for r in runs)[1], sorted(r[2] for r in runs)[1])
        results["startup"] = {k: {"s": round(v[0], 3), "rss": v[1], "cpu_s": round(v[2], 2)} for k, v in startup.items()}
        print("start-up (tiny merge): " + ", ".join(f"{k} {v[0]:.1f}s {v[1] / 2**20:.0f} MiB" for k, v in startup.items()),
              flush=True)

        k = args.k
        in_bytes = size * k
        raw: dict[str, list[float]] = {mode: [] for mode in RAW_MODES}
        runs: dict[str, list[tuple[float, int, float, float | None]]] = {kind: [] for kind in kinds}
        limits: list[float] = []
        read_write: list[float] = []
        for rep in range(args.repeats):  # the disk drifts: each repeat is raw reads, then every merge
            for mode in RAW_MODES:
                prepare(files[:k])
                raw[mode].append(in_bytes / raw_read(files[:k], mode) / 1e9)
            limits.append(max(v[-1] for v in raw.values()))
            prepare(files[:k])
            read_write.append(in_bytes / raw_read(files[:k], READ_WRITE) / 1e9)
            print(f"repeat {rep + 1}: raw read of {k} files " + ", ".join(f"{m} {v[-1]:.3f}" for m, v in raw.items())
                  + f" GB/s; {READ_WRITE} {read_write[-1]:.3f} GB/s of input", flush=True)
            for kind in kinds:
                if kind == "naive" and k > args.naive_max_k:
                    continue
                runs[kind].append(measure(kind, k))
                net = runs[kind][-1][0] - startup[kind][0]
                print(f"  {kind:>13}: {net:.1f}s, {in_bytes / net / 1e9:.3f} GB/s = "
                      f"{in_bytes / net / 1e9 / limits[-1]:.2f} x this repeat's fastest raw read, "
                      f"{runs[kind][-1][2]:.1f} CPU-s", flush=True)
        results["raw_read_gbps"] = {m: [round(x, 3) for x in v] for m, v in raw.items()}
        results["read_write_gbps"] = [round(x, 3) for x in read_write]

        rows = []
        for kind, got in runs.items():
            if not got:
                continue
            nets = [r[0] - startup[kind][0] for r in got]
            rates = [in_bytes / n / 1e9 for n in nets]
            ratios = [rate / lim for rate, lim in zip(rates, limits)]
            rw = [rate / lim for rate, lim in zip(rates, read_write)]
            rss = max(r[1] for r in got)
            cpu_per_gb = (statistics.median(r[2] for r in got) - startup[kind][2]) / (in_bytes / 1e9)
            inner = got[0][3] is not None and statistics.median(r[3] for r in got)
            rate, net = statistics.median(rates), statistics.median(nets)
            rows.append({"kind": kind, "k": k, "merge_s": [round(n, 2) for n in nets], "gbps": round(rate, 3),
                         "cpu_s": [round(r[2], 2) for r in got],
                         "ratio_to_raw": round(statistics.median(ratios), 3), "ratios": [round(x, 3) for x in ratios],
                         "ratio_to_read_write": round(statistics.median(rw), 3),
                         "inner_s": inner and round(inner, 2),
                         "cpu_s_per_gb": round(cpu_per_gb, 2), "peak_rss": rss, "rss_x_ckpt": round(rss / size, 3),
                         "rss_minus_startup_x_ckpt": round((rss - startup[kind][1]) / size, 3),
                         "loadavg": round(os.getloadavg()[0], 2)})
            print(f"{kind:>13} K={k}: median {net:.1f}s, {rate:.3f} GB/s = {statistics.median(ratios):.2f} x raw read "
                  f"(per repeat {', '.join(f'{x:.2f}' for x in ratios)}), {statistics.median(rw):.2f} x read+write, "
                  f"{cpu_per_gb:.2f} CPU-s/GB; peak RSS "
                  f"{rss / 2**30:.2f} GiB = {rss / size:.2f} x ckpt ({(rss - startup[kind][1]) / size:.2f} x above "
                  f"start-up)", flush=True)
        results["throughput"] = rows

        sweep = []
        for kk in rss_ks:
            for kind in [*kinds, "ours-ties"]:
                if kind == "ours-plain" or (kind == "naive" and kk > args.naive_max_k):
                    continue
                done = next((r for r in rows if r["kind"] == kind and r["k"] == kk), None)
                if done is not None:
                    rss = done["peak_rss"]
                else:
                    rss = measure(kind, kk)[1]
                sweep.append({"kind": kind, "k": kk, "peak_rss": rss, "rss_x_ckpt": round(rss / size, 3),
                              "rss_minus_startup_x_ckpt": round((rss - startup[kind][1]) / size, 3)})
                print(f"{kind:>10} K={kk}: peak RSS {rss / 2**30:.2f} GiB = {rss / size:.2f} x ckpt "
                      f"({(rss - startup[kind][1]) / size:.2f} x above start-up)", flush=True)
        results["rss_sweep"] = sweep
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    results["loadavg_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
