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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lockstep.launch import flags
from lockstep.launch.agent import (
    LOOPBACK_ADDR,
    LaunchOptions,
    RendezvousFailed,
    WorkersPreempted,
    run_agent,
)
from lockstep.launch.output import LaunchError
from lockstep.launch.report import WorkersStopped
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


_build_parser = flags.build_parser  # the parser's old home: tests and helpers import it from here


def _parse(argv: Sequence[str], env: Mapping[str, str]) -> tuple[LaunchOptions, argparse.Namespace]:
    ns = flags.build_parser().parse_args(list(argv))  # SystemExit on --help or a malformed flag: argparse printed why
    if ns.run_path:
        raise ValueError(f"--run-path is not supported: {flags.TORCHRUN_NOT_SUPPORTED['--run-path']}")
    if ns.logs_specs is not None:
        raise ValueError(f"--logs-specs is not supported: {flags.TORCHRUN_NOT_SUPPORTED['--logs-specs']}")
    nproc = flags.parse_nproc(ns.nproc_per_node)
    nodes_range = ns.nnodes  # (MIN, MAX) from elastic.parse_nnodes, or None
    conf = flags.parse_rdzv_conf(ns.rdzv_conf)
    rdzv_timeout_s = ns.rdzv_timeout
    for key in ("join_timeout", "timeout"):  # torch's c10d rendezvous reads join_timeout; both mean the same here
        if key in conf:
            rdzv_timeout_s = int(float(conf.pop(key))) if rdzv_timeout_s is None else rdzv_timeout_s
    rdzv_timeout_s = 900 if rdzv_timeout_s is None else rdzv_timeout_s
    if ns.rdzv_backend is not None and ns.rdzv_backend not in flags.RDZV_BACKENDS:
        raise ValueError(
            f"--rdzv-backend {ns.rdzv_backend!r} is not supported (accepted: {', '.join(flags.RDZV_BACKENDS)}: "
            "lockstep launch meets through torch's c10d rendezvous)"
        )
    if ns.standalone:
        # torchrun's --standalone: one node, a fresh rendezvous on loopback; explicit --rdzv-* are ignored.
        if nodes_range not in (None, (1, 1)):
            raise ValueError(f"--standalone runs one node, but --nnodes is {':'.join(map(str, nodes_range))}")
        nodes_range, ns.rdzv_endpoint, ns.run_id, ns.master_addr, ns.master_port = (1, 1), None, "", None, None
    if ns.rdzv_endpoint:
        host, sep, port = ns.rdzv_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--rdzv-endpoint must be HOST:PORT, got {ns.rdzv_endpoint!r}")
        if (ns.master_addr, ns.master_port) not in ((None, None), (host.strip("[]"), int(port))):
            raise ValueError("--rdzv-endpoint and --master-addr/--master-port name different rendezvous: give one")
        ns.master_addr, ns.master_port = host.strip("[]"), int(port)
    std = {"redirects": ns.redirects, "tee": ns.tee}
    for name, value in std.items():
        flags.parse_std(f"--{name}", value)  # validated here; RankLogsSpecs applies them
    common = dict(
        nproc_per_node=nproc,
        max_restarts=ns.max_restarts,
        log_rank=ns.log_rank,
        rdzv_timeout_s=rdzv_timeout_s,
        log_dir=ns.log_dir,
        as_torch_ddp=ns.as_torch_ddp,
        node_timeout_s=ns.node_timeout,
        recovery=ns.recovery,
        hang_timeout_s=ns.hang_timeout,
        shutdown_timeout_s=ns.shutdown_timeout,
        monitor_interval_s=ns.monitor_interval,
        start_method=ns.start_method,
        role=ns.role,
        event_log_handler=ns.event_log_handler,
        local_addr=ns.local_addr,
        rdzv_conf=tuple(sorted(conf.items())),
        signals_to_handle=ns.signals_to_handle,
        redirects=ns.redirects,
        tee=ns.tee,
        local_ranks_filter=flags.parse_local_ranks(ns.local_ranks_filter),
        duplicate_stdout_filters=tuple(ns.duplicate_stdout_filters),
        duplicate_stderr_filters=tuple(ns.duplicate_stderr_filters),
        virtual_local_rank=ns.virtual_local_rank,
        numa_binding=ns.numa_binding,
    )

    slurm = None if ns.standalone else slurm_launch_env(env)
    layout_flags = (ns.nnodes, ns.node_rank, ns.master_addr, ns.master_port)
    if slurm is not None and slurm.nnodes > 1 and nodes_range in (None, (slurm.nnodes, slurm.nnodes)):
        options = LaunchOptions(
            nnodes=slurm.nnodes,
            node_rank=slurm.node_rank if ns.node_rank is None else ns.node_rank,
            master_addr=ns.master_addr or slurm.master_addr,
            master_port=slurm.master_port if ns.master_port is None else ns.master_port,
            run_id=ns.run_id or f"lockstep-slurm-{slurm.job_id}",
            source="slurm",
            **common,
        )
    else:
        # One node (also a one-node SLURM job): loopback and a free port unless told otherwise.
        min_nodes, nnodes = (1, 1) if nodes_range is None else nodes_range
        multi = nnodes > 1
        default_port = _MULTI_NODE_DEFAULT_PORT if multi else 0
        options = LaunchOptions(
            nnodes=nnodes,
            node_rank=0 if ns.node_rank is None else ns.node_rank,
            master_addr=ns.master_addr or LOOPBACK_ADDR,
            master_port=default_port if ns.master_port is None else ns.master_port,
            run_id=ns.run_id,
            source="flags" if any(f is not None for f in layout_flags) else "single",
            min_nodes=min_nodes if min_nodes != nnodes else None,
            **common,
        )
    # Asked of the flags, not the value: 127.0.0.1 given on purpose (several agents on one host) is torchrun's too.
    if options.nnodes > 1 and options.source != "slurm" and ns.master_addr is None:
        raise ValueError("--master-addr (or --rdzv-endpoint) is required with --nnodes > 1: the address of node 0")
    flags.check_is_host(dict(options.rdzv_conf), options.node_rank)
    flags.worker_command(ns, sys.executable)  # raises naming a missing script, or -m with --no-python
    if options.log_dir:
        flags.check_log_dir(options.log_dir)
    return options, ns


