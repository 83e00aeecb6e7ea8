"""The console of ``lockstep launch``: one rank prefix per line, and a traceback that every rank raised shown once.

torch's agent copies each worker's log files to the launcher's console, one ``write`` per line prefixed with
``[rankN]: ``. Two things made that console noisy: a worker that prefixes its own lines the same way
(torch's excepthook after ``init_process_group``, lockstep's logging ``[rankN] INFO ...``) showed the rank
twice, and an error that every rank raises alike (a non-finite gradient, a shape mismatch) printed the
same 20-line traceback once per rank. While the agent runs, the launcher's ``sys.stdout``/``sys.stderr``
are wrapped: the repeated prefix is dropped, and a rank's traceback is held until its exception line, then
printed, or replaced by one line when another rank already printed the very same traceback, or when it is
the follow-on of another rank's (a collective that lost its peer: gloo's "Connection closed by peer"). After a
Ctrl-C the workers' lines stay off the console (``Console.mute``): every rank's KeyboardInterrupt traceback,
a peer's follow-on gloo error, a watchdog's report on the peer that vanished are the consequences of the stop,
not news, and the launcher says in one line that it stopped them. torch's agent's own lines about stopping
the workers, and its dump of a failure, are filtered from its loggers (``quiet_agent_log``). The log files keep
every worker's bytes unchanged. torch's C++ warnings (c10d's store dumps, its hostname warning: ``native_log``)
stay off the console: a worker's are dropped here (its log file keeps them), the launcher process's own go to
``launcher-HOST-PID.log`` in the log folder, as does torch's warning that a rendezvous keep-alive failed (the
survivors of a lost node 0 go on without it, and say so in one line).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

from lockstep.launch.native_log import NativeRecords, native_records_to
from lockstep.launch.output import RankLogsSpecs, lost_peer

_REPEATED = re.compile(r"^(\[rank(\d+)\]: )\[rank\2\]:? ", re.MULTILINE)
_PREFIXED = re.compile(r"^\[rank(\d+)\]: (.*)$", re.DOTALL)
_TRACEBACK = "Traceback (most recent call last):"
_INTERRUPTED = "KeyboardInterrupt"  # the exception line of a rank stopped by Ctrl-C
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


def single_prefix_text(text: str) -> str:
    """``[rank0]: [rank0]: Traceback`` -> ``[rank0]: Traceback``; ``[rank0]: [rank0] INFO`` -> ``[rank0]: INFO``."""
    return _REPEATED.sub(r"\1", text)


class _Console:
    """Wraps one stream; ``shown`` (traceback text -> first rank that printed it) is shared by stdout and stderr."""

    def __init__(self, stream: Any, shown: dict[tuple[str, ...], str], lock: threading.Lock,
                 muted: threading.Event, native: NativeRecords) -> None:
        self._stream, self._shown, self._lock, self._muted, self._native = stream, shown, lock, muted, native
        self._held: dict[str, list[tuple[str, str]]] = {}  # rank -> (line as written, its text without prefix)
        self._after_follow_on: set[str] = set()  # ranks whose follow-on traceback was said in one line
        # A worker writing unbuffered (PYTHONUNBUFFERED=1, common in containers) puts print()'s text and its newline
        # in two writes; torch's tail can read between them and pass the first piece on alone. Per rank, the line
        # read so far without its end, and which rank's unfinished line the console's last write left open: another
        # rank's line first ends it, so two ranks' lines never share one console line.
        self._pieces: dict[str, str] = {}
        self._open: str | None = None

    def write(self, text: str) -> int:
        text = single_prefix_text(text)
        match = _PREFIXED.match(text)
        if match is None:
            with self._lock:
                self._end_open_line()
                return self._stream.write(text)
        if self._muted.is_set():
            return len(text)  # a worker's line after a Ctrl-C: in its log file only
        rank, body = match.groups()
        with self._lock:
            start = self._pieces.pop(rank, "")
            line = start + body  # the rank's line so far: a piece of an unbuffered print joined to what came before
            if not body.endswith("\n"):
                self._pieces[rank] = line
            if self._native.take(rank, line):
                return len(text)  # a C++ warning record (c10d's): in the rank's log file only
            if rank in self._after_follow_on:
                if not line.strip() or line.startswith(_CHAINED):
                    return len(text)  # the chain's connecting lines after a follow-on said in one line
                self._after_follow_on.discard(rank)
            held = self._held.get(rank)
            if held is None and not (line.startswith(_TRACEBACK) and not start):
                return self._show(rank, text[: len(text) - len(body)], body, start)
            if held is None:
                self._held[rank] = held = []
            if start and held:
                held[-1] = (held[-1][0] + body, line)  # the rest of a held line
            else:
                held.append((text, line))
            if line.endswith("\n") and line.strip() and not line.startswith((" ", _TRACEBACK)):
                del self._held[rank]  # the exception line closes the traceback
                self._stream.write(self._closed(rank, held, line.rstrip()))
            return len(text)

    def _show(self, rank: str, prefix: str, body: str, start: str) -> int:
        """Write a rank's piece of output; a line another rank left unfinished is ended first."""
        if start and self._open == rank:
            text = body  # the rest of this rank's open line: no second prefix
        elif start and body == "\n":
            return 1  # the end of a line that another rank's line has ended already
        else:
            self._end_open_line()
            text = prefix + body
        self._open = None if body.endswith("\n") else rank
        return self._stream.write(text)

    def _end_open_line(self) -> None:
        if self._open is not None:
            self._open = None
            self._stream.write("\n")

    def _closed(self, rank: str, held: list[tuple[str, str]], exception: str) -> str:
        """What the console shows of a rank's whole traceback (its exception line is ``exception``)."""
        if exception == _INTERRUPTED:
            return ""  # Ctrl-C reached this rank before the agent said it got the signal: the launcher says it
        cause = next((r for r in self._shown.values() if r != rank), None)
        lost = lost_peer(exception)
        if lost is not None and cause is not None:
            # another rank's traceback came first: this one's collective failed because that rank had gone
            self._after_follow_on.add(rank)
            return (f"[rank{rank}]: {lost} (a follow-on of rank {cause}'s error above; the traceback is in its "
                    "log file)\n")
        key = tuple(b for _, b in held)
        first = self._shown.setdefault(key, rank)
        if first != rank:
            return f"[rank{rank}]: {exception} (the same traceback as rank {first})\n"
        return "".join(t for t, _ in held)

    def release(self) -> None:
        """Print whatever is still held (a worker killed in the middle of printing its traceback)."""
        with self._lock:
            self._end_open_line()
            if not self._muted.is_set():
                for held in self._held.values():
                    self._stream.write("".join(t for t, _ in held))
            self._held.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class Console:
    """The launcher's console while the agent runs: ``mute()`` keeps the workers' lines off it from then on."""

    def __init__(self) -> None:
        self.muted = threading.Event()

    def mute(self) -> None:
        self.muted.set()


