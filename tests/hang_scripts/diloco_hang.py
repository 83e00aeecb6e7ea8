"""A DiLoCo job whose peer stops without dying (SIGSTOP) at its outer sync: argv[1] the case, argv[2] hang_timeout_s.

Run as a real job (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, by tests/test_diloco_hang.py). Each rank
trains a small MLP under lockstep's DDP on its node's group (as the Trainer does: ``train.diloco.make_groups``,
node ids from GROUP_RANK) with DiLoCo across nodes; the hang watchdog is the DDP's. Cases:

  one_a_node  2 ranks, 2 nodes; H = 5, one fragment: rank 1 stops before inner step 5, rank 0 waits in the
              outer all-reduce launched after inner step 5
  two_a_node  4 ranks, 2 nodes x 2; H = 4, 2 fragments landed 1 step after launch: rank 3 stops after inner
              step 4's optimizer step, before DiLoCo launches fragment 0: after step 5 rank 1 waits in fragment
              0's all-reduce of its bucket (with rank 3), rank 0 in the node's broadcast of it, rank 2 in its
              node's DDP all-reduce of step 5 (with rank 3)
"""

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from lockstep import DiLoCo, DiLoCoConfig, DistributedDataParallel
from lockstep.train.diloco import make_groups

CASE, TIMEOUT_S = sys.argv[1], float(sys.argv[2])
STEPS = 8


def stop():
    """Freeze this process, every thread (its watchdog's too) with it. First two of the watchdog's ticks (TIMEOUT_S /
    8 each) pass, so the heartbeat it leaves shows where it stopped, not a position of a few steps before."""
    print(f"MARK {time.time():.3f}", flush=True)  # the test measures how soon after this the job ends
    time.sleep(2 * TIMEOUT_S / 8 + 0.5)  # already absent from its peers' collectives
    os.kill(os.getpid(), signal.SIGSTOP)  # a peer that stops without dying (a frozen node)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    groups = make_groups()
    ddp = DistributedDataParallel(model, process_group=groups.ddp, hang_timeout_s=TIMEOUT_S)
    if CASE == "one_a_node":
        config = DiLoCoConfig(sync_every=5, bucket_cap_mb=0.002)
        stop_rank, stop_step, before_sync = 1, 5, False
    else:
        config = DiLoCoConfig(sync_every=4, fragments=2, bucket_cap_mb=0.002)
        stop_rank, stop_step, before_sync = 3, 4, True
    diloco = DiLoCo(model, config, group=groups.cross, node_group=groups.node)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dist.barrier()  # every rank built before step 1: a loaded machine starts them seconds apart
    for step in range(1, STEPS + 1):
        frozen = rank == stop_rank and step == stop_step
        if frozen and not before_sync:
            stop()
        g = torch.Generator().manual_seed(step * 100 + rank)
        loss = torch.nn.functional.cross_entropy(ddp(torch.randn(8, 16, generator=g)), torch.randint(0, 4, (8,),
                                                                                                       generator=g))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if frozen and before_sync:
            stop()
        diloco.step()  # CASE:sync
    print(f"rank {rank} finished {STEPS} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
