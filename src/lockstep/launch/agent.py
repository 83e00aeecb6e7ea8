"""Running torch's elastic agent for ``lockstep launch``: the options, the agent's config and its environment.

The one idea here is ``_agent_environment``: torch's agent restarts a failed group
reliably only when it does not share its rendezvous store with the workers
(PyTorch issue #135712), so every run turns that sharing off. Everything else
maps ``LaunchOptions`` onto torch's ``LaunchConfig`` and turns a ChildFailedError
into our one-block ``LaunchError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import shutil
import signal
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException

from lockstep import keys
from lockstep.launch import console, elastic, orphan, rendezvous
from lockstep.launch.output import RANK_PREFIX_TEMPLATE, LaunchError, RankLogsSpecs
from lockstep.launch.repeats import restarts_end_on_a_repeat
from lockstep.launch.report import WorkersStopped, checkpoint_noted, failure_report
from lockstep.network import pick_gloo_interface, route_source_addr
from lockstep.slurm import PREEMPT_DIR_ENV, REQUEUE_EXIT_CODE

_SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # the agent stops the workers, then exits, on these
DEFAULT_SHUTDOWN_TIMEOUT_S = 15.0  # SIGTERM, then SIGKILL after this long: a stuck worker cannot hold the launcher
_TORCH_DEFAULT_SHUTDOWN_TIMEOUT_S = 30  # what an agent whose LaunchConfig has no shutdown_timeout field waits
LOOPBACK_ADDR = "127.0.0.1"  # single-node default: the rendezvous and MASTER_ADDR stay on loopback


class WorkersPreempted(RuntimeError):
    """SIGTERM reached the launcher and every worker here checkpointed and exited REQUEUE_EXIT_CODE."""


class RendezvousFailed(RuntimeError):
    """The agents could not meet: the port is taken, node 0 is unreachable, or the join timed out."""


@dataclass(frozen=True)
class LaunchOptions:
    """Where and how many workers this node's agent starts; validated on construction."""

    nproc_per_node: int
    nnodes: int = 1  # the most nodes (torchrun's MAX in --nnodes MIN:MAX)
    node_rank: int = 0  # which node hosts the rendezvous store (node 0); worker ranks are assigned by the rendezvous
    master_addr: str = LOOPBACK_ADDR
    master_port: int = 0  # 0: the OS picks a free port (single node only)
    max_restarts: int = 0
    log_rank: int | None = None  # show only this global rank's output; None shows every rank
    run_id: str = ""  # the rendezvous id every node must share; "" derives one from master_addr:master_port
    rdzv_timeout_s: int = 900  # how long the agents wait for all nodes to join before failing
    log_dir: str | None = None  # per-rank stdout/stderr files go here and stay; None: a temp dir kept only on failure
    source: str = "flags"  # "flags", "slurm" or "single": where the node layout came from
    as_torch_ddp: bool = False  # workers build lockstep's DDP where libraries build torch's (LOCKSTEP_AS_TORCH_DDP=1)
    node_timeout_s: float = 30.0  # several nodes: a node silent this long is lost (launch/rendezvous.py)
    # the workers' DDP hang_timeout_s (LOCKSTEP_HANG_TIMEOUT_S); None: DDP's default
    hang_timeout_s: float | None = None
    # After a SIGTERM (preemption) the workers get this long to finish their step and checkpoint before SIGKILL.
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    # torchrun's options with torchrun's meaning (launch/flags.py parses them).
    monitor_interval_s: float = 0.1  # how often the agent polls its workers: bounds failure-detection latency
    start_method: str = "spawn"  # function entry points only; a script is always its own process
    role: str = "default"
    event_log_handler: str = "null"
    local_addr: str | None = None  # this node's address in the rendezvous; None: the one that routes to the master
    rdzv_conf: tuple[tuple[str, str], ...] = ()  # extra keys for torch's c10d rendezvous (--rdzv-conf)
    signals_to_handle: str = _SIGNALS_TO_HANDLE
    redirects: str = "0"  # torchrun's -r: streams kept off the console (files only)
    tee: str = "0"  # torchrun's -t: streams shown although redirected
    local_ranks_filter: frozenset[int] = frozenset()  # console shows only these local ranks; empty: all
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    virtual_local_rank: bool = False
    numa_binding: str | None = None
    # --nnodes MIN:MAX: the job runs on MIN to nnodes nodes and re-forms when one leaves or joins
    # (launch/elastic.py); None: exactly nnodes
    min_nodes: int | None = None
    # --nnodes MIN:MAX: "in-place" (the survivors' workers re-form the group themselves, train/inplace/) or
    # "restart" (every worker restarted, torchrun's way)
    recovery: str = "in-place"

    @property
    def in_place(self) -> bool:
        return self.min_nodes is not None and self.recovery == "in-place"

    def __post_init__(self) -> None:
        if not self.monitor_interval_s > 0:
            raise ValueError(f"--monitor-interval must be > 0 seconds, got {self.monitor_interval_s}")
        if self.local_ranks_filter and self.log_rank is not None:
            raise ValueError("--local-ranks-filter and --log-rank both choose the ranks shown: give one")
        bad = sorted(r for r in self.local_ranks_filter if not 0 <= r < self.nproc_per_node)
        if bad:
            raise ValueError(
                f"--local-ranks-filter: local ranks {bad} do not exist (--nproc-per-node {self.nproc_per_node})"
            )
        if self.hang_timeout_s is not None and not self.hang_timeout_s >= 0:
            raise ValueError(f"--hang-timeout must be >= 0 seconds (0: off), got {self.hang_timeout_s}")
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nnodes:
            raise ValueError(f"--nnodes {self.min_nodes}:{self.nnodes}: MIN must be in [1, MAX]")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes={self.nnodes}), got {self.node_rank}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(
                f"--master-port must be in 1..65535 (0: any free port, one node only), got {self.master_port}"
            )
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("--master-port is required with --nnodes > 1: every node must dial the same port")
        if not self.master_addr:
            raise ValueError("--master-addr must not be empty")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        world_size = self.nnodes * self.nproc_per_node
        if self.log_rank is not None and not 0 <= self.log_rank < world_size:
            raise ValueError(f"--log-rank must be a global rank in [0, {world_size}), got {self.log_rank}")
        if self.rdzv_timeout_s <= 0:
            raise ValueError(f"--rdzv-timeout must be > 0 seconds, got {self.rdzv_timeout_s}")
        if not 3 <= self.node_timeout_s <= 3600:
            raise ValueError(f"--node-timeout must be in 3..3600 seconds, got {self.node_timeout_s}")
        if not 1 <= self.shutdown_timeout_s <= 3600:
            raise ValueError(f"--shutdown-timeout must be in 1..3600 seconds, got {self.shutdown_timeout_s}")
        if (self.shutdown_timeout_s != DEFAULT_SHUTDOWN_TIMEOUT_S and "shutdown_timeout" not in launch_config_fields()):
            import torch

            raise ValueError(
                f"--shutdown-timeout needs torch's LaunchConfig.shutdown_timeout, which torch {torch.__version__} "
                f"lacks: its agent always waits {_TORCH_DEFAULT_SHUTDOWN_TIMEOUT_S} s after SIGTERM before SIGKILL"
            )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def launch_config_fields() -> frozenset[str]:
    """The keyword arguments this torch's ``LaunchConfig`` accepts.

    Its fields differ between releases (torch 2.4 has neither ``signals_to_handle`` nor
    ``shutdown_timeout``; 2.11 has the first only), so we ask the class rather than
    compare version numbers.
    """
    from torch.distributed.launcher.api import LaunchConfig

    if dataclasses.is_dataclass(LaunchConfig):
        return frozenset(f.name for f in dataclasses.fields(LaunchConfig) if f.init)
    return frozenset(inspect.signature(LaunchConfig).parameters)


