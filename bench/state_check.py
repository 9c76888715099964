"""What checking a worker's optimizer-state snapshot costs against loading it: a restarted job
reads its snapshot (worker/state.py) and, before any tensor reaches AdamW, checks it against the
live model and optimizer (names, shapes, dtypes, the three slots, the moments' Cauchy-Schwarz and
grad_clip bounds: check_state with an Expect).

A transformer-shaped model (bench.replica_cost's shapes) takes two real AdamW steps; its state is
written as a worker writes it (core.checkpoint_writer). Then, alternating, `repeats` times each
after one of each not counted, from the page cache: the load alone (core.shards.read_checkpoint:
read, hash, verify) and the load plus the check. The baseline is the load alone, in the same run.

    python -m bench.state_check [--hidden 512,1024] [--layers 8] [--dir /var/tmp] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from bench.replica_cost import model
from core.checkpoint_writer import write_checkpoint
from core.layout import RunLayout
from core.shards import read_checkpoint
from core.storage import Storage
from worker.params import optimizer_tensors
from worker.state import check_state, expect_of

L = RunLayout()


def trained(hidden: int, layers: int) -> tuple[torch.nn.Module, torch.optim.AdamW, list[str]]:
    net = torch.nn.Module()
    for name, t in model(hidden, layers).items():
        net.register_parameter(name.replace(".", "_"), torch.nn.Parameter(t))
    names = [n for n, _ in net.named_parameters()]
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=(0.9, 0.95))
    for _ in range(2):
        for p in net.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
    return net, opt, names


def measure(s: Storage, hidden: int, layers: int, repeats: int) -> dict[str, float]:
    net, opt, names = trained(hidden, layers)
    key = L.worker_state(0, 0)
    write_checkpoint(s, key, optimizer_tensors(opt, names), manifest={"round": 0, "worker": 0})
    expect = expect_of(0, net, opt, names, grad_clip=1.0)
    times: dict[str, list[float]] = {"load": [], "load + check": []}
    for i in range(repeats + 1):
        for what in times:
            t0 = time.perf_counter()
            tensors = read_checkpoint(s, key, "bench state")
            if what != "load":
                check_state(tensors, "bench state", 1.0, expect)
            if i:  # the first of each warms the page cache and the allocator
                times[what].append(time.perf_counter() - t0)
    params = sum(p.numel() for p in net.parameters())
    return {"params": params, **{k: statistics.median(v) for k, v in times.items()}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", default="512,1024")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dir", default=None, help="where the snapshot is written (default: a temporary folder)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # a worker's restart reads on its main thread
    print(f"{'params':>8} {'state MB':>9} {'load s':>8} {'load+check s':>13} {'ratio':>6}")
    for hidden in (int(h) for h in args.hidden.split(",")):
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            m = measure(Storage(d), hidden, args.layers, args.repeats)
        mb = 2 * 4 * m["params"] / 1e6
        print(f"{m['params'] / 1e6:7.1f}M {mb:9.0f} {m['load']:8.3f} {m['load + check']:13.3f} "
              f"{m['load + check'] / m['load']:5.2f}x")


if __name__ == "__main__":
    main()
