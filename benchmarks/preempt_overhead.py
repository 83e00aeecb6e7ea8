"""What the preemption check costs per step: a DDP step with and without PreemptionWatch.should_stop().

2 ranks on gloo, one thread each. Blocks of steps with the check and without alternate, a
barrier between blocks only (as the Trainer runs: no collective of its own between steps);
rank 0's median time per step is compared. The check is one asynchronous 4-byte MAX all-reduce per step,
waited for one step later (lockstep/train/preempt.py).

    python benchmarks/preempt_overhead.py [--blocks 30] [--block 20] [--width 256] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _worker(rank: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from lockstep import DistributedDataParallel
    from lockstep.train.preempt import PreemptionWatch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                          nn.Linear(args.width, 10))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = PreemptionWatch(None, torch.device("cpu"))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    times = {"with check": [], "without": []}
    call_s: list[float] = []  # the main thread's time inside should_stop(): wait for the last, issue the next

    def block(check: bool) -> float:
        # a block of steps with no barrier inside, as the Trainer runs them: the check's all-reduce
        # overlaps the next step, and DDP's first bucket all-reduce is the next collective after it
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.block):
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if check:
                t0 = time.perf_counter()
                watch.should_stop()
                call_s.append(time.perf_counter() - t0)
        watch.drain()
        return (time.perf_counter() - start) / args.block

    for i in range(args.warmup + args.blocks):
        order = (True, False) if i % 2 else (False, True)
        for check in order:
            per_step = block(check)
            if i >= args.warmup:
                times["with check" if check else "without"].append(per_step)
    watch.drain()
    if rank == 0:
        queue.put((times, statistics.median(call_s)))
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=30, help="blocks of each variant, alternating")
    p.add_argument("--block", type=int, default=20, help="steps per block")
    p.add_argument("--warmup", type=int, default=2, help="blocks of each variant not counted")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    from lockstep.process_group import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, args, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    times, call_median_s = queue.get(timeout=600)
    for proc in procs:
        proc.join(60)
    medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratio = medians["with check"] / medians["without"]
    lines = [f"# Preemption check overhead ({datetime.date.today()})", "",
             f"2 gloo ranks x 1 thread, MLP 64-{args.width}-{args.width}-10, batch 32; {args.blocks} blocks of "
             f"{args.block} steps per variant, alternating, no barrier inside a block; rank 0's median time per step.",
             f"Load average while measuring: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.", "",
             "| variant | median step (ms) |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in medians.items()]
    lines += ["", f"ratio with/without: {ratio:.3f}",
              f"should_stop() itself (wait for the previous all-reduce, issue the next): median "
              f"{call_median_s * 1e6:.0f} us per step"]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"preempt_overhead_{datetime.date.today()}")
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump({"medians_ms": medians, "ratio": ratio, "should_stop_median_us": call_median_s * 1e6,
                   "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
