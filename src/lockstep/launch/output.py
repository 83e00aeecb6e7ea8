"""Worker output for ``lockstep launch``: rank-prefixed lines, a rank filter, and one report per failure.

torch's elastic agent can write each worker's stdout/stderr to a file and tail it
to the console with a per-rank prefix (``tee``). We keep that, and remember where
each attempt's files went, so that when a worker dies the launcher can print one
block (the rank, its exit code and the last lines of its stderr) after the agent
has stopped every worker: never interleaved with the other ranks' output.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections import deque

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import LogsDest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from lockstep.diagnostics.watchdog import HANG_EXIT_CODE

# torch fills ${rank} with the worker's global rank. It is torch's own style: once a worker has a
# process group, torch's excepthook prefixes its traceback lines the same way, so on the console
# those lines carry the prefix twice (the failure report strips one).
RANK_PREFIX_TEMPLATE = "[rank${rank}]: "

# Local rank that no worker has: torch treats an empty filter as "show all", so
# "no worker on this node is the logged rank" needs a non-empty set that matches nothing.
_NO_LOCAL_RANK = -1


class RankLogsSpecs(DefaultLogsSpecs):
    """Tee every worker's stdout and stderr to the console and to files, optionally one global rank only.

    torch's ``local_ranks_filter`` knows only local ranks, fixed before the
    rendezvous; the global rank of each worker is known only once the agent has
    assigned it, which is when ``reify`` receives the workers' environments. So the
    filter is recomputed there, on every attempt.
    """

    def __init__(self, log_dir: str, log_rank: int | None = None, max_restarts: int = 0) -> None:
        super().__init__(log_dir=log_dir, tee=Std.ALL)
        self.log_rank = log_rank
        self.max_restarts = max_restarts
        self.last_dest: LogsDest | None = None
        self.restart_count = 0
        self.attempts = 0

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        # The agent calls this once per attempt, just before it starts the workers.
        self.attempts += 1
        if envs:
            restart_count = int(next(iter(envs.values())).get("TORCHELASTIC_RESTART_COUNT", "0"))
            if restart_count > self.restart_count:
                notice = f"restarting the workers (restart {restart_count} of {self.max_restarts})"
            elif self.attempts > 1:
                # torch counts restarts per agent: a node whose own workers were healthy re-forms the
                # group when another node restarts, without using up one of its restarts.
                notice = "re-forming the group because another node restarted"
            else:
                notice = ""
            if notice:
                print(f"lockstep launch: {notice}", file=sys.stderr, flush=True)
            self.restart_count = restart_count
        if self.log_rank is not None:
            shown = {lr for lr, env in envs.items() if int(env["RANK"]) == self.log_rank}
            self._local_ranks_filter = shown or {_NO_LOCAL_RANK}
        self.last_dest = super().reify(envs)
        return self.last_dest


class LaunchError(RuntimeError):
    """A worker failed (after any restarts). ``rank``/``exitcode`` name the first failure."""

    def __init__(self, report: str, rank: int, exitcode: int, failures: dict[int, int]) -> None:
        super().__init__(report)
        self.rank = rank
        self.exitcode = exitcode
        self.failures = failures  # global rank -> exit code, every worker that had failed when the agent stopped


def _tail(path: str | None, nlines: int) -> list[str]:
    if not path or not os.path.isfile(path):
        return []
    with open(path, errors="replace") as f:
        return [line.rstrip("\n") for line in deque(f, maxlen=nlines)]


def _error_file_traceback(failure: ProcessFailure) -> list[str]:
    """The traceback torch's ``record`` wrote to the error file (function entrypoints), if any."""
    message = failure.message
    if isinstance(message, dict):
        text = message.get("extraInfo", {}).get("py_callstack") or message.get("message", "")
        return str(text).rstrip("\n").splitlines()
    return [str(message)] if message else []


def describe_exit(exitcode: int) -> str:
    if exitcode == HANG_EXIT_CODE:
        return f"exit code {exitcode}: its hang watchdog ended it (the hang report is above and in the log folder)"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name} (exit code {exitcode})"
        except ValueError:
            return f"killed by signal {-exitcode} (exit code {exitcode})"
    return f"exit code {exitcode}"


def _first_failure(error: ChildFailedError, logs: RankLogsSpecs) -> tuple[int, ProcessFailure]:
    """torch's first failure, by its timestamp, which is in whole seconds. Where failures share the second,
    a worker the agent stopped (SIGTERM, sent to the rest once one failed) is not the cause; among the others
    (a rank raises, and its peer's collective fails on the connection it closed) the cause is the one whose
    stderr was last written first: the peer's error is printed after the cause has exited."""
    rank, failure = error.get_first_failure()
    tied = {r: f for r, f in error.failures.items() if f.timestamp == failure.timestamp}
    if len(tied) < 2 or logs.last_dest is None:
        return rank, failure

    def order(item: tuple[int, ProcessFailure]) -> tuple[bool, float]:
        stopped = item[1].exitcode == -signal.SIGTERM
        try:
            return stopped, os.stat(logs.last_dest.stderrs[item[1].local_rank]).st_mtime_ns
        except (KeyError, OSError, TypeError):
            return stopped, float("inf")  # no log: torch's order decides

    return min(sorted(tied.items()), key=order)


def failure_report(
    error: ChildFailedError, logs: RankLogsSpecs, restarts_used: int | None = None, tail_lines: int = 20
) -> LaunchError:
    """Turn the agent's ChildFailedError into one readable block naming the first failed rank."""
    rank, failure = _first_failure(error, logs)
    stderr_path = None
    if logs.last_dest is not None:
        stderr_path = logs.last_dest.stderrs.get(failure.local_rank) or None
    # torch's own excepthook already prefixes a worker's traceback with "[rankN]: " once the group exists.
    own_prefix = f"[rank{rank}]: "
    lines = [line.removeprefix(own_prefix) for line in _tail(stderr_path, tail_lines)]
    if not any(line.strip() for line in lines):
        lines = _error_file_traceback(failure)[-tail_lines:]
    header = (
        f"lockstep launch: worker rank {rank} (local rank {failure.local_rank} on {socket.gethostname()}, "
        f"pid {failure.pid}) failed: {describe_exit(failure.exitcode)}"
    )
    if restarts_used is not None:
        header += f", after {restarts_used} restart(s)"
    out = [header]
    others = {r: f.exitcode for r, f in error.failures.items() if r != rank}
    if others:
        out.append(
            "  also failed: " + ", ".join(f"rank {r} ({describe_exit(code)})" for r, code in sorted(others.items()))
        )
    if lines:
        out.append(f"  last {len(lines)} lines of rank {rank}'s stderr:")
        out += [f"    {line}" for line in lines]
    else:
        out.append(f"  rank {rank} wrote nothing to stderr")
    if stderr_path:
        out.append(f"  full logs: {os.path.dirname(os.path.dirname(stderr_path))}")
    codes = {r: f.exitcode for r, f in error.failures.items()}
    return LaunchError("\n".join(out), rank=rank, exitcode=failure.exitcode, failures=codes)
