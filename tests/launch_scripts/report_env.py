"""Worker for test_launch_reports (run as a module, -m launch_scripts.report_env) and test_launch's --log-rank
case: prints what the launcher set (rank, world size, where reports go), its parent and its arguments, and one
line on each stream. No torch: what these tests assert is the launcher's (its flags, its console, its folders),
and a worker that imports torch costs ~1.2 CPU-s."""

import os
import sys

rank = os.environ["RANK"]
print(f"report_env rank={rank} world={os.environ['WORLD_SIZE']} report_dir={os.environ.get('LOCKSTEP_LOG_DIR')} "
      f"ppid={os.getppid()} argv={sys.argv[1:]}", flush=True)
print(f"report_env stderr rank={rank}", file=sys.stderr, flush=True)