def _launch_config(options: LaunchOptions, logs: RankLogsSpecs):
    from torch.distributed.launcher.api import LaunchConfig

    single = options.nnodes == 1
    run_id = options.run_id
    if not run_id:
        # Every node must name the same rendezvous: derive it from what they share. One node can be unique.
        run_id = (
            f"lockstep-{uuid.uuid4().hex[:12]}" if single else f"lockstep-{options.master_addr}-{options.master_port}"
        )
    kwargs: dict[str, Any] = dict(
        # fixed size (min_nodes None): the rendezvous closes as soon as every node joined; MIN:MAX: once MIN
        # joined and the last call passed (launch/elastic.py)
        min_nodes=options.min_nodes or options.nnodes,
        max_nodes=options.nnodes,
        nproc_per_node=options.nproc_per_node,
        run_id=run_id,
        # torch's c10d rendezvous wrapped by lockstep's (launch/rendezvous.py): nodes numbered by --node-rank,
        # workers given --master-addr, stores bound to the master address (loopback on one node), a liveness check.
        rdzv_backend=rendezvous.BACKEND,
        rdzv_endpoint=f"{options.master_addr}:{options.master_port}",
        # is_host says who serves the rendezvous store: node 0, decided by flag rather
        # than by torch's guess from hostnames, which fails behind NAT or aliases.
        rdzv_configs={
            "is_host": single or options.node_rank == 0,
            # join_timeout is what the c10d rendezvous reads (torch's own "timeout" key is not consulted by it)
            "join_timeout": options.rdzv_timeout_s,
            "timeout": options.rdzv_timeout_s,
            "lockstep_node_rank": options.node_rank,
            "lockstep_nproc": options.nproc_per_node,
            "lockstep_master_addr": options.master_addr,
            "lockstep_port": options.master_port,
            "lockstep_node_timeout": options.node_timeout_s,
            "lockstep_inplace": options.in_place,
            **dict(options.rdzv_conf),
            **(
                {"last_call_timeout": int(elastic.DEFAULT_LAST_CALL_S)}
                if options.min_nodes not in (None, options.nnodes)
                else {}
            ),
        },
        max_restarts=options.max_restarts,
        monitor_interval=options.monitor_interval_s,
        start_method=options.start_method,
        role=options.role,
        log_line_prefix_template=RANK_PREFIX_TEMPLATE,
        logs_specs=logs,
        # How this node names itself in the rendezvous (torch would use its FQDN, which hosts may share).
        local_addr=options.local_addr or (options.master_addr if single else _local_addr(options.master_addr)),
    )
    # Passed only where this torch's LaunchConfig has the field. Without signals_to_handle the agent
    # handles the same four signals (hard-coded, or from TORCHELASTIC_SIGNALS_TO_HANDLE, which
    # _agent_environment sets); without shutdown_timeout it waits torch's default 30 s before SIGKILL
    # (LaunchOptions refuses a --shutdown-timeout it cannot honour). torch's field is an int of seconds.
    optional: dict[str, Any] = {"signals_to_handle": options.signals_to_handle,
                                "shutdown_timeout": max(1, round(options.shutdown_timeout_s))}
    if options.event_log_handler != "null":
        optional["event_log_handler"] = options.event_log_handler
    if options.duplicate_stdout_filters:
        optional["duplicate_stdout_filters"] = list(options.duplicate_stdout_filters)
    if options.duplicate_stderr_filters:
        optional["duplicate_stderr_filters"] = list(options.duplicate_stderr_filters)
    if options.virtual_local_rank:
        optional["virtual_local_rank"] = True
    if options.numa_binding is not None:
        from torch.numa.binding import AffinityMode, NumaOptions

        optional["numa_options"] = NumaOptions(affinity_mode=AffinityMode(options.numa_binding))
    fields = launch_config_fields()
    missing = sorted(
        name for name in optional if name not in fields and name not in ("signals_to_handle", "shutdown_timeout")
    )
    if missing:
        import torch

        raise ValueError(f"torch {torch.__version__}'s LaunchConfig has no {', '.join(missing)}: the torchrun flag "
                         "that sets it needs a newer torch")
    kwargs.update((name, value) for name, value in optional.items() if name in fields)
    return LaunchConfig(**kwargs)


