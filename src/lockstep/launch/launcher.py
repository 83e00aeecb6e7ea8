"""``lockstep launch``: run a script (or a function) on N worker processes per node with torch's elastic agent.

We do not supervise processes ourselves: torch's ``LocalElasticAgent`` (via
``elastic_launch``) starts the workers, sets RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT, stops them all when one fails and restarts the group
up to ``--max-restarts`` times. What we add is the part that makes that reliable
and readable: restarts that really come back (see ``launch_agent._agent_environment``),
a single node on loopback by default, SLURM allocations understood without flags,
rank-prefixed output, and one clear report naming the failed rank.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any, Callable, Mapping, Sequence

from lockstep.launch.agent import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    LOOPBACK_ADDR,
    LaunchOptions,
    RendezvousFailed,
    WorkersPreempted,
    run_agent,
)
from lockstep.launch.elastic import parse_nnodes
from lockstep.launch.output import LaunchError
from lockstep.network import ensure_gloo_interface
from lockstep.slurm import REQUEUE_EXIT_CODE, sbatch_script, slurm_launch_env

__all__ = [
    "LaunchError",
    "LaunchOptions",
    "RendezvousFailed",
    "cli_main",
    "launch_function",
    "parse_launch_args",
    "run_agent",
    "slurm_script_main",
]

_MULTI_NODE_DEFAULT_PORT = 29500


def default_nproc_per_node() -> int:
    """``auto``: one worker per GPU when CUDA is available, otherwise 2 CPU workers."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 2


