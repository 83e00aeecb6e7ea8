"""Worker output for ``lockstep launch``: rank-prefixed lines, a rank filter, and one report per failure.

torch's elastic agent can write each worker's stdout/stderr to a file and tail it
to the console with a per-rank prefix (``tee``). We keep that, and remember where
each attempt's files went, so that when a worker dies the launcher can print one
block (the rank, its exit code and the last lines of its stderr) after the agent
has stopped every worker: never interleaved with the other ranks' output.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
from collections import deque
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import LogsDest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from lockstep.code_paths import is_library_code
from lockstep.diagnostics.watchdog import HANG_EXIT_CODE
from lockstep.diagnostics.watchdog import LOG_DIR_ENV as REPORT_DIR_ENV

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

    def __init__(self, log_dir: str, log_rank: int | None = None, max_restarts: int = 0, redirects: str = "0",
                 tee: str = "0", local_ranks_filter: frozenset[int] = frozenset()) -> None:
        # Every stream goes to its file (the report reads them); torchrun's -r/-t only choose the console.
        super().__init__(log_dir=log_dir, tee=Std.ALL, local_ranks_filter=set(local_ranks_filter) or None)
        self.log_rank = log_rank
        self.max_restarts = max_restarts
        self.redirects, self.tee = Std.from_str(redirects), Std.from_str(tee)
        self.last_dest: LogsDest | None = None
        self.last_envs: dict[int, dict[str, str]] = {}
        self.restart_count = 0
        self.attempts = 0
        self.last_failure: tuple[int, int] | None = None  # (local rank, exit code) the agent last reported
        # Why the launcher itself stopped this node's workers (a lost node), if it did: set by the agent
        self.stop_reason: Callable[[], str | None] = lambda: None
        # Workers are executables: torch's agent then records every non-zero exit, those it stopped included.
        self.every_exit_recorded = False

    def note_failure(self, exitcode: int, local_rank: int) -> None:
        """The agent's own record of the failure that ends an attempt (see agent._FailureRecorder)."""
        self.last_failure = (local_rank, exitcode)

    def _restart_reason(self) -> str:
        stopped = self.stop_reason()
        if stopped is not None:
            return f"this node stopped them: {stopped}"
        if self.last_failure is None:
            return ""
        local_rank, exitcode = self.last_failure
        env = self.last_envs.get(local_rank, {})
        rank = env.get("RANK", f"local {local_rank}")
        reason = f"worker rank {rank} failed ({describe_exit(exitcode)})"
        if self.last_dest is not None:
            tail = _strip_prefix(_tail(self.last_dest.stderrs.get(local_rank), 40), rank)
            # its exception, else its last words (a script that printed why and called sys.exit)
            error = exception_line(tail, rank) or next(
                (line.strip() for line in reversed(tail) if line.strip() and not _LOG_LINE.match(line)), ""
            )
            if error:
                reason += f": {error}"
        return reason

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        # The agent calls this once per attempt, just before it starts the workers.
        self.attempts += 1
        if envs:
            restart_count = int(next(iter(envs.values())).get("TORCHELASTIC_RESTART_COUNT", "0"))
            if restart_count > self.restart_count:
                notice = f"restarting the workers (restart {restart_count} of {self.max_restarts})"
                reason = self._restart_reason()
                if reason:
                    notice += f" because {reason}"
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
        self.last_dest = dest = super().reify(envs)
        self.last_envs = {lr: dict(env) for lr, env in envs.items()}
        self.last_failure = None
        for lr in envs:
            # torchrun's -r/-t: a redirected stream that is not also teed stays off the console.
            hidden = _std_of(self.redirects, lr) & ~_std_of(self.tee, lr)
            if hidden & Std.OUT:
                dest.tee_stdouts.pop(lr, None)
            if hidden & Std.ERR:
                dest.tee_stderrs.pop(lr, None)
            # Reports (hang, failure) go to this job's own folder, named in the report line: never a shared one.
            stderr = dest.stderrs.get(lr)
            if stderr:
                envs[lr][REPORT_DIR_ENV] = os.path.dirname(os.path.dirname(stderr))
        return dest


