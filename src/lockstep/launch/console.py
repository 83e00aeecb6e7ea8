"""One rank prefix per console line.

torch's agent prefixes every line it copies from a worker's log file with ``[rankN]: ``; a worker that
prefixes its own lines the same way (torch's excepthook after ``init_process_group``, lockstep's logging
``[rankN] INFO ...``) would show the rank twice. The agent writes each line with one ``write`` on the
launcher's ``sys.stdout``/``sys.stderr``, so while the agent runs those two streams are wrapped and a line
whose own prefix repeats the agent's loses the repeat. The log files keep the worker's bytes unchanged.
"""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Any, Iterator

_REPEATED = re.compile(r"^(\[rank(\d+)\]: )\[rank\2\]:? ", re.MULTILINE)


def single_prefix_text(text: str) -> str:
    """``[rank0]: [rank0]: Traceback`` -> ``[rank0]: Traceback``; ``[rank0]: [rank0] INFO`` -> ``[rank0]: INFO``."""
    return _REPEATED.sub(r"\1", text)


class _SinglePrefix:
    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(single_prefix_text(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def single_prefix() -> Iterator[None]:
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _SinglePrefix(saved[0]), _SinglePrefix(saved[1])
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
