"""One clock for all ranks: each rank's offset to rank 0's ``time.perf_counter``, measured through the store.

A trace that puts every rank on one time axis needs the ranks' clocks to agree; on one host they do
(``perf_counter`` is CLOCK_MONOTONIC, shared by every process), across hosts they do not. Each rank
pings rank 0 a few times through the rendezvous store torch.distributed already runs (never through
the process group, whose collectives are what the trace measures): it writes a key, rank 0 answers
with its clock, and the round with the shortest round trip gives the offset (Cristian's algorithm),
to within half that round trip (a few hundred microseconds over TCP).
"""

from __future__ import annotations

import time

import torch.distributed as dist

PING_ROUNDS = 5


def default_store(group: dist.ProcessGroup | None = None):
    """The store behind the default group (a separate TCP client: usable while the group is busy)."""
    return dist.distributed_c10d._get_default_store()


def offset_to_rank0_s(
    store: dist.Store, prefix: str, group_rank: int, world_size: int, rounds: int = PING_ROUNDS
) -> tuple[float, float]:
    """(seconds to add to this rank's ``perf_counter`` to read rank 0's, the best round trip in seconds).

    Every rank of the group calls it together; rank 0 answers the others' pings in turn (a few store
    round trips per rank, once per trace).
    """
    if world_size == 1:
        return 0.0, 0.0
    if group_rank == 0:
        for rank in range(1, world_size):
            for i in range(rounds):
                store.get(f"{prefix}/ping/{rank}/{i}")  # blocks until that rank pings
                store.set(f"{prefix}/pong/{rank}/{i}", repr(time.perf_counter()))
        return 0.0, 0.0
    best_rtt, best_offset = float("inf"), 0.0
    for i in range(rounds):
        sent = time.perf_counter()
        store.set(f"{prefix}/ping/{group_rank}/{i}", "1")
        theirs = float(store.get(f"{prefix}/pong/{group_rank}/{i}"))
        received = time.perf_counter()
        if received - sent < best_rtt:
            best_rtt, best_offset = received - sent, theirs - (sent + received) / 2
    return best_offset, best_rtt
