"""The report ``lockstep launch`` prints once a worker has failed: which rank, why, where, and what became of the rest.

torch's agent hands over a ChildFailedError: every failed worker's exit code and a timestamp in whole
seconds. The one idea here is choosing the rank to name: not simply torch's first, but the cause. A worker
the agent stopped (SIGTERM), one whose collective lost its peer (gloo's "Connection closed by peer"), and one
that said nothing where another said why are consequences; the report names the cause, shows its error once
(its traceback, or the line of the user's code it came from when the console already showed it), and says of
the others whether they failed too or were stopped. A job stopped by a signal (Ctrl-C) is no failure:
``WorkersStopped`` says so in one line.
"""

from __future__ import annotations

import os
import re
import signal
import socket

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from lockstep.code_paths import is_library_code
from lockstep.launch.output import (
    LaunchError,
    RankLogsSpecs,
    describe_exit,
    exception_line,
    last_words,
    lost_peer,
    strip_prefix,
    tail_of,
    traceback_block,
)
from lockstep.slurm import CHECKPOINT_NOTE

_CHECKPOINT_NAME = re.compile(r"ckpt-\d+\.pt")  # train/checkpoint_files.py's names (its part files do not match)


def error_file_traceback(failure: ProcessFailure) -> list[str]:
    """The traceback torch's ``record`` wrote to the error file (function entrypoints), if any."""
    message = failure.message
    if isinstance(message, dict):
        text = message.get("extraInfo", {}).get("py_callstack") or message.get("message", "")
        return str(text).rstrip("\n").splitlines()
    return []  # no error file: torch's message is only its "To enable traceback see: ..." hint


def _first_failure(error: ChildFailedError, logs: RankLogsSpecs) -> tuple[int, ProcessFailure]:
    """torch's first failure, by its timestamp, which is in whole seconds. Where failures share the second,
    a worker the agent stopped (SIGTERM, sent to the rest once one failed) is not the cause, nor one whose
    collective lost its peer (gloo's "Connection closed by peer"), nor one that said nothing where another said
    why (every rank exits 2, rank 0 alone prints the reason); among the rest (a rank raises, and its peer's
    collective fails on the connection it closed) the cause is the one whose stderr was last written first: the
    peer's error is printed after the cause has exited."""
    rank, failure = error.get_first_failure()
    tied = {r: f for r, f in error.failures.items() if f.timestamp == failure.timestamp}
    dest = logs.last_dest
    if len(tied) < 2 or dest is None:
        return rank, failure

    def order(item: tuple[int, ProcessFailure]) -> tuple[bool, bool, bool, float]:
        r, failure = item
        stopped = failure.exitcode == -signal.SIGTERM
        path = dest.stderrs.get(failure.local_rank) if isinstance(dest.stderrs, dict) else None
        tail = strip_prefix(tail_of(path, 200), r)
        follow_on = lost_peer(exception_line(tail, r)) is not None
        silent = not last_words(tail)
        try:
            return stopped, follow_on, silent, os.stat(dest.stderrs[failure.local_rank]).st_mtime_ns
        except (KeyError, OSError, TypeError):
            return stopped, follow_on, silent, float("inf")  # no log: torch's order decides

    return min(sorted(tied.items()), key=order)


_FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line \d+')


def innermost_frame(block: list[str]) -> str:
    """The traceback's innermost frame in the user's code (not torch's, not lockstep's, not an installed
    package's, not the stdlib's), judged by where those really are (lockstep.code_paths), never by a folder's
    name: a user's script in a clone named ``lockstep`` is the user's."""
    frames = [(line.strip(), match["file"]) for line in block if (match := _FRAME.match(line))]
    user = [text for text, filename in frames if not is_library_code(filename)]
    return (user or [text for text, _ in frames] or [""])[-1]


def _error_text(failure: ProcessFailure, stderr_lines: list[str], shown: bool) -> tuple[list[str], bool]:
    """The failed rank's real exception: torch's error file (written by @record and function entry points) when
    there is one, else the traceback in its stderr. Returns (lines, whether the console already showed them)."""
    from_file = error_file_traceback(failure)
    block = traceback_block(stderr_lines)
    # the console keeps a KeyboardInterrupt's traceback off (launch/console.py): the report shows it itself
    shown = shown and bool(block) and block[-1].strip() != "KeyboardInterrupt"
    if from_file and any(line.strip() for line in from_file):
        # The console showed it only if the worker also printed it there.
        return from_file, shown and block[-1].strip() in "\n".join(from_file)
    return block, shown


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


