"""``lockstep launch``'s command line: torchrun's flags with torchrun's meaning, plus lockstep's own.

The one idea: a torchrun command line must run unchanged under ``lockstep launch``. Every option of
``torch.distributed.run.get_args_parser()`` is either accepted here with torch's meaning or listed in
``TORCHRUN_NOT_SUPPORTED`` with the reason, and ``tests/test_launch_flags.py`` compares the two parsers,
so a flag that a new torch adds fails that test until it is handled. ``--nnodes`` (N or MIN:MAX) is read
by ``launch/elastic.parse_nnodes``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from lockstep.launch.elastic import parse_nnodes

# torchrun options that lockstep launch refuses, and why (a one-line error names the reason).
TORCHRUN_NOT_SUPPORTED = {
    "--run-path": "it runs the script with runpy inside the agent's spawned workers; lockstep launch starts each "
    "worker as its own 'python -u SCRIPT' (the same script runs unchanged without the flag)",
    "--logs-specs": "lockstep launch's own logs spec writes the rank prefixes and the failure report; a custom "
    "torchrun.logs_specs entry point would lose both",
}

# --rdzv-conf keys torch's c10d rendezvous reads; lockstep's own keys (lockstep_*) are set by the launcher.
RDZV_CONF_KEYS = frozenset({"join_timeout", "timeout", "last_call_timeout", "close_timeout", "read_timeout",
                            "keep_alive_interval", "keep_alive_max_attempt", "heartbeat", "use_libuv", "store_type",
                            "is_host"})
# torch's RendezvousParameters.get_as_bool spellings, for is_host
_TRUE, _FALSE = ("1", "true", "t", "yes", "y"), ("0", "false", "f", "no", "n")
RDZV_BACKENDS = ("c10d", "static")  # both meet through lockstep's wrapper of torch's c10d rendezvous


def parse_nproc(value: str) -> int:
    """torchrun's ``--nproc-per-node``: an integer, ``auto`` (one per GPU, else 2 CPU workers), ``cpu``, ``gpu``,
    ``xpu``."""
    import torch

    if value == "auto":
        return torch.cuda.device_count() if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 2
    if value == "cpu":
        return os.cpu_count() or 1
    if value == "gpu":
        if not torch.cuda.is_available():
            raise ValueError("--nproc-per-node gpu: CUDA is not available here")
        return torch.cuda.device_count()
    if value == "xpu":
        if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
            raise ValueError("--nproc-per-node xpu: no XPU is available here")
        return torch.xpu.device_count()
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--nproc-per-node must be an integer, auto, cpu, gpu or xpu, got {value!r}") from None


def parse_std(flag: str, value: str) -> Any:
    """torchrun's ``--redirects``/``--tee`` value (``3``, or ``0:1,1:2`` per local rank) as torch's Std (or a map)."""
    from torch.distributed.elastic.multiprocessing import Std

    try:
        return Std.from_str(value)
    except ValueError:
        raise ValueError(
            f"{flag} must be 0-3 (1: stdout, 2: stderr, 3: both) or LOCAL_RANK:0-3,..., got {value!r}"
        ) from None


def parse_rdzv_conf(value: str) -> dict[str, str]:
    """``--rdzv-conf k1=v1,k2=v2`` into a dict; an unknown key is an error naming it (torch would ignore it)."""
    conf: dict[str, str] = {}
    for item in filter(None, value.split(",")):
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--rdzv-conf takes KEY=VALUE,...; got {item!r}")
        if key.strip() not in RDZV_CONF_KEYS:
            raise ValueError(f"--rdzv-conf: unknown key {key.strip()!r} (known: {', '.join(sorted(RDZV_CONF_KEYS))})")
        conf[key.strip()] = val.strip()
    if "is_host" in conf:
        value = conf["is_host"].lower()
        if value not in _TRUE + _FALSE:
            raise ValueError(f"--rdzv-conf is_host takes true or false (torch's 1/0, yes/no too), got {value!r}")
        conf["is_host"] = "true" if value in _TRUE else "false"
    return conf


def check_is_host(conf: dict[str, str], node_rank: int) -> None:
    """torch's c10d key ``is_host``: whether this node serves the rendezvous store (torchrun users set it where
    the nodes share a host name, so torch cannot tell from the name). lockstep launch serves it on node 0,
    decided by ``--node-rank`` and never by the host name, so the key is passed through when it agrees and is an
    error naming both when it does not (a client that thinks it hosts, or two hosts, would never meet)."""
    if conf.get("is_host") == "true" and node_rank != 0:
        raise ValueError(f"--rdzv-conf is_host=true, but this node is --node-rank {node_rank}: lockstep launch "
                         "serves the rendezvous store on --node-rank 0")
    if conf.get("is_host") == "false" and node_rank == 0:
        raise ValueError("--rdzv-conf is_host=false, but this node is --node-rank 0, which serves the rendezvous "
                         "store under lockstep launch: give this node its --node-rank (1 or more)")


def parse_local_ranks(value: str) -> frozenset[int]:
    try:
        return frozenset(int(r) for r in value.split(",") if r.strip())
    except ValueError:
        raise ValueError(f"--local-ranks-filter takes local ranks separated by commas (0,1), got {value!r}") from None


def _nproc_form(value: str) -> str:
    if value in ("auto", "cpu", "gpu", "xpu") or value.lstrip("-").isdigit():
        return value
    raise argparse.ArgumentTypeError(f"--nproc-per-node must be an integer, auto, cpu, gpu or xpu, got {value!r}")


def _comma_list(value: str) -> list[str]:
    """torchrun's --duplicate-*-filters: comma-separated, a double comma is a literal comma."""
    return [item.replace("\0", ",") for item in value.replace(",,", "\0").split(",")]


