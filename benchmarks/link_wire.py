"""The wire alone over a shaped link: one all-reduce of a model's gradients against the same bytes in 4 pieces, all
at once (gloo runs two at a time), one after another, and two at a time. Why ``Reducer.serial_launch`` exists.

    python benchmarks/link_wire.py [--rates 100mbit,1gbit,2.5gbit] [--reps 3]

Root only (``tests/netns.py`` builds two network namespaces joined by a tbf-shaped veth pair, as
``benchmarks/link.py``); rank 0 prints the median ms of each pattern per rate. ``--loopback`` runs the same on
127.0.0.1 without namespaces.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

NUMEL = 10_250_000  # the link MLP's gradients (41 MB of fp32)


def worker(reps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    flat = torch.randn(NUMEL)
    pieces = list(flat.split(NUMEL // 4))

    def at_once(window: int) -> None:
        works = []
        for piece in pieces:
            works.append(dist.all_reduce(piece, async_op=True))
            if len(works) > window:
                works.pop(0).wait()
        for work in works:
            work.wait()

    patterns = {"one buffer": lambda: dist.all_reduce(flat), "4 at once": lambda: at_once(4),
                "4 one after another": lambda: at_once(0), "4, two at a time": lambda: at_once(1)}
    times: dict[str, list[float]] = {}
    for _ in range(reps):
        for name, run in patterns.items():
            dist.barrier()
            start = time.perf_counter()
            run()
            times.setdefault(name, []).append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print("  ".join(f"{k}: {statistics.median(v) * 1e3:.1f} ms" for k, v in times.items()), flush=True)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="100mbit,1gbit,2.5gbit")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--loopback", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.reps)
        return 0
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", "--reps", str(args.reps)]
    if args.loopback:
        port = str(random.randint(20000, 40000))
        procs = [subprocess.Popen(me, env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                               MASTER_PORT=port)) for r in range(2)]
        print("loopback:", flush=True)
        return max(p.wait(timeout=600) for p in procs)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import netns

    reason = netns.unavailable_reason()
    if reason:
        print(f"link_wire.py: skipped: {reason}")
        return 0
    with netns.two_nodes() as nodes:
        for rate in args.rates.split(","):
            for node in nodes:
                node.shape(rate)
            port = str(random.randint(20000, 40000))
            print(f"{rate}:", flush=True)
            procs = [subprocess.Popen(node.command(me), env=dict(
                os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR=nodes[0].addr, MASTER_PORT=port,
                GLOO_SOCKET_IFNAME=node.interface), stderr=subprocess.DEVNULL) for r, node in enumerate(nodes)]
            if max(p.wait(timeout=1800) for p in procs):
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