def _other_failures(error: ChildFailedError, logs: RankLogsSpecs, rank: int, own_error: str, first: int) -> list[str]:
    """The report's lines on the other ranks (but ``first``, the first to fail, said already): those that failed
    too (their exception, a lost peer said briefly), and those the agent stopped (SIGTERM) because ``first``
    failed."""
    dest = logs.last_dest
    described, stopped = [], []
    for r, f in sorted(error.failures.items()):
        if r in (rank, first):
            continue
        if f.exitcode == -signal.SIGTERM:
            stopped.append(f"rank {r}")
            continue
        what = describe_exit(f.exitcode)
        other_path = dest.stderrs.get(f.local_rank) if dest is not None else None
        theirs = exception_line(tail_of(other_path, 200), r)
        if theirs and theirs == own_error:
            what += f", the same {theirs.split(':')[0]}"
        elif theirs and lost_peer(theirs):
            what += f": its collective lost rank {rank} ({lost_peer(theirs)})"
        elif theirs:
            what += f": {theirs}"
        described.append(f"rank {r} ({what})")
    out = ["  also failed: " + ", ".join(described)] if described else []
    if stopped:
        out.append(f"  stopped by the launcher (SIGTERM) once rank {first} had failed: {', '.join(stopped)}")
    return out


# How long before the silent rank's exit the stopped rank's last words may be and still be why: the exit of a rank
# that printed its reason and the silent one's are moments apart, but on a loaded machine the silent rank's
# interpreter took 2-3 s to exit after the words (2 s was the window, and the report named the silent rank).
SAID_WHY_WINDOW_S = 10.0


def _stderr_of(logs: RankLogsSpecs, rank: int, failure: ProcessFailure) -> tuple[str | None, list[str]]:
    """The path of a rank's stderr file and its last 400 lines, its own "[rankN]: " prefix taken off."""
    path = logs.last_dest.stderrs.get(failure.local_rank) or None if logs.last_dest is not None else None
    return path, strip_prefix(tail_of(path, 400), rank)


def _said_why(error: ChildFailedError, logs: RankLogsSpecs, rank: int,
              failure: ProcessFailure) -> tuple[int, ProcessFailure] | None:
    """The rank that said why the job stops, where ``rank`` exited first with a code of its own and said nothing:
    every rank of examples/wine.py exits 2 on another run's --out, rank 0 alone prints why, and the launcher
    may stop rank 0 (SIGTERM) as it exits. That rank exited alike, or was stopped within ``SAID_WHY_WINDOW_S`` of
    its words."""
    if failure.exitcode <= 0 or error_file_traceback(failure) or last_words(_stderr_of(logs, rank, failure)[1]):
        return None
    for r, f in sorted(error.failures.items(), key=lambda item: (item[1].timestamp, item[0])):
        path, lines = _stderr_of(logs, r, f)
        words = last_words(lines)
        if r == rank or not words or lost_peer(exception_line(lines, r) or words[-1]) is not None:
            continue
        try:
            recent = os.stat(path).st_mtime >= failure.timestamp - SAID_WHY_WINDOW_S if path else False
        except OSError:
            recent = False
        if f.exitcode == failure.exitcode or (f.exitcode == -signal.SIGTERM and recent):
            return r, f
    return None


