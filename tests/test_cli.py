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


LAUNCH_SCRIPT = str(Path(__file__).resolve().parent / "launch_scripts" / "allreduce.py")


def _in_process(capsys, *argv: str) -> tuple[int, str, str]:
    """``lockstep ARGV`` through the dispatcher, in this process: (exit code, stdout, stderr). Cheap: no worker
    starts, and torch is imported once for all the cases."""
    from lockstep import cli

    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # a subcommand's argparse exits itself (--help, a bad argument)
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_a_bad_argument_is_one_line_naming_it_without_the_usage_block(capsys):
    # (argv, the whole of stderr); the docs promise one line: it came after argparse's usage (23 lines for launch)
    cases = [
        (["launch", "--nnodes", "3:2", LAUNCH_SCRIPT],
         "lockstep launch: error: argument --nnodes: '3:2': MIN 3 is larger than MAX 2\n"),
        (["launch", "--nproc-per-node", "many", LAUNCH_SCRIPT], "lockstep launch: error: argument --nproc-per-node/"
         "--nproc_per_node: --nproc-per-node must be an integer, auto, cpu, gpu or xpu, got 'many'\n"),
        (["launch", "--max-restarts", "x", LAUNCH_SCRIPT],
         "lockstep launch: error: argument --max-restarts/--max_restarts: invalid int value: 'x'\n"),
        (["launch", "--start-method", "thread", LAUNCH_SCRIPT], "lockstep launch: error: argument --start-method/"
         "--start_method: invalid choice: 'thread' (choose from spawn, fork, forkserver)\n"),
        (["launch", "--nnodes", "3:2"], "lockstep launch: error: argument --nnodes: '3:2': MIN 3 is larger than MAX 2\n"),
        (["launch", "--colour", "red", LAUNCH_SCRIPT],
         "lockstep launch: error: unrecognized arguments: --colour\n  see lockstep launch --help\n"),
        (["demo", "--epochs", "0"], "lockstep demo: error: --epochs must be >= 1, got 0\n"),
        (["plan", "--params", "lots"], "lockstep plan: error: argument --params: invalid float value: 'lots'\n"),
        (["slurm-script", "--nodes", "two", "train.py"],
         "lockstep slurm-script: error: argument --nodes: invalid int value: 'two'\n"),
        (["env", "--yaml"], "lockstep env: error: unrecognized arguments: --yaml\n  see lockstep env --help\n"),
        (["nope"], "lockstep: error: unknown command 'nope' (commands: launch, slurm-script, demo, bench, plan, env)\n"),
    ]
    for argv, expected in cases:
        code, out, err = _in_process(capsys, *argv)
        if "invalid choice" in expected and "'spawn'" in err:  # Python < 3.12 quotes the choices
            expected = expected.replace("spawn, fork, forkserver", "'spawn', 'fork', 'forkserver'")
        assert (code, out, err) == (2, "", expected), argv


def test_no_help_shows_markdown_backticks(capsys):
    # `lockstep demo --help` showed ``lockstep demo``: the docstring's markup, not text for a terminal
    commands = [[], *([name] for name in ("launch", "slurm-script", "demo", "bench", "plan", "env")),
                ["bench", "allreduce"], ["bench", "scaling"]]
    for command in commands:
        code, out, err = _in_process(capsys, *command, "--help")
        assert code == 0 and err == "" and "usage:" in out, command
        assert "`" not in out, f"lockstep {' '.join(command)} --help: {[l for l in out.splitlines() if '`' in l]}"