def build_parser() -> argparse.ArgumentParser:
    from lockstep.launch.agent import DEFAULT_SHUTDOWN_TIMEOUT_S

    p = argparse.ArgumentParser(
        prog="lockstep launch",
        description="Run SCRIPT on N processes per node with torch's elastic agent. Single node on loopback by "
        "default; inside a SLURM allocation the node layout comes from SLURM. torchrun's flags work with "
        "torchrun's meaning.",
        allow_abbrev=False,
    )
    add = p.add_argument
    # ---- node layout
    add("--nproc-per-node", "--nproc_per_node", type=_nproc_form, default="auto",
        help="workers on this node: an integer, 'auto' = one per GPU, else 2; 'cpu', 'gpu', 'xpu' as torchrun "
        "(default: auto)")
    add("--nnodes", type=parse_nnodes, default=None, metavar="N|MIN:MAX",
        help="number of nodes, or MIN:MAX for an elastic job that goes on with the nodes still there "
        "and grows back when one joins (torchrun's syntax; docs/preemptible.md) (default: 1, or SLURM's)")
    add("--node-rank", "--node_rank", type=int, default=None,
        help="this node's index; node 0 hosts the rendezvous (default: 0, or SLURM_NODEID)")
    add("--master-addr", "--master_addr", default=None,
        help="address of node 0 (default: 127.0.0.1, or the first SLURM host)")
    add("--master-port", "--master_port", type=int, default=None,
        help="rendezvous port on node 0 (default: a free port on one node; 29500 or SLURM-derived otherwise)")
    add("--local-addr", "--local_addr", default=None,
        help="this node's address in the rendezvous (default: the one that routes to --master-addr)")
    # ---- rendezvous (torchrun's names)
    add("--standalone", action="store_true",
        help="one node, a rendezvous on loopback at a free port with a fresh id (lockstep launch's default; "
        "--rdzv-* are then ignored, as torchrun does)")
    add("--rdzv-backend", "--rdzv_backend", default=None,
        help=f"accepted: {', '.join(RDZV_BACKENDS)}; both use lockstep's wrapper of torch's c10d rendezvous")
    add("--rdzv-endpoint", "--rdzv_endpoint", default=None,
        help="HOST:PORT of the rendezvous: the same as --master-addr HOST --master-port PORT")
    add("--rdzv-id", "--rdzv_id", "--run-id", "--run_id", dest="run_id", default="",
        help="rendezvous id shared by all nodes (multi-node)")
    add("--rdzv-conf", "--rdzv_conf", default="",
        help="KEY=VALUE,... for torch's c10d rendezvous (join_timeout sets --rdzv-timeout)")
    add("--rdzv-timeout", "--rdzv_timeout", type=int, default=None, metavar="SECONDS",
        help="how long the nodes wait for each other before failing (default: 900)")
    add("--node-timeout", "--node_timeout", type=float, default=30.0, metavar="SECONDS",
        help="several nodes: a node whose heartbeat stops this long is lost; its peers stop their workers "
        "and restart (--max-restarts) or fail, naming it (default: 30)")
    add("--recovery", default="in-place", choices=["in-place", "restart"],
        help="--nnodes MIN:MAX: when a node is lost, the survivors' workers re-form the group in place and go on "
        "from the last completed step (in-place), or every worker is restarted from the last checkpoint "
        "(restart, torchrun's way; default: in-place)")
    # ---- the workers
    add("--max-restarts", "--max_restarts", type=int, default=0,
        help="restart the whole group up to K times after a worker fails (default: 0)")
    add("--monitor-interval", "--monitor_interval", type=float, default=0.1, metavar="SECONDS",
        help="how often the agent polls its workers (default: 0.1)")
    add("--start-method", "--start_method", default="spawn", choices=["spawn", "fork", "forkserver"],
        help="how function entry points are started (scripts always run as their own process; default: spawn)")
    add("--role", default="default", help="the workers' role name (torch's agent; default: default)")
    add("--event-log-handler", "--event_log_handler", default="null",
        help="torch's elastic event log handler (default: null)")
    add("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m (torchrun's -m)")
    add("--no-python", "--no_python", action="store_true",
        help="run SCRIPT as an executable, without prepending python -u")
    add("--signals-to-handle", "--signals_to_handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        help="signals the agent forwards to the workers before stopping (default: SIGTERM,SIGINT,SIGHUP,SIGQUIT)")
    add("--shutdown-timeout", "--shutdown_timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="SECONDS",
        help="after a SIGTERM (preemption), how long the workers get to finish their step and write a "
        f"checkpoint before SIGKILL (default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g}; whole seconds)")
    add("--virtual-local-rank", "--virtual_local_rank", action="store_true",
        help="every worker sees LOCAL_RANK=0 and only its own GPU in CUDA_VISIBLE_DEVICES (torch's agent)")
    add("--numa-binding", "--numa_binding", default=None,
        help="bind workers to the CPUs near their GPU (torch's modes: node, socket, exclusive, core-complex)")
    # ---- output
    add("--log-dir", "--log_dir", default=None,
        help="keep every rank's stdout/stderr under this folder, one sub-folder per job (default: a temporary "
        "folder, kept only when a worker fails)")
    add("-r", "--redirects", default="0",
        help="streams NOT shown on the console, only written to the log files: 1 stdout, 2 stderr, 3 both, or "
        "LOCAL_RANK:N,... (torchrun's -r; default: 0)")
    add("-t", "--tee", default="0",
        help="streams shown on the console although --redirects names them (torchrun's -t; lockstep launch always "
        "writes the log files)")
    add("--local-ranks-filter", "--local_ranks_filter", default="",
        help="show only these local ranks' output on the console, e.g. 0,1 (the log files keep every rank)")
    add("--log-rank", "--log_rank", type=int, default=None,
        help="show only this global rank's output (default: every rank, prefixed [rankN])")
    add("--duplicate-stdout-filters", "--duplicate_stdout_filters", type=_comma_list, default=[],
        help="also copy stdout lines containing any of these words (comma-separated) to a file (torch's agent)")
    add("--duplicate-stderr-filters", "--duplicate_stderr_filters", type=_comma_list, default=[],
        help="the same for stderr")
    add("--hang-timeout", "--hang_timeout", type=float, default=None, metavar="SECONDS",
        help="a rank stuck this long inside a DDP step makes every rank write a hang report (beside the "
        "logs) and ends the job with exit code 86; 0: off (default: DDP's, 300; sets LOCKSTEP_HANG_TIMEOUT_S)")
    add("--as-torch-ddp", "--as_torch_ddp", action="store_true",
        help="workers build lockstep's DistributedDataParallel wherever a library (Accelerate, Lightning) "
        "or the script builds torch's (sets LOCKSTEP_AS_TORCH_DDP=1; needs torch >= 2.5)")
    # torchrun's two forms of each, so that the error names the reason instead of "unrecognized arguments"
    add("--run-path", "--run_path", action="store_true", help=f"not supported: {TORCHRUN_NOT_SUPPORTED['--run-path']}")
    add("--logs-specs", "--logs_specs", default=None, help=f"not supported: {TORCHRUN_NOT_SUPPORTED['--logs-specs']}")
    add("script", help="the Python script each worker runs (a module with -m, an executable with --no-python)")
    # Optional: a script may take no arguments. argparse marks a REMAINDER positional required (3.10-3.13 alike),
    # so a bare `lockstep launch` said "required: script, script_args".
    add("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script").required = False
    return p


def check_log_dir(path: str) -> None:
    """Create --log-dir now, so a bad path is a one-line error before any worker starts."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--log-dir {path!r} cannot be created: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--log-dir {path!r} is not writable")


def worker_command(ns: argparse.Namespace, python: str) -> tuple[str, list[str]]:
    """The executable and arguments each worker runs, as torchrun builds them (-m, --no-python)."""
    if ns.module and ns.no_python:
        raise ValueError("-m/--module and --no-python cannot be used together (torchrun refuses them too)")
    if ns.no_python:
        return ns.script, list(ns.script_args)
    if ns.module:
        return python, ["-u", "-m", ns.script, *ns.script_args]
    if not os.path.isfile(ns.script):
        raise ValueError(f"script {ns.script!r} not found (the SCRIPT argument of lockstep launch)")
    # -u: unbuffered, so a worker's last lines are in its log file even if it is killed.
    return python, ["-u", ns.script, *ns.script_args]
