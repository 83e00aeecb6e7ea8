"""Worker for test_launch_reports, run as a module (-m launch_scripts.report_env): prints where reports go,
its parent, and one line on each stream; lockstep's logging adds its own INFO line on rank 0."""

import os
import sys

import lockstep

env = lockstep.init()
print(f"report_env rank={env.rank} report_dir={os.environ.get('LOCKSTEP_LOG_DIR')} ppid={os.getppid()} "
      f"argv={sys.argv[1:]}", flush=True)
print(f"report_env stderr rank={env.rank}", file=sys.stderr, flush=True)
lockstep.shutdown()
