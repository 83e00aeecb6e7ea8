"""Process-group setup from whatever launched us: torchrun / ``lockstep launch``, SLURM's srun, or OpenMPI.

Each launcher describes the job in its own environment variables. ``init()`` reads
them into one ``LaunchEnv`` (rank, world size, local rank, master address and port),
refuses missing or contradictory values with an error that names the variable and
the launchers that set it, then starts ``torch.distributed`` with NCCL on a GPU and
gloo otherwise.
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lockstep.keys import (
    GLOO_IFNAME_PICKED_ENV,
    INPLACE_BASE_KEY,
    INPLACE_ENDED_KEY,
    INPLACE_JOIN_COUNT_KEY,
    INPLACE_JOIN_ENV,
    INPLACE_TIMEOUT_ENV,
    admit_key,
    beat_key,
    generation_key,
    join_record_key,
)
from lockstep.network import ensure_gloo_interface, is_loopback, serve_store
from lockstep.slurm import expand_nodelist, port_from_job_id

_DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher described it."""

    launcher: str  # "torchrun", "slurm", "openmpi" or "single"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


@dataclass(frozen=True)
class DistEnv:
    """What ``init()`` set up: returned to the caller, never read back from a global."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str


def _int_var(env: dict, name: str, launcher_hint: str) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        raise RuntimeError(f"environment variable {name} is missing; it is set by {launcher_hint}")
    try:
        return int(raw)
    except ValueError as e:
        raise RuntimeError(f"environment variable {name}={raw!r} is not an integer") from e


_TORCHRUN_HINT = "torchrun / `lockstep launch` (torch.distributed.run)"
_SLURM_HINT = "srun inside a SLURM allocation"
_MPI_HINT = "OpenMPI's mpirun"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it); for single-node groups started here."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def detect_launch_env(env: dict | None = None) -> LaunchEnv:
    """Read the launcher's variables. Precedence: torchrun's RANK, then SLURM under srun, then OpenMPI.

    A process started by none of them (no RANK, SLURM_PROCID or OMPI_COMM_WORLD_RANK)
    is a single-process job: rank 0 of 1.
    """
    env = dict(os.environ if env is None else env)
    if "RANK" in env or "WORLD_SIZE" in env:
        rank = _int_var(env, "RANK", _TORCHRUN_HINT)
        world_size = _int_var(env, "WORLD_SIZE", _TORCHRUN_HINT)
        local_rank = _int_var(env, "LOCAL_RANK", _TORCHRUN_HINT) if "LOCAL_RANK" in env else rank
        addr = env.get("MASTER_ADDR")
        if not addr:
            raise RuntimeError(f"environment variable MASTER_ADDR is missing; it is set by {_TORCHRUN_HINT}")
        port = _int_var(env, "MASTER_PORT", _TORCHRUN_HINT)
        launcher = "torchrun"
    elif "SLURM_PROCID" in env and ("SLURM_NTASKS" in env or "SLURM_NPROCS" in env):
        rank = _int_var(env, "SLURM_PROCID", _SLURM_HINT)
        world_size = _int_var(env, "SLURM_NTASKS" if "SLURM_NTASKS" in env else "SLURM_NPROCS", _SLURM_HINT)
        local_rank = _int_var(env, "SLURM_LOCALID", _SLURM_HINT)
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if env.get("MASTER_ADDR"):
            addr = env["MASTER_ADDR"]
        elif nodelist:
            addr = expand_nodelist(nodelist)[0]
        else:
            raise RuntimeError(
                f"environment variable SLURM_JOB_NODELIST is missing (needed for the master address); "
                f"it is set by {_SLURM_HINT}, or set MASTER_ADDR"
            )
        if env.get("MASTER_PORT"):
            port = _int_var(env, "MASTER_PORT", "the user")
        elif env.get("SLURM_JOB_ID"):
            port = port_from_job_id(env["SLURM_JOB_ID"])
        else:
            raise RuntimeError(f"neither MASTER_PORT nor SLURM_JOB_ID is set; SLURM_JOB_ID is set by {_SLURM_HINT}")
        launcher = "slurm"
    elif "OMPI_COMM_WORLD_RANK" in env:
        rank = _int_var(env, "OMPI_COMM_WORLD_RANK", _MPI_HINT)
        world_size = _int_var(env, "OMPI_COMM_WORLD_SIZE", _MPI_HINT)
        local_rank = _int_var(env, "OMPI_COMM_WORLD_LOCAL_RANK", _MPI_HINT)
        addr = env.get("MASTER_ADDR")
        if not addr:
            raise RuntimeError(
                "environment variable MASTER_ADDR is missing; OpenMPI does not set it: pass "
                "`-x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<port>` to mpirun"
            )
        port = _DEFAULT_PORT
        if env.get("MASTER_PORT"):
            port = _int_var(env, "MASTER_PORT", "the user (`mpirun -x MASTER_PORT=...`)")
        launcher = "openmpi"
    else:
        addr, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", _DEFAULT_PORT))
        return LaunchEnv("single", 0, 1, 0, addr, port)

    if world_size < 1:
        raise RuntimeError(f"world size must be >= 1, got {world_size} (from the {launcher} environment)")
    if not 0 <= rank < world_size:
        raise RuntimeError(f"rank {rank} is outside [0, world size {world_size}) (from the {launcher} environment)")
    if local_rank < 0 or local_rank > rank:
        raise RuntimeError(
            f"local rank {local_rank} contradicts rank {rank}: a local rank is >= 0 and <= the global rank "
            f"(from the {launcher} environment)"
        )
    if not 0 < port < 65536:
        raise RuntimeError(f"master port {port} is outside 1..65535 (from the {launcher} environment)")
    return LaunchEnv(launcher, rank, world_size, local_rank, addr, port)


def _gloo_interface(master_addr: str) -> str:
    """Point gloo at the interface that reaches the master unless the user did; the log line says which."""
    picked_by_launch = os.environ.get(GLOO_IFNAME_PICKED_ENV)
    if picked_by_launch and os.environ.get("GLOO_SOCKET_IFNAME") == picked_by_launch:
        return (f"gloo uses interface {picked_by_launch}, the one that reaches the master {master_addr} "
                "(chosen by lockstep launch)")
    return ensure_gloo_interface(master_addr)


def _loopback_store(launch: LaunchEnv, timeout_s: float) -> dist.Store | None:
    """When every rank is on this machine and the master is loopback, a store that listens on 127.0.0.1 only.

    torch's env:// store would listen on every interface, open to anyone who can reach the machine.
    None (torch's own store) under an elastic agent that serves the store itself (TORCHELASTIC_USE_AGENT_STORE,
    as `lockstep launch` does), or when some ranks are elsewhere.
    """
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or local_world != str(launch.world_size)
            or not is_loopback(launch.master_addr)):
        return None
    timeout = datetime.timedelta(seconds=timeout_s)
    if launch.rank == 0:
        return serve_store("127.0.0.1", launch.master_port, timeout_s, launch.world_size)
    return dist.TCPStore("127.0.0.1", launch.master_port, launch.world_size, False, timeout)


def _pick_backend(local_rank: int, backend: str | None) -> tuple[str, torch.device]:
    has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if backend is None:
        backend = "nccl" if has_gpu else "gloo"
    if backend == "nccl" and not has_gpu:
        raise RuntimeError("backend='nccl' needs a CUDA GPU, and this process sees none; use backend='gloo'")
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if has_gpu else torch.device("cpu")
    if has_gpu:
        # Each rank must own its device before NCCL creates communicators, or all land on cuda:0.
        torch.cuda.set_device(device)
    return backend, device


def init(backend: str | None = None, timeout_s: float = 1800.0, env: dict | None = None) -> DistEnv:
    """Start the default process group from the launcher's environment.

    Args:
        backend: "nccl" or "gloo"; None picks NCCL when this process has a GPU, gloo otherwise.
        timeout_s: how long a collective may wait for the other ranks before it fails
            (a failed or stuck rank then ends the job with an error, not a hang).
        env: the environment to read (default ``os.environ``); for tests and wrappers.

    Returns the ``DistEnv``. Calling it again once the group exists returns the same description.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    launch = detect_launch_env(env)
    backend, device = _pick_backend(launch.local_rank, backend)
    interface_note = None
    if not dist.is_initialized():
        # init_process_group's env:// reads these; srun and mpirun do not set them.
        os.environ.setdefault("MASTER_ADDR", launch.master_addr)
        os.environ.setdefault("MASTER_PORT", str(launch.master_port))
        if launch.launcher != "single":
            interface_note = _gloo_interface(launch.master_addr)
        before = socket_fds()
        if os.environ.get(INPLACE_JOIN_ENV):  # a node that came back joins the running group (no new world)
            _join_in_place(backend, json.loads(os.environ[INPLACE_JOIN_ENV]), launch.local_rank)
        else:
            dist.init_process_group(
                backend=backend,
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
                device_id=device if backend == "nccl" else None,
                store=_loopback_store(launch, timeout_s),
            )
        _GROUP_SOCKETS[:] = sorted(socket_fds() - before)
    else:
        backend = dist.get_backend()
    _configure_logging(dist.get_rank())
    if interface_note:
        logging.getLogger("lockstep.process_group").info(interface_note)
    return DistEnv(dist.get_rank(), launch.local_rank, dist.get_world_size(), device, backend)


