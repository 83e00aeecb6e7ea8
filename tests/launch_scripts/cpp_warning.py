"""A worker whose store goes away under it, so that torch's C++ (c10d) prints a warning record to fd 2.

Each rank serves a TCPStore, connects a client to it, drops the server and asks the client for a key: c10d writes
``[W... TCPStore.cpp:...] [c10d] recvValue failed ... Connection was likely closed`` and its C++ stack
(``Exception raised from ...``, ``frame #N: ...``) straight to fd 2, then raises. The rank prints a line before and
after, so a test sees that the rank's own lines still reach the console around the dropped record.
"""

import datetime
import gc
import os
import sys

from torch.distributed import TCPStore

rank = os.environ.get("RANK", "0")
print(f"rank {rank} before the store goes away", file=sys.stderr, flush=True)
server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10))
client.set("key", "1")
del server
gc.collect()  # the server's socket closes now: the client's next request meets a closed connection
try:
    client.get("key")
except Exception as e:  # torch.distributed.DistNetworkError
    print(f"rank {rank} after the store went away: {type(e).__name__}", file=sys.stderr, flush=True)
