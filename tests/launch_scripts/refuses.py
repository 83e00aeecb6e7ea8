"""Worker for test_launch_reports: as examples/wine.py into another run's --out, every rank stops with exit code 2
and only rank 0 says why (rank 1 writes nothing)."""

import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 0:
    print("refuses.py: /tmp/out holds checkpoints of another run: continue it with --resume", file=sys.stderr, flush=True)
# Rank 0's words are on disk before any rank exits (as wine.py's are: it prints before its ranks leave).
dist.barrier()
if dist.get_rank() == 1:
    time.sleep(0.05)  # after rank 0: in torch's whole-second timestamps the ranks tie, or rank 0 comes first
sys.exit(2)
