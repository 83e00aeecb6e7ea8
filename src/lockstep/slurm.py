"""SLURM's view of a job: expanding its compressed node lists, and the rank layout srun gives.

SLURM writes host lists compressed (``node[01-03,07],gpu5``); every rank must
expand them the same way to agree on the master address without talking.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

# Preemption contract between the Trainer (train/preempt.py), `lockstep launch` and the sbatch script:
REQUEUE_EXIT_CODE = 75  # a worker exits with this after its preemption checkpoint (sysexits.h EX_TEMPFAIL)
PREEMPT_DIR_ENV = "LOCKSTEP_PREEMPT_DIR"  # set by `lockstep launch`; each preempted worker leaves a file there
CHECKPOINT_NOTE = "last_checkpoint"  # in that folder: the Trainer's newest checkpoint, named when the job is stopped
PREEMPT_NOTICE_S = 120  # sbatch --signal lead time before the time limit

_BRACKET = re.compile(r"^(?P<prefix>[^\[\]]*)\[(?P<body>[^\[\]]+)\](?P<rest>.*)$")


def _split_top_level(nodelist: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"SLURM node list {nodelist!r}: unbalanced ']' at position {i}")
        elif ch == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"SLURM node list {nodelist!r}: unbalanced '['")
    parts.append(nodelist[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_one(host: str, whole: str) -> list[str]:
    m = _BRACKET.match(host)
    if m is None:
        return [host]
    prefix, body, rest = m.group("prefix"), m.group("body"), m.group("rest")
    suffixes = _expand_one(rest, whole) if rest else [""]
    names: list[str] = []
    for item in body.split(","):
        item = item.strip()
        if "-" in item:
            lo, hi = item.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
                raise ValueError(f"SLURM node list {whole!r}: bad range {item!r}")
            width = len(lo)  # SLURM keeps zero padding: node[01-03] -> node01..node03
            numbers = [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
        else:
            if not item.isdigit():
                raise ValueError(f"SLURM node list {whole!r}: bad index {item!r}")
            numbers = [item]
        names.extend(prefix + n + s for n in numbers for s in suffixes)
    return names


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list: ``"node[01-03,07],login"`` -> ``["node01", "node02", "node03", "node07", "login"]``."""
    if not nodelist or not nodelist.strip():
        raise ValueError("SLURM node list is empty (SLURM_JOB_NODELIST)")
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_one(part, nodelist))
    return hosts


def port_from_job_id(job_id: str | int, base_port: int = 20000, span: int = 20000) -> int:
    """A port every rank of the job derives alike, without talking: base + job_id mod span."""
    try:
        job = int(str(job_id).split("_")[0])
    except ValueError as e:
        raise ValueError(f"SLURM_JOB_ID={job_id!r} is not a number") from e
    return base_port + job % span


@dataclass(frozen=True)
class SlurmLaunchEnv:
    """What ``lockstep launch`` takes from a SLURM allocation: one agent per node, all agreeing on a master."""

    job_id: str
    nnodes: int
    node_rank: int
    hosts: tuple[str, ...]
    master_addr: str  # the first host of the expanded node list: every node derives it alike
    master_port: int  # MASTER_PORT if set, else port_from_job_id(job_id)


def _slurm_int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from e


def slurm_launch_env(env: Mapping[str, str]) -> SlurmLaunchEnv | None:
    """Derive the node layout from SLURM's variables; None outside an allocation.

    An allocation is recognised by SLURM_JOB_ID and SLURM_JOB_NODELIST (or the older
    SLURM_NODELIST). The node count is SLURM_NNODES (or SLURM_JOB_NUM_NODES), falling
    back to the length of the node list; the node rank is SLURM_NODEID, which srun
    sets per node (0 in a batch script, which runs on the first node).
    """
    job_id = env.get("SLURM_JOB_ID")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job_id or not nodelist:
        return None
    hosts = tuple(expand_nodelist(nodelist))
    if env.get("SLURM_NNODES"):
        nnodes = _slurm_int(env, "SLURM_NNODES")
    elif env.get("SLURM_JOB_NUM_NODES"):
        nnodes = _slurm_int(env, "SLURM_JOB_NUM_NODES")
    else:
        nnodes = len(hosts)
    if nnodes < 1:
        raise ValueError(f"SLURM says the job has {nnodes} nodes (SLURM_NNODES); expected >= 1")
    if nnodes > len(hosts):
        raise ValueError(
            f"SLURM_NNODES={nnodes} but the node list {nodelist!r} names only {len(hosts)} hosts"
        )
    node_rank = _slurm_int(env, "SLURM_NODEID") if env.get("SLURM_NODEID") else 0
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"SLURM_NODEID={node_rank} is outside [0, {nnodes}) nodes")
    if env.get("MASTER_PORT"):
        master_port = _slurm_int(env, "MASTER_PORT")
    else:
        master_port = port_from_job_id(job_id)
    master_addr = env.get("MASTER_ADDR") or hosts[0]
    return SlurmLaunchEnv(job_id, nnodes, node_rank, hosts, master_addr, master_port)


def sbatch_script(
    script_and_args: list[str],
    nodes: int = 1,
    gpus_per_node: int = 0,
    nproc_per_node: int | None = None,
    time: str = "01:00:00",
    job_name: str = "lockstep",
    max_restarts: int = 0,
) -> str:
    """A ready sbatch script: one task per node, each running ``lockstep launch`` under srun.

    One agent per node (not one task per GPU) so the elastic agent can stop and
    restart every worker on its node; the agents meet at the first node's address.
    """
    if nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {nodes}")
    if gpus_per_node < 0:
        raise ValueError(f"--gpus-per-node must be >= 0, got {gpus_per_node}")
    if not script_and_args:
        raise ValueError("a script to run is required (lockstep slurm-script [options] script.py [args...])")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    nproc = nproc_per_node if nproc_per_node is not None else (gpus_per_node or None)
    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {nproc}")
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    lines += [
        f"#SBATCH --time={time}",
        "#SBATCH --output=%x-%j.out",
        # Preemption: SIGTERM to every task 120 s before the time limit; the Trainer finishes the step,
        # checkpoints and exits 75 (EX_TEMPFAIL), and the job goes back to the queue to resume.
        f"#SBATCH --signal=TERM@{PREEMPT_NOTICE_S}",
        "#SBATCH --requeue",
        "",
        "set -euo pipefail",
        "# One task per node: each runs one lockstep launch agent, which starts the node's workers.",
        "# lockstep launch reads SLURM_JOB_NODELIST / SLURM_NNODES / SLURM_NODEID: the first node",
        "# hosts the rendezvous; the port is MASTER_PORT if exported, else derived from the job id.",
        "# export MASTER_PORT=29500",
        "",
    ]
    launch = ["lockstep", "launch", f"--nproc-per-node {nproc if nproc is not None else 'auto'}"]
    if max_restarts:
        launch.append(f"--max-restarts {max_restarts}")
    launch += [shlex.quote(a) for a in script_and_args]
    lines.append("srun --ntasks-per-node=1 " + " ".join(launch) + " && rc=0 || rc=$?")
    lines += [
        f"if [ \"$rc\" -eq {REQUEUE_EXIT_CODE} ]; then  # preempted after a checkpoint: requeue, resume=True continues",
        "  scontrol requeue \"$SLURM_JOB_ID\" || true  # (or RequeueExit=75 in slurm.conf)",
        "fi",
        "exit \"$rc\"",
    ]
    return "\n".join(lines) + "\n"
