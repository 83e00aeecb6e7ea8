"""Worker for test_launch: all-reduce rank+1 over gloo and print the sum and what the launcher set."""

import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"allreduce rank={rank} world={world_size} local_rank={os.environ['LOCAL_RANK']} "
      f"master={os.environ['MASTER_ADDR']} sum={t.item():g} args={sys.argv[1:]}")
print(f"stderr line from rank {rank}", file=sys.stderr)
dist.destroy_process_group()
