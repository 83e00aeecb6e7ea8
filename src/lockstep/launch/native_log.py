"""torch's C++ warnings (c10d's) go to the log folder, not the launcher's console.

c10d writes its warnings straight to a process's fd 2, bypassing Python: ``[W1129 02:51:37.25 TCPStore.cpp:125]
[c10d] recvValue failed ... Connection was likely closed`` with a C++ stack (``Exception raised from ...``, one
``frame #N:`` line a frame) whenever a store's peer goes away, which is every lost node, and ``[c10d] The hostname
of the client socket cannot be retrieved. err=-3`` at every connection on a host whose address has no name. The
workers' copies reach the console through the agent's tail of their log files, line by line (``console._Console``
drops them there; the files keep them). The launcher's own copies (its rendezvous and liveness stores) never pass
through Python, so ``native_records_to`` puts a pipe on fd 2 while the agent runs: a thread reads it, writes each
C++ warning record to a file in the log folder, and everything else, unchanged and in order, to the real fd 2.
Why a pipe and a thread rather than the two simpler ways: pointing fd 2 at a file would also take the lines of
every Python logging handler that holds ``sys.stderr`` (torch's, made at ``import torch``, over fd 2), which the
launcher means to show; a filter process would cost an interpreter start a launch, and ``launch_function`` runs in
the caller's process. The cost: every line on fd 2 takes one more hop (a thread's read and write), a partial line
waits up to 0.1 s for its end, and a launcher process that dies hard (an abort, kill -9) loses what was still in
the pipe (its workers' files keep theirs).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import select
import sys
import threading
from collections.abc import Iterator
from typing import IO

# c10's log line (c10/util/Logging.cpp): severity W, month and day, time, source file and line; once a process
# group exists, c10 puts "[rankN]:" before it. Only warnings: an error ([E...]) may be news.
_RECORD = re.compile(r"^(?:\[rank\d+\]:\s?)*\[W(?:\d{4} [\d:.]+ (?:\d+ )?)?[\w./-]+:\d+\] ")
# The C++ stack c10 prints under a warning that carries an exception, ended by one blank line.
_STACK = re.compile(r"^(?:Exception raised from .*\(most recent call first\):|frame #\d+: |<omitting python frames>)")
_PIPE_SIZE_BYTES = 1 << 20  # F_SETPIPE_SZ: a burst of dumps (4 KiB each) never blocks a writer on the thread
_F_SETPIPE_SZ = 1031  # linux/fcntl.h
_IDLE_S = 0.1  # a partial line waits this long for its end before it is passed on as it is


class NativeRecords:
    """Which lines are part of a C++ warning record, per source (a rank, or a process's fd 2).

    A record is its ``[W...]`` line, then any stack lines, then the blank line that ends a stack."""

    def __init__(self) -> None:
        self._state: dict[str, str] = {}  # source -> "record" (its [W...] line seen) or "stack" (a stack line seen)

    def take(self, source: str, line: str) -> bool:
        """True when ``line`` (without its ``[rankN]: `` tee prefix) belongs to a C++ warning record."""
        state = self._state.pop(source, None)
        if state is not None:
            if _STACK.match(line):
                self._state[source] = "stack"
                return True
            if state == "stack" and not line.strip():
                return True  # the blank line that ends the stack
        if _RECORD.match(line):
            self._state[source] = "record"
            return True
        return False


class _Fd2Pump:
    """Reads what this process writes to fd 2 (a pipe): C++ warning records to ``path``, the rest to ``console``."""

    def __init__(self, read_fd: int, console_fd: int, path: str) -> None:
        self.read_fd, self.console_fd, self.path = read_fd, console_fd, path
        self.stop = threading.Event()
        self.records = NativeRecords()
        self._file: IO[bytes] | None = None  # opened at the first record: a run without one leaves no empty file
        self.thread = threading.Thread(target=self._run, name="lockstep-fd2", daemon=True)

    def _run(self) -> None:
        pending = b""
        try:
            while True:
                ready, _, _ = select.select([self.read_fd], [], [], _IDLE_S)
                if ready:
                    chunk = os.read(self.read_fd, 65536)
                    if not chunk:
                        break  # every writer closed fd 2's pipe
                    *lines, pending = (pending + chunk).split(b"\n")
                    for line in lines:
                        self._line(line + b"\n")
                elif pending or self.stop.is_set():
                    if pending:
                        self._line(pending)  # a partial line, idle: pass it on (a prompt, a progress bar)
                        pending = b""
                    if self.stop.is_set():
                        break
            if pending:
                self._line(pending)
        finally:
            for close in (self._close_file, lambda: os.close(self.read_fd), lambda: os.close(self.console_fd)):
                with contextlib.suppress(OSError):
                    close()

    def _line(self, raw: bytes) -> None:
        try:
            native = self.records.take("fd2", raw.decode(errors="replace").rstrip("\n"))
        except Exception:  # never lose a line to a bug here
            native = False
        if native and self._to_file(raw):
            return
        with contextlib.suppress(OSError):  # the console went away (a closed terminal): nothing to tell
            view = memoryview(raw)
            while view:
                view = view[os.write(self.console_fd, view):]

    def _to_file(self, raw: bytes) -> bool:
        try:
            if self._file is None:
                self._file = open(self.path, "ab")
            self._file.write(raw)
            self._file.flush()
            return True
        except OSError:
            return False  # the folder is gone: the console rather than nowhere

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()


@contextlib.contextmanager
def native_records_to(path: str) -> Iterator[None]:
    """In this block, the C++ warning records this process writes to fd 2 go to ``path``; every other byte goes
    on to fd 2 as before. fd 2 is the same file descriptor again afterwards, once what the block wrote is out."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    console_fd = os.dup(2)
    read_fd, write_fd = os.pipe()
    with contextlib.suppress(OSError):
        fcntl.fcntl(write_fd, _F_SETPIPE_SZ, _PIPE_SIZE_BYTES)
    pump = _Fd2Pump(read_fd, console_fd, path)
    pump.thread.start()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(pump.console_fd, 2)  # the pipe's last write end closes: the pump reads to its end and stops
        pump.stop.set()
        pump.thread.join(timeout=5)  # the console blocked for 5 s: go on; the pump closes its descriptors itself
