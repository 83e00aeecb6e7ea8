"""The console of ``lockstep launch``: one rank prefix per line, and a traceback that every rank raised shown once.

torch's agent copies each worker's log files to the launcher's console, one ``write`` per line prefixed with
``[rankN]: ``. Two things made that console noisy: a worker that prefixes its own lines the same way
(torch's excepthook after ``init_process_group``, lockstep's logging ``[rankN] INFO ...``) showed the rank
twice, and an error that every rank raises alike (a non-finite gradient, a shape mismatch) printed the
same 20-line traceback once per rank. While the agent runs, the launcher's ``sys.stdout``/``sys.stderr``
are wrapped: the repeated prefix is dropped, and a rank's traceback is held until its exception line, then
printed, or replaced by one line when another rank already printed the very same traceback. The log
files keep every worker's bytes unchanged.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

_REPEATED = re.compile(r"^(\[rank(\d+)\]: )\[rank\2\]:? ", re.MULTILINE)
_PREFIXED = re.compile(r"^\[rank(\d+)\]: (.*)$", re.DOTALL)
_TRACEBACK = "Traceback (most recent call last):"


def single_prefix_text(text: str) -> str:
    """``[rank0]: [rank0]: Traceback`` -> ``[rank0]: Traceback``; ``[rank0]: [rank0] INFO`` -> ``[rank0]: INFO``."""
    return _REPEATED.sub(r"\1", text)


class _Console:
    """Wraps one stream; ``shown`` (traceback text -> first rank that printed it) is shared by stdout and stderr."""

    def __init__(self, stream: Any, shown: dict[tuple[str, ...], str], lock: threading.Lock) -> None:
        self._stream, self._shown, self._lock = stream, shown, lock
        self._held: dict[str, list[tuple[str, str]]] = {}  # rank -> (line as written, its text without prefix)

    def write(self, text: str) -> int:
        text = single_prefix_text(text)
        match = _PREFIXED.match(text)
        if match is None:
            return self._stream.write(text)
        rank, body = match.groups()
        with self._lock:
            held = self._held.get(rank)
            if held is None:
                if not body.startswith(_TRACEBACK):
                    return self._stream.write(text)
                self._held[rank] = [(text, body)]
                return len(text)
            held.append((text, body))
            if body.strip() and not body.startswith((" ", _TRACEBACK)):  # the exception line closes the traceback
                del self._held[rank]
                key = tuple(b for _, b in held)
                first = self._shown.setdefault(key, rank)
                if first != rank:
                    return self._stream.write(f"[rank{rank}]: {body.rstrip()} (the same traceback as rank {first})\n")
                self._stream.write("".join(t for t, _ in held))
            return len(text)

    def release(self) -> None:
        """Print whatever is still held (a worker killed in the middle of printing its traceback)."""
        with self._lock:
            for held in self._held.values():
                self._stream.write("".join(t for t, _ in held))
            self._held.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def single_prefix() -> Iterator[None]:
    saved = sys.stdout, sys.stderr
    shown: dict[tuple[str, ...], str] = {}
    lock = threading.Lock()
    wrapped = _Console(saved[0], shown, lock), _Console(saved[1], shown, lock)
    sys.stdout, sys.stderr = wrapped
    try:
        yield
    finally:
        for console in wrapped:
            console.release()
        sys.stdout, sys.stderr = saved
