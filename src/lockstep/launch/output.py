"""Worker output for ``lockstep launch``: rank-prefixed lines, a rank filter, and what a rank's stderr says.

torch's elastic agent can write each worker's stdout/stderr to a file and tail it
to the console with a per-rank prefix (``tee``). We keep that, and remember where
each attempt's files went, so that when a worker dies the launcher can print one
block (the rank, its exit code and the last lines of its stderr: ``launch/report.py``)
after the agent has stopped every worker: never interleaved with the other ranks' output.
The helpers at the end read a rank's stderr: its exception, its own last words, a lost peer.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections import deque
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import LogsDest

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
            tail = strip_prefix(tail_of(self.last_dest.stderrs.get(local_rank), 40), rank)
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

# gloo's (and the OS's) words for a peer that went away in the middle of a collective: the error of a rank whose
# peer failed first, a follow-on rather than a cause (gloo adds "This is typically caused by a remote worker
# crashing. Check the logs of the remote worker ... GLHF!")
_LOST_PEER = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe")


def lost_peer(exception: str) -> str | None:
    """``RuntimeError: Connection closed by peer`` for an exception line that says a collective lost its peer
    (gloo's ``[.../pair.cc:553] Connection closed by peer [127.0.0.1]:5790. This is ... GLHF!``), else None."""
    match = _LOST_PEER.search(exception)
    if match is None:
        return None
    name = exception.split(":", 1)[0].strip() if ":" in exception else ""
    return f"{name}: {match.group(0)}" if name and " " not in name else match.group(0)


def last_words(lines: list[str]) -> list[str]:
    """What a rank printed itself (a script's own "cannot go on" line), log records left out."""
    return [line for line in lines if line.strip() and not _LOG_LINE.match(line)]


def tail_of(path: str | None, nlines: int) -> list[str]:
    if not path or not os.path.isfile(path):
        return []
    with open(path, errors="replace") as f:
        return [line.rstrip("\n") for line in deque(f, maxlen=nlines)]


def describe_exit(exitcode: int) -> str:
    if exitcode == HANG_EXIT_CODE:
        return f"exit code {exitcode}: its hang watchdog ended it (the hang report is above and in the log folder)"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name} (exit code {exitcode})"
        except ValueError:
            return f"killed by signal {-exitcode} (exit code {exitcode})"
    return f"exit code {exitcode}"


def strip_prefix(lines: list[str], rank: int | str) -> list[str]:
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
    block = traceback_block(strip_prefix(lines, rank))
    exc = [line for line in block[1:] if line and not line.startswith(" ")]
    return exc[0].strip() if exc else ""
