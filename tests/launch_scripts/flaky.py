"""Worker for test_launch: rank 1 fails while the counter file holds fewer than FAILS failures.

Every attempt re-forms the gloo group and all-reduces, so a restart counts as
successful only if the new group really talks. argv: counter_path fails.
"""

import os
import sys

import torch
import torch.distributed as dist

counter_path, fails = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"attempt restart={restart} rank={rank} sum={t.item():g}")
# Both ranks read the count after the all-reduce, before rank 1 may bump it.
dist.barrier()
done = int(open(counter_path).read()) if os.path.exists(counter_path) else 0
dist.barrier()
if rank == 1 and done < fails:
    with open(counter_path, "w") as f:
        f.write(str(done + 1))
    print(f"failing on purpose: failure {done + 1} of {fails}", file=sys.stderr)
    sys.exit(3)
if done >= fails:
    print(f"completed rank={rank} after restart={restart}")
    dist.destroy_process_group()
else:
    dist.barrier()  # rank 0 waits here until the agent stops it
