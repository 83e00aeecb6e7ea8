"""The ``lockstep`` command's edges, as argparse and torchrun behave: help, version, a missing or unknown
command, output into a closed pipe (``lockstep --help | head``), and ``lockstep env``. Subprocesses, each
a few seconds at most (``env`` imports torch once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parent.parent / "src")


def _lockstep(*args: str, stdout=subprocess.PIPE, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    return subprocess.run([sys.executable, "-m", "lockstep", *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, env=environ, timeout=120)


def test_bare_command_prints_usage_to_stderr_and_exits_2():
    r = _lockstep()
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("usage: lockstep") and r.stderr.rstrip().endswith("lockstep: error: a command is required")
    r = _lockstep("nope")
    assert r.returncode == 2 and "unknown command 'nope'" in r.stderr.splitlines()[-1]


def test_help_lists_version_and_env_and_exits_0():
    r = _lockstep("--help")
    assert r.returncode == 0 and r.stderr == ""
    assert "--version" in r.stdout and "\n  env " in r.stdout and "\n  plan " in r.stdout
    v = _lockstep("--version")
    assert v.returncode == 0 and v.stdout.startswith("lockstep 0.")


def test_output_into_a_closed_pipe_ends_quietly():
    # `lockstep --help | head -1`: the reader is gone before we write. Closing the read end first makes
    # the write fail every time (with `head` it depends on who is scheduled first).
    for args in (["--help"], ["plan", "--params", "7e9"]):
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            r = _lockstep(*args, stdout=write_end)
        finally:
            os.close(write_end)
        assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr
        assert r.returncode == 1  # Python's own code for EPIPE (docs: signal, "Note on SIGPIPE")


def test_env_reports_versions_backends_interfaces_and_variables():
    extra = {"MASTER_ADDR": "127.0.0.1", "NCCL_DEBUG": "INFO", "LOCKSTEP_TRACE": "runs/t", "GLOO_SOCKET_IFNAME": "lo",
             "TORCH_SOME_API_TOKEN": "s3cret", "UNRELATED_VAR": "x"}
    r = _lockstep("env", "--json", env=extra)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    import torch

    import lockstep

    assert info["lockstep"].startswith(lockstep.__version__) and info["torch"].startswith(torch.__version__)
    assert info["Python"].startswith(sys.version.split()[0]) and info["OS"]
    assert info["backends"]["gloo"] is True and set(info["backends"]) >= {"gloo", "nccl", "mpi"}
    assert info["CUDA available"] == torch.cuda.is_available() and len(info["GPUs"]) == torch.cuda.device_count()
    assert info["network interfaces"]["lo"] == "127.0.0.1"
    assert info["MASTER_ADDR route"] == "127.0.0.1 via lo (127.0.0.1)"
    env = info["environment"]
    assert env["NCCL_DEBUG"] == "INFO" and env["LOCKSTEP_TRACE"] == "runs/t" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["TORCH_SOME_API_TOKEN"] == "<hidden>" and "UNRELATED_VAR" not in env
    text = _lockstep("env", env=extra)
    assert text.returncode == 0 and "- backends:\n  - gloo: True" in text.stdout and "  - NCCL_DEBUG: INFO" in text.stdout