# -- joining a running in-place group (train/inplace/; the keys are lockstep/keys.py's) -------------------------
JOIN_WAIT_S = 600.0  # how long a newcomer waits to be admitted (the others admit at their next step boundary)
_ADMISSION: list[dict] = []  # what the survivors admitted this process as (read once by train/inplace/group.py)


def _join_in_place(backend: str, spec: dict, local_rank: int) -> None:
    """Announce this process in the running job's store, wait until its ranks admit it at a step boundary, and
    make the default group with them (their generation's store prefix). Its id (the launch rank of a newcomer) is
    ``spec["base"]`` plus its place among the newcomers; it beats a heart while it waits, so that the others
    admit only processes that are alive."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                          datetime.timedelta(seconds=60), wait_for_workers=False)
    seq = store.add(INPLACE_JOIN_COUNT_KEY, 1)
    base = int(store.get(INPLACE_BASE_KEY)) if store.check([INPLACE_BASE_KEY]) else int(spec["base"])
    me = base + seq - 1
    record = {"id": me, "node": spec["node"], "local_rank": local_rank,
              "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", "1")), "t0": spec["t0"]}
    store.set(join_record_key(seq), json.dumps(record))
    beating = threading.Event()  # cleared by take_admission: the in-place group's watcher beats from then on
    beating.set()
    beat = threading.Thread(target=_beat, args=(store, beat_key(me), beating), daemon=True,
                            name="lockstep-join-beat")
    beat.start()
    admit, deadline = admit_key(me), time.monotonic() + JOIN_WAIT_S
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    while not (admitted := _admitted(store, admit, where)):
        if admitted is None:  # the job ended before admitting this process: nothing to train, exit 0
            beating.clear()
            beat.join(timeout=2)  # a store call cut off by the interpreter's exit aborts the process (SIGABRT)
            raise SystemExit(0)
        if time.monotonic() > deadline:
            raise RuntimeError(f"lockstep: joining the running job at {where}: not admitted within {JOIN_WAIT_S:.0f} s")
        time.sleep(0.1)
    admission = {**json.loads(store.get(admit)), "id": me}
    members = admission["members"]
    timeout_s = float(os.environ.get(INPLACE_TIMEOUT_ENV) or 60)
    pg_store = dist.PrefixStore(generation_key(admission["generation"], "pg"), store)
    dist.init_process_group(backend, store=pg_store, rank=members.index(me), world_size=len(members),
                            timeout=datetime.timedelta(seconds=timeout_s))
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(members.index(me)), str(len(members))
    _ADMISSION[:] = [{**admission, "beating": beating}]


def _admitted(store: dist.Store, admit: str, where: str) -> bool | None:
    """Whether the running job admitted this process; None where the job ended meanwhile (the newcomer came too
    late: said in one line, and the caller leaves with exit 0, having trained nothing). A store that stopped
    answering: a named error, not the store client's."""
    try:
        if store.check([admit]):
            return True
        ended = json.loads(store.get(INPLACE_ENDED_KEY)) if store.check([INPLACE_ENDED_KEY]) else None
    except Exception:
        raise RuntimeError(f"lockstep: joining the running job at {where}: its store stopped answering before this "
                           "process was admitted (the job ended, or the node serving its store was lost)") from None
    if ended is not None:
        print(f"lockstep: the running job at {where} ended at step {ended['step']} before it admitted this process: "
              "nothing to train here", file=sys.stderr, flush=True)
        return None
    return False