def parse_launch_args(
    argv: Sequence[str], env: Mapping[str, str] | None = None
) -> tuple[LaunchOptions, str, list[str]]:
    """Parse ``lockstep launch`` arguments into options, the script path and its arguments.

    Explicit flags win; missing node-layout flags come from SLURM when SLURM_JOB_ID and
    SLURM_JOB_NODELIST are set (``env`` defaults to ``os.environ``; tests pass their own).
    Raises ValueError naming the bad flag or file (SystemExit from argparse for --help
    or a malformed flag).
    """
    options, ns = _parse(argv, os.environ if env is None else env)
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
        options, ns = _parse(argv, os.environ)
        command, command_args = flags.worker_command(ns, sys.executable)
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
        print(
            f"lockstep launch: {ensure_gloo_interface(options.master_addr, dict(os.environ))}",
            file=sys.stderr,
            flush=True,
        )
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        run_agent(options, command, command_args)
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
    except WorkersStopped as e:  # a user's Ctrl-C is a stop, not a failure: one line, a shell's 128 + signal
        print(e.line(), file=sys.stderr)
        return 128 + int(e.sigval)
    except SignalException as e:
        print(f"lockstep launch: stopped by {e.sigval.name}; the workers were stopped", file=sys.stderr)
        return 128 + int(e.sigval)
    except KeyboardInterrupt:  # before the agent handles signals itself: no worker had started
        print("lockstep launch: stopped by Ctrl-C (SIGINT) before the workers started", file=sys.stderr)
        return 128 + signal.SIGINT
    return 0


def slurm_script_main(argv: Sequence[str]) -> int:
    """``lockstep slurm-script ...``: print an sbatch script that runs ``lockstep launch`` on every node."""
    description = (sbatch_script.__doc__ or "").replace("``", "")  # a terminal shows rst's markup as is
    p = argparse.ArgumentParser(prog="lockstep slurm-script", description=description, allow_abbrev=False)
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