def _std_of(spec, local_rank: int) -> Std:
    return spec.get(local_rank, Std.NONE) if isinstance(spec, dict) else spec


class LaunchError(RuntimeError):
    """A worker failed (after any restarts). ``rank``/``exitcode`` name the first failure."""

    def __init__(self, report: str, rank: int, exitcode: int, failures: dict[int, int]) -> None:
        super().__init__(report)
        self.rank = rank
        self.exitcode = exitcode
        self.failures = failures  # global rank -> exit code, every worker that had failed when the agent stopped


# A log record (lockstep's "INFO lockstep.x: ...", c10d's "[W1125 14:08:25.34 socket.cpp:207] ..."), not last words
_LOG_LINE = re.compile(r"\s*(?:\[rank\d+\]:? )?(?:(?:DEBUG|INFO|WARNING) [\w.]+: |\[[DIWE]\d{4} )")


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
    return []  # no error file: torch's message is only its "To enable traceback see: ..." hint


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
    dest = logs.last_dest
    if len(tied) < 2 or dest is None:
        return rank, failure

    def order(item: tuple[int, ProcessFailure]) -> tuple[bool, float]:
        stopped = item[1].exitcode == -signal.SIGTERM
        try:
            return stopped, os.stat(dest.stderrs[item[1].local_rank]).st_mtime_ns
        except (KeyError, OSError, TypeError):
            return stopped, float("inf")  # no log: torch's order decides

    return min(sorted(tied.items()), key=order)


def _strip_prefix(lines: list[str], rank: int | str) -> list[str]:
    # torch's own excepthook prefixes a worker's traceback with "[rankN]: " once the group exists.
    prefix = f"[rank{rank}]: "
    return [line.removeprefix(prefix) for line in lines]


