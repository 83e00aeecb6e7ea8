"""Worker for test_launch: prints its pid and then runs until it is stopped."""

import os
import time

print(f"worker pid {os.getpid()}", flush=True)
while True:
    time.sleep(0.2)
