"""Worker for test_launch: prints its pid and then runs until it is stopped (``ignore-sigterm``: until SIGKILL)."""

import os
import signal
import sys
import time

if sys.argv[1:] == ["ignore-sigterm"]:  # a worker that cannot finish: only the agent's SIGKILL stops it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

print(f"worker pid {os.getpid()}", flush=True)
while True:
    time.sleep(0.2)