def traceback_block(lines: list[str]) -> list[str]:
    """The last Python traceback in ``lines`` (from its header to the end of the exception), or []."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return []
    block = lines[starts[-1]:]
    for i, line in enumerate(block[1:], 1):
        if line and not line.startswith(" "):  # the exception line; a chained message may follow it
            rest = block[i + 1:]
            end = next((j for j, more in enumerate(rest) if more.startswith("[") or not more.strip()), len(rest))
            return block[:i + 1 + end]
    return block


def exception_line(lines: list[str], rank: int | str) -> str:
    """``ModuleNotFoundError: No module named 'x'``: the exception that ended a rank, from its stderr tail."""
    block = traceback_block(_strip_prefix(lines, rank))
    exc = [line for line in block[1:] if line and not line.startswith(" ")]
    return exc[0].strip() if exc else ""


_FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line \d+')


def _innermost_frame(block: list[str]) -> str:
    """The traceback's innermost frame in the user's code (not torch's, not lockstep's, not an installed
    package's, not the stdlib's), judged by where those really are (lockstep.code_paths), never by a folder's
    name: a user's script in a clone named ``lockstep`` is the user's."""
    frames = [(line.strip(), match["file"]) for line in block if (match := _FRAME.match(line))]
    user = [text for text, filename in frames if not is_library_code(filename)]
    return (user or [text for text, _ in frames] or [""])[-1]


def _error_text(failure: ProcessFailure, stderr_lines: list[str], shown: bool) -> tuple[list[str], bool]:
    """The failed rank's real exception: torch's error file (written by @record and function entry points) when
    there is one, else the traceback in its stderr. Returns (lines, whether the console already showed them)."""
    from_file = _error_file_traceback(failure)
    block = traceback_block(stderr_lines)
    if from_file and any(line.strip() for line in from_file):
        # The console showed it only if the worker also printed it there.
        return from_file, shown and bool(block) and block[-1].strip() in "\n".join(from_file)
    return block, shown and bool(block)


def _clean_exits(error: ChildFailedError, logs: RankLogsSpecs) -> list[tuple[int, float | None]]:
    """Workers of this node that exited 0 while the others ran: the agent records every non-zero exit, including
    those it stopped, so a local rank missing from the failures ended cleanly. (global rank, time of its last
    output) in order of that time."""
    if not getattr(logs, "every_exit_recorded", False):
        return []  # function entry points: torch records only the first failure and terminates the rest
    failed_local = {f.local_rank for f in error.failures.values()}
    found = []
    for lr, env in getattr(logs, "last_envs", {}).items():
        if lr in failed_local or "RANK" not in env:
            continue
        times = []
        for streams in ((logs.last_dest.stdouts, logs.last_dest.stderrs) if logs.last_dest else ()):
            try:
                times.append(os.stat(streams[lr]).st_mtime)
            except (KeyError, OSError, TypeError):
                pass
        found.append((int(env["RANK"]), max(times) if times else None))
    return sorted(found, key=lambda item: (item[1] is None, item[1] or 0.0, item[0]))


def failure_report(
    error: ChildFailedError, logs: RankLogsSpecs, restarts_used: int | None = None, tail_lines: int = 20
) -> LaunchError:
    """Turn the agent's ChildFailedError into one readable block naming the first failed rank.

    The block shows that rank's real exception once: its traceback when the console has not shown it (the
    rank was filtered out, or the traceback went only to torch's error file), else its last line and where."""
    rank, failure = _first_failure(error, logs)
    stderr_path = None
    if logs.last_dest is not None:
        stderr_path = logs.last_dest.stderrs.get(failure.local_rank) or None
    dest = logs.last_dest
    shown = dest is not None and failure.local_rank in getattr(dest, "tee_stderrs", {})
    lines = _strip_prefix(_tail(stderr_path, 400), rank)
    text, on_console = _error_text(failure, lines, shown)
    header = (
        f"lockstep launch: worker rank {rank} (local rank {failure.local_rank} on {socket.gethostname()}, "
        f"pid {failure.pid}) failed: {describe_exit(failure.exitcode)}"
    )
    if restarts_used is not None:
        header += f", after {restarts_used} restart(s)"
    out = [header]
    clean = _clean_exits(error, logs)
    if clean:
        names = ", ".join(f"rank {r}" for r, _ in clean)
        out.append(f"  {names} exited cleanly (exit code 0) while rank {rank} was still running: rank {rank}'s next "
                   f"collective had no peer. Every rank must take part in every collective (a `if rank == 0:` "
                   "around training, or sys.exit(0) on one rank, ends the job this way)")
    own_error = exception_line(lines, rank) or (text and text[-1].strip())
    others = {r: f for r, f in error.failures.items() if r != rank}
    if others:
        described = []
        for r, f in sorted(others.items()):
            what = describe_exit(f.exitcode)
            other_path = dest.stderrs.get(f.local_rank) if dest is not None else None
            theirs = exception_line(_tail(other_path, 200), r) if f.exitcode != -signal.SIGTERM else ""
            if theirs and theirs == own_error:
                what += f", the same {theirs.split(':')[0]}"
            elif theirs:
                what += f": {theirs}"
            described.append(f"rank {r} ({what})")
        out.append("  also failed: " + ", ".join(described))
    if text and on_console:
        out.append(f"  {text[-1].strip()}")
        where = _innermost_frame(text)
        if where:
            out.append(f"    {where}")
        out.append("  (the full traceback is above)")
    elif text:
        out.append(f"  rank {rank}'s error:")
        out += [f"    {line}" for line in text[-tail_lines:]]
    elif any(line.strip() for line in lines[-tail_lines:]):
        tail = lines[-tail_lines:]
        out.append(f"  last {len(tail)} lines of rank {rank}'s stderr:")
        out += [f"    {line}" for line in tail]
    else:
        out.append(f"  rank {rank} wrote nothing to stderr")
    if stderr_path:
        out.append(f"  full logs: {os.path.dirname(os.path.dirname(stderr_path))}")
    codes = {r: f.exitcode for r, f in error.failures.items()}
    return LaunchError("\n".join(out), rank=rank, exitcode=failure.exitcode, failures=codes)