def _local_addr(master_addr: str) -> str | None:
    try:
        return route_source_addr(master_addr)
    except OSError:
        return None  # unresolvable: the rendezvous reports it, naming the address


@contextlib.contextmanager
def _agent_environment(
    options: LaunchOptions, log_dir: str | None = None, extra: dict[str, str] | None = None
) -> Iterator[None]:
    """Environment the agent and (inherited) its workers need; restored afterwards (launch_function runs in-process)."""
    updates = {
        # The fix that makes --max-restarts work (PyTorch issue #135712): by default the agent shares its
        # rendezvous TCPStore with the workers, so a restarted group reads the dead attempt's gloo addresses
        # from it and fails in connectFullMesh or hangs. With sharing off, every attempt's rank 0 serves a
        # fresh store on a fresh port and no key survives a restart.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # Workers write to files that the agent tails; unbuffered output reaches the console line by line.
        "PYTHONUNBUFFERED": "1",
        # Where LaunchConfig has no signals_to_handle field, torch's process context reads this variable
        # (or, older still, hard-codes the same four signals); where it has one, torch sets it itself.
        "TORCHELASTIC_SIGNALS_TO_HANDLE": _SIGNALS_TO_HANDLE,
    }
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        # gloo binds to the interface that reaches the master (loopback on one node), not to whatever the host
        # name resolves to (127.0.0.1 in many containers, which strands the other nodes); a user's choice stands.
        picked = pick_gloo_interface(options.master_addr)
        if picked is not None:
            updates["GLOO_SOCKET_IFNAME"] = updates[keys.GLOO_IFNAME_PICKED_ENV] = picked[0]
    if options.hang_timeout_s is not None:
        updates[keys.HANG_TIMEOUT_ENV] = f"{options.hang_timeout_s:g}"  # DDP's default (diagnostics.watchdog)
    if log_dir:
        updates[keys.LOG_DIR_ENV] = log_dir  # hang reports go beside the ranks' logs
    updates.update(extra or {})
    if options.in_place:
        updates[keys.INPLACE_ENV] = "1"  # the Trainer recovers from a lost node in place (train/inplace/)
        updates[keys.INPLACE_MIN_WORLD_ENV] = str((options.min_nodes or 1) * options.nproc_per_node)
    if options.as_torch_ddp:
        # read in every worker at `import torch` (lockstep.integrations.autoload)
        updates[keys.AS_TORCH_DDP_ENV] = "1"
    if "OMP_NUM_THREADS" not in os.environ and options.nproc_per_node > 1:
        # As torchrun does: N workers each starting one thread per core would oversubscribe the CPUs.
        updates["OMP_NUM_THREADS"] = "1"
    # torch's launch_agent sets this variable and installs handlers for these signals without undoing
    # either; launch_function runs in the caller's process, whose Ctrl-C must behave as before afterwards.
    # and the job's id, which the rendezvous handler sets once the round knows it (launch/rendezvous.py)
    saved = {k: os.environ.get(k) for k in [*updates, keys.JOB_ENV]}
    handled = [getattr(signal, name) for name in _SIGNALS_TO_HANDLE.split(",") if hasattr(signal, name)]
    in_main_thread = threading.current_thread() is threading.main_thread()
    saved_handlers = {sig: signal.getsignal(sig) for sig in handled} if in_main_thread else {}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
        for sig, handler in saved_handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