def _parse_nproc(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nproc-per-node must be an integer or 'auto', got {value!r}") from None


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lockstep launch",
        description="Run SCRIPT on N processes per node with torch's elastic agent. Single node on loopback by "
        "default; inside a SLURM allocation the node layout comes from SLURM.",
        allow_abbrev=False,
    )
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=_parse_nproc, default="auto",
                   help="workers on this node: an integer, or 'auto' = one per GPU, else 2 (default: auto)")
    p.add_argument("--nnodes", type=parse_nnodes, default=None, metavar="N|MIN:MAX",
                   help="number of nodes, or MIN:MAX for an elastic job that goes on with the nodes still there "
                   "and grows back when one joins (torchrun's syntax; docs/preemptible.md) (default: 1, or SLURM's)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=None,
                   help="this node's index; node 0 hosts the rendezvous (default: 0, or SLURM_NODEID)")
    p.add_argument("--master-addr", "--master_addr", default=None,
                   help="address of node 0 (default: 127.0.0.1, or the first SLURM host)")
    p.add_argument("--master-port", "--master_port", type=int, default=None,
                   help="rendezvous port on node 0 (default: a free port on one node; 29500 or SLURM-derived otherwise)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="restart the whole group up to K times after a worker fails (default: 0)")
    p.add_argument("--log-rank", "--log_rank", type=int, default=None,
                   help="show only this global rank's output (default: every rank, prefixed [rankN])")
    p.add_argument("--run-id", "--run_id", default="", help="rendezvous id shared by all nodes (multi-node)")
    p.add_argument("--rdzv-timeout", "--rdzv_timeout", type=int, default=900, metavar="SECONDS",
                   help="how long the nodes wait for each other before failing (default: 900)")
    p.add_argument("--node-timeout", "--node_timeout", type=float, default=30.0, metavar="SECONDS",
                   help="several nodes: a node whose heartbeat stops this long is lost; its peers stop their workers "
                   "and restart (--max-restarts) or fail, naming it (default: 30)")
    p.add_argument("--log-dir", "--log_dir", default=None,
                   help="keep every rank's stdout/stderr under this folder (default: a temporary folder, "
                   "kept only when a worker fails)")
    p.add_argument("--hang-timeout", "--hang_timeout", type=float, default=None, metavar="SECONDS",
                   help="a rank stuck this long inside a DDP step makes every rank write a hang report (beside the "
                   "logs) and ends the job with exit code 86; 0: off (default: DDP's, 300; sets LOCKSTEP_HANG_TIMEOUT_S)")
    p.add_argument("--shutdown-timeout", "--shutdown_timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   metavar="SECONDS",
                   help="after a SIGTERM (preemption), how long the workers get to finish their step and write a "
                   f"checkpoint before SIGKILL (default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g}; whole seconds)")
    p.add_argument("--as-torch-ddp", "--as_torch_ddp", action="store_true",
                   help="workers build lockstep's DistributedDataParallel wherever a library (Accelerate, Lightning) "
                   "or the script builds torch's (sets LOCKSTEP_AS_TORCH_DDP=1; needs torch >= 2.5)")
    p.add_argument("script", help="the Python script each worker runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


def parse_launch_args(argv: Sequence[str], env: Mapping[str, str] | None = None) -> tuple[LaunchOptions, str, list[str]]:
    """Parse ``lockstep launch`` arguments into options, the script path and its arguments.

    Explicit flags win; missing node-layout flags come from SLURM when SLURM_JOB_ID and
    SLURM_JOB_NODELIST are set (``env`` defaults to ``os.environ``; tests pass their own).
    Raises ValueError naming the bad flag or file (SystemExit from argparse for --help
    or a malformed flag).
    """
    env = os.environ if env is None else env
    parser = _build_parser()
    ns = parser.parse_args(list(argv))  # SystemExit on --help or a malformed flag: argparse printed why
    nproc = default_nproc_per_node() if ns.nproc_per_node == "auto" else ns.nproc_per_node

    slurm = slurm_launch_env(env)
    layout_flags = (ns.nnodes, ns.node_rank, ns.master_addr, ns.master_port)
    if slurm is not None and slurm.nnodes > 1 and ns.nnodes in (None, (slurm.nnodes, slurm.nnodes)):
        options = LaunchOptions(
            nproc_per_node=nproc,
            nnodes=slurm.nnodes,
            node_rank=slurm.node_rank if ns.node_rank is None else ns.node_rank,
            master_addr=ns.master_addr or slurm.master_addr,
            master_port=slurm.master_port if ns.master_port is None else ns.master_port,
            max_restarts=ns.max_restarts,
            log_rank=ns.log_rank,
            run_id=ns.run_id or f"lockstep-slurm-{slurm.job_id}",
            rdzv_timeout_s=ns.rdzv_timeout,
            log_dir=ns.log_dir,
            source="slurm",
            as_torch_ddp=ns.as_torch_ddp,
            node_timeout_s=ns.node_timeout,
            hang_timeout_s=ns.hang_timeout,
            shutdown_timeout_s=ns.shutdown_timeout,
        )
    else:
        # One node (also a one-node SLURM job): loopback and a free port unless told otherwise.
        min_nodes, nnodes = (1, 1) if ns.nnodes is None else ns.nnodes
        multi = nnodes > 1
        default_port = _MULTI_NODE_DEFAULT_PORT if multi else 0
        options = LaunchOptions(
            nproc_per_node=nproc,
            nnodes=nnodes,
            node_rank=0 if ns.node_rank is None else ns.node_rank,
            master_addr=ns.master_addr or LOOPBACK_ADDR,
            master_port=default_port if ns.master_port is None else ns.master_port,
            max_restarts=ns.max_restarts,
            log_rank=ns.log_rank,
            run_id=ns.run_id,
            rdzv_timeout_s=ns.rdzv_timeout,
            log_dir=ns.log_dir,
            source="flags" if any(f is not None for f in layout_flags) else "single",
            as_torch_ddp=ns.as_torch_ddp,
            node_timeout_s=ns.node_timeout,
            hang_timeout_s=ns.hang_timeout,
            shutdown_timeout_s=ns.shutdown_timeout,
            min_nodes=min_nodes if min_nodes != nnodes else None,
        )
    if options.nnodes > 1 and options.master_addr == LOOPBACK_ADDR:
        raise ValueError("--master-addr is required with --nnodes > 1 (the address of node 0; not 127.0.0.1)")
    if not os.path.isfile(ns.script):
        raise ValueError(f"script {ns.script!r} not found (the SCRIPT argument of lockstep launch)")
    return options, ns.script, list(ns.script_args)


def launch_function(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    nproc_per_node: int = 2,
    max_restarts: int = 0,
    log_rank: int | None = None,
    log_dir: str | None = None,
) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nproc_per_node`` local workers through torch's elastic agent.

    Each worker has RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR (127.0.0.1) and MASTER_PORT
    set, so ``lockstep.init()`` or ``init_process_group("gloo")`` works inside ``fn``.

    Args:
        fn: a module-level function (workers are spawned, so it is pickled by name).
        args: positional arguments for ``fn``; must be picklable.
        nproc_per_node: number of workers.
        max_restarts: restart the whole group up to this many times after a failure.
        log_rank: show only this rank's output; None prefixes every rank's lines with ``[rankN]:``.
        log_dir: keep every rank's stdout/stderr files here; None uses a temporary folder that is
            removed unless a worker fails.

    Returns {rank: fn's return value}. Raises LaunchError (a RuntimeError) naming the failed rank.
    """
    qualname = getattr(fn, "__qualname__", "")
    if not callable(fn) or "<locals>" in qualname or "<lambda>" in qualname or not getattr(fn, "__module__", None):
        raise ValueError(
            f"launch_function: fn={fn!r} must be a module-level function: workers are spawned and import it by name"
        )
    from torch.distributed.elastic.multiprocessing.api import SignalException

    options = LaunchOptions(
        nproc_per_node=nproc_per_node, max_restarts=max_restarts, log_rank=log_rank, log_dir=log_dir, source="single"
    )
    try:
        return run_agent(options, fn, tuple(args))
    except SignalException as e:
        if e.sigval == signal.SIGINT:  # Ctrl-C: the agent has stopped the workers; surface it as Python does
            raise KeyboardInterrupt from e
        raise


def _exit_code(error: LaunchError) -> int:
    if error.exitcode < 0:
        return 128 + (-error.exitcode)  # a shell's convention for "killed by signal N"
    return error.exitcode if 0 < error.exitcode < 256 else 1


def cli_main(argv: Sequence[str]) -> int:
    """``lockstep launch ...``: returns 0 when every worker succeeded, non-zero otherwise."""
    try:
        options, script, script_args = parse_launch_args(argv)
    except SystemExit as e:  # --help, or argparse already printed the usage error
        return int(e.code or 0)
    except ValueError as e:
        print(f"lockstep launch: error: {e}", file=sys.stderr)
        return 2
    if options.nnodes > 1:
        nodes = f"{options.min_nodes}:{options.nnodes}" if options.min_nodes else f"{options.nnodes}"
        print(
            f"lockstep launch: node {options.node_rank} of {nodes} ({options.source}), "
            f"{options.nproc_per_node} workers here; rendezvous at {options.master_addr}:{options.master_port}",
            file=sys.stderr,
            flush=True,
        )
        print(f"lockstep launch: {ensure_gloo_interface(options.master_addr, dict(os.environ))}", file=sys.stderr, flush=True)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        # -u: unbuffered, so a worker's last lines are in its log file even if it is killed.
        run_agent(options, sys.executable, ["-u", script, *script_args])
    except LaunchError as e:
        sys.stderr.write(str(e) + "\n")
        if e.exitcode == REQUEUE_EXIT_CODE:
            sys.stderr.write(f"lockstep launch: exit code {REQUEUE_EXIT_CODE}: the workers were preempted (SIGTERM) "
                             "after writing a checkpoint; requeue the job to resume\n")
        sys.stderr.flush()
        return _exit_code(e)
    except WorkersPreempted as e:
        print(e, file=sys.stderr)
        return REQUEUE_EXIT_CODE
    except RendezvousFailed as e:
        print(e, file=sys.stderr)
        return 1
    except SignalException as e:
        print(f"lockstep launch: stopped by {e.sigval.name}; the workers were stopped", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


def slurm_script_main(argv: Sequence[str]) -> int:
    """``lockstep slurm-script ...``: print an sbatch script that runs ``lockstep launch`` on every node."""
    p = argparse.ArgumentParser(prog="lockstep slurm-script", description=sbatch_script.__doc__, allow_abbrev=False)
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default: 1)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node to request (default: 0)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="workers per node (default: --gpus-per-node, or auto)")
    p.add_argument("--time", default="01:00:00", help="wall-clock limit (default: 01:00:00)")
    p.add_argument("--job-name", default="lockstep", help="job name (default: lockstep)")
    p.add_argument("--max-restarts", type=int, default=0, help="passed to lockstep launch (default: 0)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    ns = p.parse_args(list(argv))
    try:
        text = sbatch_script(
            [ns.script, *ns.script_args],
            nodes=ns.nodes,
            gpus_per_node=ns.gpus_per_node,
            nproc_per_node=ns.nproc_per_node,
            time=ns.time,
            job_name=ns.job_name,
            max_restarts=ns.max_restarts,
        )
    except ValueError as e:
        print(f"lockstep slurm-script: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0
