"""The hang catalogue: one training script, one way to hang per case (argv[1]), hang_timeout_s = argv[2].

Run as a real job (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, by tests/test_hang.py or
torchrun). Every case trains 6 steps of a small 3-bucket MLP and ends with a barrier; rank 1
misbehaves at step 3. The line numbers of the misbehaving lines are what the reports must name:
each carries a ``# CASE:`` marker that the test looks up.
"""

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from lockstep import DistributedDataParallel

CASE = sys.argv[1]
TIMEOUT_S = float(os.environ.get("LOCKSTEP_HANG_TIMEOUT_S", 0) if sys.argv[2] == "env" else sys.argv[2])
STEPS, BAD_RANK, BAD_STEP = 6, 1, 3


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 4)
        self.only_c = False  # a branch one rank may take: the start-up check sees the same shapes
        self.explode = False  # a forward that raises on one rank

    def forward(self, x):
        if self.explode:
            mark()
            raise ValueError("a bad batch on purpose")  # CASE:raise the rank leaves; its peer's all-reduce fails
        h = torch.relu(self.a(x))
        h = torch.relu(self.c(h)) if self.only_c else torch.relu(self.b(h)) + torch.relu(self.c(h))
        if CASE == "slow" and dist.get_rank() == 0:
            time.sleep(0.5 * TIMEOUT_S)  # a long but healthy forward, within the timeout
        return self.head(h)


def mark():
    print(f"MARK {time.time():.3f}", flush=True)  # the test measures how soon after this the job ends


def batch(step, rank):
    g = torch.Generator().manual_seed(step * 100 + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    # "env": DDP's default, from LOCKSTEP_HANG_TIMEOUT_S (`lockstep launch --hang-timeout`)
    timeout = {} if sys.argv[2] == "env" else {"hang_timeout_s": float(sys.argv[2])}
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01, **timeout)  # 3 buckets: [head, c], [b], [a]
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    # Every rank ready before step 1: the test starts 16 ranks at once on two cores, and a rank still finishing
    # its construction 6 s after rank 0 began step 1 was once reported, rightly, as stuck before step 1.
    dist.barrier()
    steps = STEPS - 1 if CASE == "fewer" and rank == BAD_RANK else STEPS
    for step in range(1, steps + 1):
        bad = rank == BAD_RANK and step == BAD_STEP
        x, y = batch(step, rank)
        if CASE == "data" and bad:
            mark()
            time.sleep(1000)  # CASE:data a data loader that never returns
        model.only_c = CASE == "branch" and bad  # CASE:branch
        model.explode = CASE == "raise" and bad
        out = ddp(x)  # CASE:forward
        loss = torch.nn.functional.cross_entropy(out, y)
        if CASE == "skip" and bad:
            continue  # CASE:skip a rank that skips a backward (say, a NaN loss it chose to skip)
        if CASE == "kill" and bad:
            mark()
            out.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))  # CASE:kill dies mid-backward
        loss.backward()  # CASE:backward
        opt.step()
        opt.zero_grad()
        if CASE == "extra" and bad:
            mark()
            dist.barrier()  # CASE:extra a collective of its own, on one rank only
    mark()
    dist.barrier()  # CASE:end every rank meets here after training
    print(f"rank {rank} finished {steps} steps", flush=True)
    if CASE == "grad_end":  # a backward that reduces nothing (torch.autograd.grad), then an exit without teardown
        x, _ = batch(0, rank)
        torch.autograd.grad(ddp(x).sum(), list(ddp.parameters()))
        return
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
