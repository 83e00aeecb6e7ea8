"""``lockstep env``: what a bug report about a distributed job needs, in one paste.

The versions (lockstep, torch and its CUDA, Python, the OS), which process-group backends this torch
was built with, the GPUs, the network interfaces with their IPv4 addresses (gloo and NCCL pick one of
them, and a wrong pick is the commonest multi-host hang), and the environment variables that steer
torch.distributed, the launchers and lockstep. The same ground as ``accelerate env`` and
``python -m torch.utils.collect_env``, aimed at the distributed part. It starts no process group and
reads no network beyond this host's own interfaces (a UDP ``connect`` to MASTER_ADDR sends nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
from importlib import metadata

# Prefixes and names of the variables that change how a job starts, rendezvous or talks.
ENV_PREFIXES = ("LOCKSTEP_", "TORCH_", "TORCHELASTIC_", "NCCL_", "GLOO_", "OMPI_COMM_WORLD_", "SLURM_")
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PYTHONPATH")
# A value is hidden where the name says it may be a credential (a bug report is pasted in public).
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "KEY", "CREDENTIAL")
RELATED_PACKAGES = ("numpy", "accelerate", "lightning", "pytorch-lightning", "transformers")


def relevant_env(environ: dict[str, str]) -> dict[str, str]:
    """The variables a distributed bug report needs, sorted, with credential-like values hidden."""
    out = {}
    for name in sorted(environ):
        if name in ENV_NAMES or name.startswith(ENV_PREFIXES):
            secret = any(word in name.upper() for word in SECRET_WORDS)
            out[name] = "<hidden>" if secret else environ[name]
    return out


def interfaces() -> dict[str, str | None]:
    """Interface name -> its IPv4 address (None where it has none)."""
    from lockstep.network import _ipv4_of_interface  # the same ioctl gloo's choice is checked with

    return {name: _ipv4_of_interface(name) for _, name in socket.if_nameindex()}


def master_route(environ: dict[str, str]) -> str | None:
    """Which local address and interface reach MASTER_ADDR (what lockstep launch would pick), if it is set."""
    master = environ.get("MASTER_ADDR")
    if not master:
        return None
    from lockstep.network import interface_with_addr, route_source_addr

    try:
        addr = route_source_addr(master)
    except OSError as e:
        return f"{master}: not reachable from here ({e})"
    return f"{master} via {interface_with_addr(addr) or '?'} ({addr})"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def collect(environ: dict[str, str] | None = None) -> dict:
    """Everything ``lockstep env`` prints, as a dict (``--json`` prints it as is)."""
    import torch
    import torch.distributed as dist

    # The package itself (always loaded before any of its modules; no import: diagnostics sit below it).
    lockstep = sys.modules["lockstep"]
    environ = dict(os.environ if environ is None else environ)
    usable_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    info: dict = {
        "lockstep": f"{lockstep.__version__} ({lockstep.__path__[0]})",  # the package folder
        "torch": f"{torch.__version__} ({os.path.dirname(torch.__file__)})",
        "torch CUDA build": torch.version.cuda,
        "Python": f"{platform.python_version()} ({sys.executable})",
        "OS": platform.platform(),
        "CPUs": f"{os.cpu_count()} ({usable_cpus} usable by this process)",
        "host name": socket.gethostname(),
    }
    info["packages"] = {p: v for p in RELATED_PACKAGES if (v := _version(p))}
    backends = {}
    if dist.is_available():
        for name in ("gloo", "nccl", "mpi", "ucc"):
            check = getattr(dist, f"is_{name}_available", None)
            backends[name] = bool(check()) if check else False
    info["backends"] = backends
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            memory_gib = props.total_memory / 2**30
            gpus.append(f"{i}: {props.name}, {memory_gib:.1f} GiB, compute capability {props.major}.{props.minor}")
    info["CUDA available"] = torch.cuda.is_available()
    info["GPUs"] = gpus
    if backends.get("nccl"):
        try:
            info["NCCL"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception as e:  # a build that claims NCCL but cannot load it: that is the bug report
            info["NCCL"] = f"unavailable ({type(e).__name__}: {e})"
    info["network interfaces"] = {k: v or "no IPv4 address" for k, v in interfaces().items()}
    route = master_route(environ)
    if route:
        info["MASTER_ADDR route"] = route
    info["environment"] = relevant_env(environ)
    return info


def format_info(info: dict) -> str:
    """A markdown list, ready to paste into an issue."""
    lines = []
    for key, value in info.items():
        if isinstance(value, dict):
            lines.append(f"- {key}:" + ("" if value else " none"))
            lines += [f"  - {k}: {v}" for k, v in value.items()]
        elif isinstance(value, list):
            lines.append(f"- {key}:" + ("" if value else " none"))
            lines += [f"  - {v}" for v in value]
        else:
            lines.append(f"- {key}: {value}")
    return "\n".join(lines)


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="lockstep env",
        description="print what a bug report needs: versions, backends, GPUs, network interfaces and the relevant "
        "environment variables (starts no process group)",
    )
    p.add_argument("--json", action="store_true", help="print it as JSON")
    args = p.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=1) if args.json else format_info(info))
    return 0
