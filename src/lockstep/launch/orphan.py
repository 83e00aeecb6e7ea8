"""Workers die with their launcher: a parent-death signal set in each worker before its program starts.

torch's agent starts each worker in a session of its own and never tells it when the agent itself dies,
so after a ``kill -9`` of ``lockstep launch`` (or of torchrun) the workers are reparented to init and
train on. Linux can send a process a signal when its parent dies (``prctl(PR_SET_PDEATHSIG)``), and the
setting survives ``exec``: so every worker starts as a three-line Python guard that sets it and then
``exec``s the real command line. Cost: one extra interpreter start without ``site`` (tens of ms) per worker
start; the worker's command line, pid and environment are the ones torch would have given it.

SIGTERM, not SIGKILL: a plain script dies at once, and a Trainer takes it as a preemption (finish the
step, write a checkpoint, exit), bounded by its own step. The guard also checks that the launcher had not
already died before the signal was set (its parent is then init).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

# argv: launcher pid, the command, its arguments. PR_SET_PDEATHSIG is 1 (linux/prctl.h).
_GUARD = """\
import ctypes, os, signal, sys
launcher = int(sys.argv[1])
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0) == 0 and os.getppid() != launcher:
    sys.stderr.write(f"lockstep launch: the launcher (pid {launcher}) exited before this worker started\\n")
    os._exit(1)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as e:
    sys.stderr.write(f"lockstep launch: cannot run {sys.argv[2]!r}: {e.strerror}\\n")
    os._exit(127)
"""


def guarded_command(executable: str, args: Sequence[Any]) -> tuple[str, tuple[Any, ...]]:
    """The command torch's agent should start instead of ``executable args``: the same, behind the guard.

    Only on Linux (prctl); elsewhere the command is returned unchanged."""
    if not sys.platform.startswith("linux"):
        return executable, tuple(args)
    return sys.executable, ("-S", "-c", _GUARD, str(os.getpid()), executable, *args)