def run_agent(options: LaunchOptions, entrypoint: Callable | str, args: Sequence[Any] = ()) -> dict[int, Any]:
    """Run ``entrypoint`` (a function, or an executable such as sys.executable) under torch's elastic agent.

    Returns {global rank: return value} (None values for executables). Raises LaunchError
    naming the first failed rank, its exit code and the tail of its stderr once the
    restarts are used up, and RendezvousFailed when the nodes cannot meet.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    if options.log_dir:
        os.makedirs(options.log_dir, exist_ok=True)
    log_dir = options.log_dir or tempfile.mkdtemp(prefix="lockstep_launch_")
    logs = RankLogsSpecs(log_dir, log_rank=options.log_rank, max_restarts=options.max_restarts,
                         redirects=options.redirects, tee=options.tee, local_ranks_filter=options.local_ranks_filter)
    config = _launch_config(options, logs)
    rendezvous.register()

    def stop_reason() -> str | None:
        handler = rendezvous.handler_for(config.run_id)
        return handler.take_stop_reason() if handler is not None else None

    logs.stop_reason = stop_reason
    keep_logs = bool(options.log_dir)  # the user asked for them
    # Preempted workers leave a file here (train/preempt.py): after a SIGTERM the agent keeps no exit codes
    preempt_dir = tempfile.mkdtemp(prefix="preempted-", dir=log_dir)
    try:
        if isinstance(entrypoint, str):
            logs.every_exit_recorded = True
            # Each worker dies with this launcher, even a kill -9 of it (orphan.py): torch's agent cannot.
            entrypoint, args = orphan.guarded_command(entrypoint, args)
        with (
            _agent_environment(options, log_dir, {PREEMPT_DIR_ENV: preempt_dir, keys.REPORT_ENV: "1"}),
            console.single_prefix() as shown,
            console.quiet_agent_log(logs, shown),
            restarts_end_on_a_repeat(logs, options.max_restarts) as guard,
        ):
            results = elastic_launch(config, entrypoint)(*args)
    except SignalException as e:
        raise _stopped(signal.Signals(e.sigval), options, preempt_dir) from None
    except ChildFailedError as e:
        keep_logs = True  # the report points the user at them
        report = failure_report(e, logs, restarts_used=logs.restart_count)
        handler = rendezvous.handler_for(config.run_id)
        if handler is not None and handler.lost_reason is not None:
            # The workers here were stopped because another node went silent: say that, not "killed by SIGKILL".
            report = _headed(report, f"lockstep launch: lost a node: {handler.lost_reason}; this node's workers "
                                     "were stopped (a cut link or a dead node; --max-restarts "
                                     f"{options.max_restarts} used up)")
        elif guard.line is not None:  # the attempt before failed the same way (launch/repeats.py): no more restarts
            report = _headed(report, guard.line)
        raise report from None
    except RendezvousError as e:
        raise _rendezvous_failed(e, options, config.rdzv_endpoint) from e
    finally:
        shutil.rmtree(preempt_dir, ignore_errors=True)
        if not keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
    return dict(results or {})


def _headed(report: LaunchError, header: str) -> LaunchError:
    """The failure report under a line that says why it ends the job, its own lines indented beneath."""
    text = "\n".join([header, *("  " + line for line in str(report).splitlines())])
    return LaunchError(text, report.rank, report.exitcode, report.failures)


def _stopped(sigval: signal.Signals, options: LaunchOptions, preempt_dir: str) -> RuntimeError | WorkersStopped:
    """What a signal to the launcher ended in: every worker here preempted after its checkpoint (SIGTERM), or
    workers stopped (Ctrl-C's SIGINT, a SIGTERM before the checkpoints), naming a Trainer's newest one."""
    done = sorted(name for name in os.listdir(preempt_dir) if name.startswith("rank"))
    if sigval == signal.SIGTERM and len(done) >= options.nproc_per_node:
        return WorkersPreempted(
            f"lockstep launch: stopped by SIGTERM; every worker here ({', '.join(done)}) finished its step and "
            f"wrote a checkpoint; exit code {REQUEUE_EXIT_CODE} asks the scheduler to requeue "
            "(resume=True continues)"
        )
    return WorkersStopped(sigval, options.nproc_per_node, checkpoint_noted(preempt_dir))


def _rendezvous_failed(e: Exception, options: LaunchOptions, endpoint: str) -> RendezvousFailed:
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    if isinstance(e, RendezvousTimeoutError):
        why = (f"only some of the {options.nnodes} nodes joined within --rdzv-timeout {options.rdzv_timeout_s}s; "
               f"is `lockstep launch` running on every node with the same --master-addr/--master-port?")
    else:
        why = f"{type(e).__name__}: {e}"
        if e.__cause__ is not None:
            why += f" ({type(e.__cause__).__name__}: {e.__cause__})"
    return RendezvousFailed(
        f"lockstep launch: the rendezvous at {endpoint} (--master-addr/--master-port) failed: {why}"
    )
