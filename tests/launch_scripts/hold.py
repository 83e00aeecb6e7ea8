"""Worker for test_launch_network: forms a group, all-reduces, says "ready", holds until argv[1] exists.

argv: release_path [torch|lockstep]: start the group with torch's init_process_group (env://)
or with lockstep.init(). While it holds, the test lists the sockets the job listens on.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

release, how = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "torch"
if how == "lockstep":
    import lockstep

    lockstep.init(backend="gloo")
else:
    dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"ready rank={dist.get_rank()} sum={t.item():g} pid={os.getpid()}", flush=True)
while not os.path.exists(release):
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
