"""What a reducer leaves behind, and when it goes: the process must exit 0 however the script ends.

Every collective launched inside backward captures torch's thread-local
state, which then holds a Python object (the ``contextvars`` context that
``_engine_run_backward`` stashes for the length of the backward). Whichever thread
drops the last reference to such a ``Work`` frees that object and needs the GIL; if
it is gloo's worker thread while the interpreter is finalising, the thread is made
to exit inside a noexcept destructor and the process aborts ("terminate called
without an active exception"). So no gloo thread may hold the last reference: each
bucket keeps its work (and the status exchange its own) until the next backward
replaces it, long after gloo's thread let go, and at interpreter exit the works of
every live reducer are released here, on the main thread, before finalisation
starts. The hooks hold the reducer weakly, so a dropped DDP object takes its
reducer, buffers and process-group reference with it.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any


def remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


_LIVE_REDUCERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register_for_exit(reducer: Any) -> None:
    if not _LIVE_REDUCERS:
        atexit.register(_release_at_exit)  # once per process while reducers exist; a second call is harmless
    _LIVE_REDUCERS.add(reducer)


def _release_at_exit() -> None:
    # atexit runs before the interpreter starts finalising: gloo's threads are idle and the GIL is ours.
    atexit.unregister(_release_at_exit)
    for reducer in list(_LIVE_REDUCERS):
        reducer.release_works()
        reducer.remove_hooks()