def _beat(store: dist.Store, key: str, beating: threading.Event) -> None:
    while beating.is_set():
        try:
            store.add(key, 1)
        except Exception:  # the store is slow or gone: the others' timeouts decide
            pass
        time.sleep(0.2)


def admission_pending() -> bool:
    """This process joined a running in-place group and nothing has taken its admission yet (a script's DDP built
    before its ``InPlaceRecovery``): the running ranks are between two steps, not in a construction's collectives."""
    return bool(_ADMISSION)


def take_admission() -> dict | None:
    """How this process joined a running in-place group (``_join_in_place``), once; None where it did not. The
    heartbeat it kept stops: the caller's (train/inplace/watcher.py) takes over."""
    if not _ADMISSION:
        return None
    admission = _ADMISSION.pop()
    admission.pop("beating").clear()
    return admission


# The sockets the default group's creation opened (gloo's connections, the store's client): in-place recovery
# (train/inplace/watcher.py) shuts them down to end a collective that waits on a lost peer; gloo cannot abort one.
_GROUP_SOCKETS: list[int] = []


def socket_fds() -> set[int]:
    found = set()
    for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        try:
            if stat.S_ISSOCK(os.stat(f"/proc/self/fd/{fd}").st_mode):
                found.add(int(fd))
        except (OSError, ValueError):
            continue  # closed meanwhile (listdir's own descriptor)
    return found