def failure_report(
    error: ChildFailedError, logs: RankLogsSpecs, restarts_used: int | None = None, tail_lines: int = 20
) -> LaunchError:
    """Turn the agent's ChildFailedError into one readable block naming the first failed rank (or, where that
    rank said nothing, the rank that said why).

    The block shows that rank's real exception once: its traceback when the console has not shown it (the
    rank was filtered out, or the traceback went only to torch's error file), else its last line and where."""
    first, first_failure = _first_failure(error, logs)
    rank, failure = _said_why(error, logs, first, first_failure) or (first, first_failure)
    stderr_path, lines = _stderr_of(logs, rank, failure)
    dest = logs.last_dest
    shown = dest is not None and failure.local_rank in getattr(dest, "tee_stderrs", {})
    text, on_console = _error_text(failure, lines, shown)
    header = f"lockstep launch: worker rank {rank} (local rank {failure.local_rank} on {socket.gethostname()}, " \
             f"pid {failure.pid}) failed"
    header += f": {describe_exit(failure.exitcode)}" if rank == first else ""
    if restarts_used is not None:
        header += f", after {restarts_used} restart(s)"
    out = [header]
    if rank != first:
        stopped = ", then the launcher stopped it (SIGTERM)" if failure.exitcode == -signal.SIGTERM else ""
        out.append(f"  rank {rank} said why{stopped}; rank {first} exited first "
                   f"({describe_exit(first_failure.exitcode)}) and wrote nothing to stderr")
    clean = _clean_exits(error, logs)
    if clean:
        names = ", ".join(f"rank {r}" for r, _ in clean)
        out.append(f"  {names} exited cleanly (exit code 0) while rank {rank} was still running: rank {rank}'s next "
                   f"collective had no peer. Every rank must take part in every collective (a `if rank == 0:` "
                   "around training, or sys.exit(0) on one rank, ends the job this way)")
    own_error = exception_line(lines, rank) or (text[-1].strip() if text else "")
    out += _other_failures(error, logs, rank, own_error, first)
    out += _error_lines(rank, text, on_console, lines, tail_lines)
    if stderr_path:
        out.append(f"  full logs: {os.path.dirname(os.path.dirname(stderr_path))}")
    codes = {r: f.exitcode for r, f in error.failures.items()}
    # the exit code is the first failure's own: a rank that said why may have been stopped (SIGTERM) meanwhile
    return LaunchError("\n".join(out), rank=rank, exitcode=first_failure.exitcode, failures=codes)


def _error_lines(rank: int, text: list[str], on_console: bool, lines: list[str], tail_lines: int) -> list[str]:
    """The report's lines on the rank's own error: where the console showed it, or all of it."""
    out = []
    if text and on_console:
        out.append(f"  {text[-1].strip()}")
        where = innermost_frame(text)
        if where:
            out.append(f"    {where}")
        out.append("  (the full traceback is above)")
    elif text:
        out.append(f"  rank {rank}'s error:")
        out += [f"    {line}" for line in text[-tail_lines:]]
    elif last_words(lines):  # no traceback: what the rank said itself (a script that printed why and exited)
        out.append(f"  rank {rank}'s last words on stderr:")
        out += [f"    {line}" for line in last_words(lines)[-tail_lines:]]
    elif any(line.strip() for line in lines[-tail_lines:]):
        tail = lines[-tail_lines:]
        out.append(f"  last {len(tail)} lines of rank {rank}'s stderr:")
        out += [f"    {line}" for line in tail]
    else:
        out.append(f"  rank {rank} wrote nothing to stderr")
    return out


class WorkersStopped(SignalException):
    """The launcher got a signal (Ctrl-C's SIGINT, a SIGTERM) and the agent stopped the workers here.

    ``checkpoint``: the newest checkpoint a Trainer on this node wrote (None: none, or not a Trainer)."""

    def __init__(self, sigval: signal.Signals, workers: int, checkpoint: str | None) -> None:
        super().__init__(f"stopped by {sigval.name}", sigval)
        self.workers, self.checkpoint = workers, checkpoint

    def line(self) -> str:
        how = "Ctrl-C (SIGINT)" if self.sigval == signal.SIGINT else self.sigval.name
        text = f"lockstep launch: stopped by {how}; {self.workers} worker{'s' if self.workers != 1 else ''} stopped"
        if self.checkpoint:
            text += f"; the last checkpoint {self.checkpoint} is intact (resume=True continues from it)"
        return text


def checkpoint_noted(folder: str) -> str | None:
    """The checkpoint a Trainer here last wrote (train/checkpoint.py notes it), if it is still there, or a newer
    committed one beside it: a worker stopped between its save and its note leaves the note one save behind."""
    try:
        with open(os.path.join(folder, CHECKPOINT_NOTE)) as f:
            path = f.read().strip()
    except OSError:
        return None
    return _newest_committed_beside(path) if path and os.path.isfile(path) else None


def _newest_committed_beside(path: str) -> str:
    """The newest ``ckpt-<step>.pt`` in ``path``'s folder whose ``.meta.json`` (the commit record, written last:
    train/checkpoint_files.py) exists, ``path`` if none is newer. One listing of the folder."""
    folder, best = os.path.dirname(path), os.path.basename(path)
    names = set(os.listdir(folder))
    for name in names:
        if _CHECKPOINT_NAME.fullmatch(name) and name > best and name.removesuffix(".pt") + ".meta.json" in names:
            best = name  # zero-padded steps: names sort as steps
    return os.path.join(folder, best)
