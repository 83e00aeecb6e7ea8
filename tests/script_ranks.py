"""Run a worker script's ranks forked from dist_utils' forkserver, for the reference runs a test compares against.

A reference run (the uninterrupted job a killed one must equal, the run without alarms) is about what the script
computes, not about a fresh interpreter or a launcher: forked, a rank skips importing torch again (~1.3 CPU-s of
the ~3 each fresh rank costs). The runs under test stay fresh processes started as their tests say (a launcher,
or ``python script`` with the launcher's variables), so that their exit codes are real processes', with one
exception: ``ForkedScript``, for runs whose test is about what the script prints and the code it exits with from
its own threads (the hang reports: the watchdog ends the process with ``os._exit``), not about an interpreter's
shutdown, which a forked process does not go through (its atexit functions run, then ``os._exit``).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import runpy
import sys

from dist_utils import START_METHOD, run_ranks


def _run_script(rank: int, world_size: int, script: str, argv: list[str], log: str, drop: tuple[str, ...],
                nproc_per_node: int | None = None) -> None:
    # As `python script argv...` runs it: its own argv, its folder first on sys.path, run as __main__; its
    # output to a file per rank (a forked rank writes to wherever the forkserver's stdout went)
    for name in drop:  # a forked rank starts from the caller's environment (run_ranks)
        os.environ.pop(name, None)
    if nproc_per_node:  # lockstep launch's node variables: GROUP_RANK and LOCAL_WORLD_SIZE decide the hierarchy
        os.environ.update(LOCAL_RANK=str(rank % nproc_per_node), LOCAL_WORLD_SIZE=str(nproc_per_node),
                          GROUP_RANK=str(rank // nproc_per_node), GROUP_WORLD_SIZE=str(world_size // nproc_per_node))
    with open(log.format(rank=rank), "a") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def run_script(script: str, world_size: int, *argv: str, log_dir: str, env: dict | None = None,
               drop: tuple[str, ...] = (), timeout_s: float = 240.0, nproc_per_node: int | None = None) -> dict:
    """``python script argv...`` on ``world_size`` forked ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT set, no
    process group made for it; ``env`` added to the caller's environment, the names in ``drop`` taken out).
    ``nproc_per_node``: the ranks laid out as nodes of that many, with the variables lockstep launch sets
    (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE), so that 2 x 2 sums hierarchically as launched.
    Returns {"rc": 0, or 1 when a rank failed, "err": the failing ranks' tracebacks and every rank's output};
    each rank's output is in ``log_dir``/SCRIPT-rank{rank}.log."""
    log = os.path.join(log_dir, f"{os.path.basename(script)}-rank{{rank}}.log")
    try:
        run_ranks(_run_script, world_size, args=(script, list(argv), log, tuple(drop), nproc_per_node),
                  init=False, env=env, timeout_s=timeout_s)
        return {"rc": 0, "err": ""}
    except (AssertionError, TimeoutError) as e:
        outputs = []
        for rank in range(world_size):
            try:
                with open(log.format(rank=rank)) as f:
                    outputs.append(f"--- rank {rank}'s output\n{f.read()[-3000:]}")
            except OSError:
                pass
        return {"rc": 1, "err": f"{e}\n" + "\n".join(outputs)}


def _exec_script(script: str, argv: list[str], env: dict[str, str], out_path: str, cwd: str) -> None:
    """A forked process's ``python script argv...``: the environment and folder given, stdout and stderr to
    ``out_path``, the script as __main__; its exit code as the interpreter's would be (1 for an exception)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        # as the interpreter does for an uncaught exception: sys.last_* (what lockstep's exit report reads), then
        # the hook
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        atexit._run_exitfuncs()  # what the interpreter's exit would run (lockstep's shutdown hooks)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class ForkedScript:
    """``python script argv...`` in a process forked from the forkserver (~0.3 CPU-s instead of ~3), with the
    part of ``subprocess.Popen`` the tests use: ``pid``, ``poll()``, ``wait()``, ``returncode`` (negative: the
    signal), ``kill()``, ``send_signal()``."""

    def __init__(self, script: str, argv: list[str], env: dict[str, str], out_path: str, cwd: str):
        self._proc = mp.get_context(START_METHOD).Process(
            target=_exec_script, args=(str(script), [str(a) for a in argv], dict(env), str(out_path), str(cwd)))
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        self._proc.join(timeout)
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)
