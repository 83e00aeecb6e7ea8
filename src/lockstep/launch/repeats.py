"""A worker failure that repeats identically after a restart ends the restarts, and one line says so.

torch's agent restarts the group up to ``--max-restarts`` times whatever the failure. A deterministic crash (a bug at
one line of the script, a checkpoint it cannot load) fails every attempt the same way, so each restart costs a
start-up and ends where the last one did. The one idea: each failed attempt's failures are signed (the exception line
and the innermost frame of the user's code, from the rank's traceback), and when one signature is also the previous
attempt's the agent's remaining restarts go to 0, as torch's own agent does for a worker wedged in the kernel: it
stops the workers and the launcher reports the failure, under one line naming the repeat. A failure of the group
rather than of the code (a lost peer, gloo's timeout, the store) has no signature, nor has a worker that left no
traceback: a node coming and going repeats those, and a restart is what they need.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from typing import Any

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from lockstep.launch.output import RankLogsSpecs, exception_line, lost_peer, strip_prefix, tail_of, traceback_block
from lockstep.launch.report import error_file_traceback, innermost_frame

# What a collective or the store says when the group failed under it, not the code: gloo's timeouts ("Timed out
# waiting 1800000ms for recv", "Application timeout caused pair closure") and transport errors, torch's Dist*Errors
# (a store that went away), lockstep's PeerLost. A lost peer's words are output.lost_peer's.
_GROUP_FAILURE = re.compile(r"timed out|timeout|gloo/transport|TCPStore|Dist\w*Error|PeerLost", re.IGNORECASE)

Signature = tuple[str, str]  # (exception line, innermost frame of the user's code)


def failure_signature(lines: list[str], rank: int | str) -> Signature | None:
    """``("ValueError: bad shape", 'File "train.py", line 4, in step')`` from a failed rank's traceback (its stderr's
    tail, or torch's error file), or None: no traceback, a KeyboardInterrupt, or a failure of the group."""
    block = traceback_block(strip_prefix(lines, rank))
    exception = exception_line(block, rank)
    if not exception or exception == "KeyboardInterrupt" or lost_peer(exception) or _GROUP_FAILURE.search(exception):
        return None
    return exception, innermost_frame(block)


class RestartGuard:
    """One launch's record of its last failed attempt's signatures; ``line`` says the repeat once one is found."""

    def __init__(self, logs: RankLogsSpecs, max_restarts: int) -> None:
        self.logs, self.max_restarts = logs, max_restarts
        self.previous: dict[Signature, int] = {}  # signature -> the global rank that failed so
        self.line: str | None = None

    def repeated(self, failures: dict[int, ProcessFailure], remaining_restarts: int) -> bool:
        """Whether an attempt that failed with ``failures`` (global rank -> failure) failed as the one before it."""
        signed: dict[Signature, int] = {}
        for rank, failure in sorted(failures.items()):
            signature = failure_signature(self._lines(failure), rank)
            if signature is not None:
                signed.setdefault(signature, rank)
        again = next((s for s in signed if s in self.previous), None)
        self.previous = signed
        if again is None:
            return False
        exception, where = again
        self.line = (f"lockstep launch: rank {signed[again]}'s failure repeated identically after restart "
                     f"{self.logs.restart_count}: {exception}{f' ({where})' if where else ''}; not restarting again "
                     f"({remaining_restarts} of --max-restarts {self.max_restarts} left)")
        return True

    def _lines(self, failure: ProcessFailure) -> list[str]:
        from_file = error_file_traceback(failure)  # a function entry point's traceback is in torch's error file
        if any(line.strip() for line in from_file):
            return from_file
        dest = self.logs.last_dest  # this attempt's files: the failed rank has exited, its stderr is complete
        stderrs = dest.stderrs if dest is not None and isinstance(dest.stderrs, dict) else {}
        return tail_of(stderrs.get(failure.local_rank), 400)


# The guard of each launch running in this process, by the id of its agent's logs spec (the one object the agent and
# the launcher share; torch's logs specs define __eq__, so they are no dict keys); an agent without one restarts as
# torch's does.
_GUARDS: dict[int, RestartGuard] = {}
_INSTALLED: list[Any] = []  # torch's agent class while ours stands in for it
_LOCK = threading.Lock()


def _guarded(agent_class: type[LocalElasticAgent]) -> type[LocalElasticAgent]:
    class GuardedAgent(agent_class):  # type: ignore[valid-type, misc]
        """torch's LocalElasticAgent, whose failed attempt ends the restarts when it repeats the one before."""

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            guard = _GUARDS.get(id(getattr(self, "_logs_specs", None)))
            # _invoke_run restarts while _remaining_restarts > 0 (torch's own check of a wedged worker sets it to 0)
            remaining: int = getattr(self, "_remaining_restarts", 0)
            if guard is not None and result.is_failed() and remaining > 0:
                if guard.repeated(result.failures, remaining):
                    self._remaining_restarts = 0
            return result

    return GuardedAgent


@contextlib.contextmanager
def restarts_end_on_a_repeat(logs: RankLogsSpecs, max_restarts: int) -> Iterator[RestartGuard]:
    """While it is open, the agent of the launch whose logs spec is ``logs`` stops restarting on a repeat.

    torch's ``launch_agent`` builds its agent from the name ``LocalElasticAgent`` in ``torch.distributed.launcher.api``:
    our subclass stands there while any launch of this process runs, and the last to finish puts torch's back."""
    import torch.distributed.launcher.api as api

    guard = RestartGuard(logs, max_restarts)
    with _LOCK:
        if not _INSTALLED:
            _INSTALLED.append(api.LocalElasticAgent)
            api.LocalElasticAgent = _guarded(api.LocalElasticAgent)  # type: ignore[misc]
        _GUARDS[id(logs)] = guard
    try:
        yield guard
    finally:
        with _LOCK:
            _GUARDS.pop(id(logs), None)
            if not _GUARDS and _INSTALLED:
                api.LocalElasticAgent = _INSTALLED.pop()  # type: ignore[misc]
