"""Cost of the hang watchdog (issue 11): lockstep's DDP step with it on against off, side by side.

2 ranks on gloo, one thread each. Three copies of the same model train in one process, each with its
own DDP: ``on`` (hang_timeout_s=300: the progress observer on its reducer), ``off`` and ``off2``
(hang_timeout_s=0). Every iteration runs one step of each, in a rotating order, after a barrier;
rank 0's wall and CPU time per step are recorded and the medians compared. ``off2 / off`` is the
noise floor of the same measurement (two identical contenders). The watchdog thread is one per
process, so it runs during all three; its own work is one store write and one store check per second
(timed separately below as ``tick_us``). Because a loaded machine makes the side-by-side medians
noisy, the observer's own work per step is also timed in isolation (``observer_ms_per_step``) and
set against the step's CPU time (``observer_share_of_cpu_step``).

    python benchmarks/hang_watchdog_cost.py [--steps 60] [--warmup 5] [--models mlp,transformer]
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
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from ddp_step import MODELS  # noqa: E402  the same models as the step benchmark


def _worker(rank: int, world_size: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import lockstep
    from lockstep.diagnostics import watchdog

    try:
        report = {}
        for kind in args.models:
            build, batch = MODELS[kind]
            torch.manual_seed(0)
            models = {"on": lockstep.DistributedDataParallel(build(), hang_timeout_s=300),
                      "off": lockstep.DistributedDataParallel(build(), hang_timeout_s=0),
                      "off2": lockstep.DistributedDataParallel(build(), hang_timeout_s=0)}
            assert models["on"].reducer.observer is not None and models["off"].reducer.observer is None
            optims = {name: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for name, m in models.items()}
            x, y = batch(torch.Generator().manual_seed(rank))
            times = {name: [] for name in models}
            cpu = {name: [] for name in models}
            names = list(models)
            for it in range(args.warmup + args.steps):
                for name in names[it % 3:] + names[: it % 3]:
                    model, opt = models[name], optims[name]
                    dist.barrier()
                    start, cpu_start = time.perf_counter(), time.process_time()
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
                    if it >= args.warmup:
                        times[name].append(time.perf_counter() - start)
                        cpu[name].append(time.process_time() - cpu_start)
            med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
            cpu_med = {n: statistics.median(t) * 1e3 for n, t in cpu.items()}
            quart = {n: [round(q * 1e3, 3) for q in statistics.quantiles(t, n=4)] for n, t in times.items()}
            # The same cost without the machine's noise: one step's worth of observer events, timed in a loop.
            obs, nbuckets = models["on"].reducer.observer, len(models["on"].reducer.buckets)

            def one_step() -> None:
                obs.forward_start(), obs.forward_end(), obs.backward_start()
                for b in range(nbuckets):
                    obs.bucket_ready(b), obs.bucket_launch(b, 1, b), obs.bucket_launched(b, b)
                for b in range(nbuckets):
                    obs.wait_start(b, b), obs.wait_end(b, b)
                obs.backward_end(1)

            loops = 2000
            start = time.process_time()
            for _ in range(loops):
                one_step()
            observer_ms = (time.process_time() - start) / loops * 1e3
            report[kind] = {"buckets": nbuckets, "observer_ms_per_step": observer_ms,
                            "observer_share_of_cpu_step": observer_ms / cpu_med["off"], "median_ms": med, "quartiles_ms": quart, "cpu_median_ms": cpu_med,
                            "ratio_on_over_off": med["on"] / med["off"], "ratio_off2_over_off": med["off2"] / med["off"],
                            "cpu_ratio_on_over_off": cpu_med["on"] / cpu_med["off"],
                            "cpu_ratio_off2_over_off": cpu_med["off2"] / cpu_med["off"]}
        dog = watchdog._WATCHDOG
        start = time.perf_counter()
        for _ in range(50):
            dog.publish()
            dog.store.check(["alarm"])
        report["tick_us"] = (time.perf_counter() - start) / 50 * 1e6
        if rank == 0:
            queue.put(report)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    args.models = args.models.split(",")
    from lockstep.process_group import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    report = queue.get(timeout=3600)
    for p in procs:
        p.join()
    report.update(torch=torch.__version__, steps=args.steps, warmup=args.warmup,
                  load_avg=os.getloadavg(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    print(json.dumps(report, indent=1))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"hang_watchdog_cost_{datetime.date.today().isoformat()}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
