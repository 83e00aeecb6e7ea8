"""A DDP training script whose end is the subject of tests/test_exits.py.

    train_then_exit.py IMPL ENDING [spawn]

IMPL: lockstep | torch. ENDING: destroy (a plain ``destroy_process_group()``, as torch's
tutorials end), none (no teardown at all), shutdown (``lockstep.shutdown()``), or
quick-destroy / quick-none (the same, ending straight after a backward, when the last
buckets' works are freshest), or gather-destroy (a few all_gathers of fresh tensors, then ``barrier()`` and
``destroy_process_group()``, as Transformers' Trainer and the library scripts end). With ``spawn`` the script starts its own two ranks with
``torch.multiprocessing.spawn`` instead of being started by torchrun / lockstep launch.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def train(rank: int, impl: str, ending: str) -> None:
    if impl == "torch":
        from torch.nn.parallel import DistributedDataParallel as DDP
    else:
        import lockstep

        class DDP(lockstep.DistributedDataParallel):
            direct_min_bytes = 4096  # both weights in direct buckets: their works hold .grad itself
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)), bucket_cap_mb=0.02)
    for step in range(12):
        model.zero_grad()  # set_to_none, as optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,)))
        loss.backward()
        if ending.startswith("quick") and step == 11:
            break  # end right after backward: no optimizer step, no print
        # Plain SGD by hand: torch.optim's first optimizer imports torch._dynamo (~1.1 CPU-s in every rank of every
        # run), and what ends the process here (the process group, the reducer's works on .grad) is the same.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.1)
    else:
        print(f"rank {rank} trained", flush=True)
    if ending.startswith("gather"):
        for _ in range(3):  # a logged loss gathered from every rank: its tensors are dropped at once
            gathered = [torch.empty(1) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, loss.detach().reshape(1))
        dist.barrier()
    if ending.endswith("destroy"):
        dist.destroy_process_group()
    elif ending == "shutdown":
        import lockstep

        lockstep.shutdown()


if __name__ == "__main__":
    impl, ending = sys.argv[1], sys.argv[2]
    if sys.argv[3:] == ["spawn"]:
        import torch.multiprocessing as mp

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["WORLD_SIZE"] = "2"
        mp.spawn(train, args=(impl, ending), nprocs=2)
    else:
        train(int(os.environ["RANK"]), impl, ending)