def group_sockets() -> set[int]:
    """The socket descriptors ``init()`` saw the default group open (empty where it did not make it)."""
    return set(_GROUP_SOCKETS)


# Called by shutdown() before the group goes, in registration order: the diagnostics register here
# (the trace writes a window the run never closed) so this module needs to know none of them.
_BEFORE_SHUTDOWN: list[Callable[[], None]] = []


def on_shutdown(callback: Callable[[], None]) -> None:
    """Have ``shutdown()`` call ``callback`` (which must not raise) before it tears the group down."""
    if callback not in _BEFORE_SHUTDOWN:
        _BEFORE_SHUTDOWN.append(callback)


def shutdown() -> None:
    """Tear the default group down; safe to call when none exists (use it in ``finally``).

    Collects garbage first and after: a DDP model lives in a reference cycle (its hooks point back
    at the reducer), and a process group freed only during interpreter teardown has been seen to
    abort the process at exit ("terminate called without an active exception"). The callbacks of
    ``on_shutdown`` run first, while the DDP objects they may hold weakly are still alive.
    """
    for callback in list(_BEFORE_SHUTDOWN):
        callback()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def is_main() -> bool:
    """True on global rank 0, or when no group is running (a single process is its own main)."""
    return not dist.is_initialized() or dist.get_rank() == 0


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = dist.get_rank() if dist.is_initialized() else 0
        return True


def _configure_logging(rank: int) -> None:
    root = logging.getLogger("lockstep")
    if getattr(root, "_lockstep_configured", False):
        return
    handler = logging.StreamHandler()
    handler.addFilter(_RankFilter())
    handler.setFormatter(logging.Formatter("[rank%(rank)s] %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    # Rank 0 speaks at INFO; the others only warn, so a log reads as one job, not N copies.
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root.propagate = False
    root._lockstep_configured = True  # type: ignore[attr-defined]


def get_logger(name: str = "lockstep") -> logging.Logger:
    """A logger under ``lockstep`` whose records carry the rank; INFO on rank 0, WARNING elsewhere."""
    _configure_logging(dist.get_rank() if dist.is_initialized() else 0)
    return logging.getLogger(name if name.startswith("lockstep") else f"lockstep.{name}")