@contextlib.contextmanager
def single_prefix() -> Iterator[Console]:
    saved = sys.stdout, sys.stderr
    shown: dict[tuple[str, ...], str] = {}
    lock = threading.Lock()
    console = Console()
    native = NativeRecords()  # per rank, shared by stdout and stderr as the lock is
    wrapped = tuple(_Console(stream, shown, lock, console.muted, native) for stream in saved)
    sys.stdout, sys.stderr = wrapped
    try:
        yield console
    finally:
        for stream in wrapped:
            stream.release()
        sys.stdout, sys.stderr = saved


class _AgentLogFilter(logging.Filter):
    """Drops the agent's own multi-line dump of a failure (our report says the same once, readably), and hands
    the failure it names (exit code, local rank) to the logs spec, which says why the workers restart. Drops
    torch's unprefixed lines about stopping the workers ("Received 2 death signal", "Sending process N closing
    signal SIGTERM"): the launcher says in its own line why it stopped them. The first of those on a SIGINT
    (Ctrl-C) mutes the workers on the console, before the agent forwards the signal to them."""

    _SHUTDOWN_CHATTER = ("Received %s death signal", "Sending process %s closing signal",
                         "Closing process %s via signal")

    def __init__(self, logs: RankLogsSpecs | None = None, shown: Console | None = None) -> None:
        super().__init__()
        self.logs, self.shown = logs, shown

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith(self._SHUTDOWN_CHATTER):
            args = record.args if isinstance(record.args, tuple) else ()
            if message.startswith("Received") and args and args[0] == signal.SIGINT and self.shown is not None:
                self.shown.mute()
            return False
        if not message.startswith("failed (exitcode"):
            return True
        if self.logs is not None and isinstance(record.args, tuple) and len(record.args) >= 2:
            exitcode, local_rank = record.args[0], record.args[1]  # torch's agent logs both as ints
            if isinstance(exitcode, int) and isinstance(local_rank, int):
                self.logs.note_failure(exitcode, local_rank)
        return False


_AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")
_RENDEZVOUS_LOGGER = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"


class _KeepAliveToFile(logging.Filter):
    """torch's rendezvous warns each time a keep-alive to its store fails (node 0's store, once node 0 is lost):
    to the launcher's file, not the console (in place, the survivors go on without that store)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def filter(self, record: logging.LogRecord) -> bool:
        if "failed to send a keep-alive heartbeat" not in str(record.msg):
            return True
        with contextlib.suppress(OSError), open(self.path, "a") as f:
            f.write(f"{record.levelname} {record.name}: {record.getMessage()}\n")
        return False


def launcher_log_path(log_dir: str) -> str:
    """The launcher process's own file in the log folder (one per launcher, should nodes share the folder)."""
    return os.path.join(log_dir, f"launcher-{socket.gethostname()}-{os.getpid()}.log")


@contextlib.contextmanager
def quiet_agent_log(logs: RankLogsSpecs | None = None, shown: Console | None = None) -> Iterator[None]:
    """torch's agent logs through these loggers while it runs: ``_AgentLogFilter`` keeps its noise off. With
    ``logs``, this process's C++ warnings and torch's failed keep-alives go to ``launcher_log_path`` there."""
    log_filter = _AgentLogFilter(logs, shown)
    filters: list[tuple[logging.Logger, logging.Filter]] = [(logging.getLogger(name), log_filter)
                                                           for name in _AGENT_LOGGERS]
    with contextlib.ExitStack() as stack:
        if logs is not None:
            path = launcher_log_path(logs.root_log_dir)
            stack.enter_context(native_records_to(path))
            filters.append((logging.getLogger(_RENDEZVOUS_LOGGER), _KeepAliveToFile(path)))
        for logger, f in filters:
            logger.addFilter(f)
        try:
            yield
        finally:
            for logger, f in filters:
                logger.removeFilter(f)
