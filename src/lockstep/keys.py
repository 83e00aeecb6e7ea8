"""The names ``lockstep launch`` and its workers share: keys in the workers' store, and the environment the launcher
sets for the workers.

Each name is written here once. The launcher (launch/), a newcomer's admission (process_group.py) and in-place
recovery (train/inplace/) all read and write the same keys; a key spelled twice, once on each side, drifts apart
without a test noticing until a multi-node run hangs. This module imports nothing, so every layer may use it.
"""

from __future__ import annotations

# -- environment the launcher sets for its workers ---------------------------------------------------------------
REPORT_ENV = "LOCKSTEP_REPORT_RESUME"  # "1": workers report the step they resumed from (``RESUME_KEY``)
# The job's id, one for all its nodes and rounds (node 0's agent makes it; a node that joins in place takes the
# running job's): the run folder's fence (train/fence.py) tells this job's restarts from a second job by it
JOB_ENV = "LOCKSTEP_JOB_ID"
INPLACE_ENV = "LOCKSTEP_INPLACE"  # "1": the workers recover in place (``lockstep launch --nnodes MIN:MAX``)
INPLACE_MIN_WORLD_ENV = "LOCKSTEP_INPLACE_MIN_WORLD"  # --nnodes MIN x --nproc-per-node: fewer leave it to the agent
INPLACE_TIMEOUT_ENV = "LOCKSTEP_INPLACE_TIMEOUT_S"  # gloo's per-operation timeout in an in-place run
# every node's standby store (each agent serves one) and the launch ranks on that node, and which node serves the
# workers' store now: {"store_node": N, "nodes": [{"node_rank", "addr", "port", "ranks"}, ...]}
INPLACE_STORES_ENV = "LOCKSTEP_INPLACE_STORES"
INPLACE_JOIN_ENV = "LOCKSTEP_INPLACE_JOIN"  # set for the workers of a node that joins a running job in place
HANG_TIMEOUT_ENV = "LOCKSTEP_HANG_TIMEOUT_S"  # the DDP's hang_timeout_s default (``lockstep launch --hang-timeout``)
LOG_DIR_ENV = "LOCKSTEP_LOG_DIR"  # where hang reports go: the job's log folder
GLOO_IFNAME_PICKED_ENV = "LOCKSTEP_GLOO_IFNAME_PICKED"  # the GLOO_SOCKET_IFNAME the launcher picked (not the user)
AS_TORCH_DDP_ENV = "LOCKSTEP_AS_TORCH_DDP"  # "1": every worker's ``import torch`` uses lockstep's DDP (autoload)

# -- keys in the workers' store (MASTER_ADDR:MASTER_PORT) --------------------------------------------------------
RESUME_KEY = "lockstep/resumed"  # the step the workers resumed from: the launcher's membership line
INPLACE_PREFIX = "lockstep/inplace"  # every key of in-place recovery starts with it
INPLACE_REPORT_KEY = f"{INPLACE_PREFIX}/report"  # + "/<generation>" (and "/latest"): a re-formation's record
INPLACE_ACCEPTS_JOINS_KEY = f"{INPLACE_PREFIX}/accepts_joins"  # the workers admit newcomers in place
# in a standby store: the generation whose re-formation moved the workers there (the launcher's agents follow)
INPLACE_TAKEOVER_KEY = f"{INPLACE_PREFIX}/takeover"
# the first id a newcomer may take, in a store the workers moved to (the join count starts again there, and ids
# must never repeat)
INPLACE_BASE_KEY = f"{INPLACE_PREFIX}/base"
# set by the running job's rank 0 when its training ended ({"step": N}): a newcomer still waiting to be admitted
# has nothing to join
INPLACE_ENDED_KEY = f"{INPLACE_PREFIX}/ended"
INPLACE_JOIN_COUNT_KEY = f"{INPLACE_PREFIX}/join/count"  # newcomers announced so far (each takes the next number)


def join_record_key(seq: int) -> str:
    """The ``seq``-th newcomer's announcement: its id, node, local rank."""
    return f"{INPLACE_PREFIX}/join/{seq}"


def beat_key(member: int) -> str:
    """A member's (or a waiting newcomer's) heartbeat: a counter it adds 1 to every beat."""
    return f"{INPLACE_PREFIX}/beat/{member}"


def admit_key(member: int) -> str:
    """Where rank 0 writes a newcomer's admission (the decision to grow)."""
    return f"{INPLACE_PREFIX}/admit/{member}"


def generation_key(generation: int, what: str) -> str:
    """A key of one generation of the in-place group: its alarm, check-ins, decisions, its process group's store."""
    return f"{INPLACE_PREFIX}/{generation}/{what}"
