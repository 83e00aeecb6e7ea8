"""What a reducer leaves behind, and when it goes: the process must exit 0 however the script ends.

Every collective launched inside backward captures torch's thread-local state, which then holds a
Python object (the ``contextvars`` context that ``_engine_run_backward`` stashes for the length of
the backward). Whichever thread drops the last reference to such a ``Work`` frees that object and
needs the GIL. gloo's worker thread holds its own reference to a work until a moment *after* it
marked the work complete (it wakes the waiter first, then lets go), and on a crowded machine it can
be descheduled in between for as long as the main thread needs to finish the script. If the main
thread dropped its reference meanwhile and the interpreter is finalising when the worker lets go,
the worker is made to exit inside a noexcept destructor and the process aborts ("terminate called
without an active exception"; a core showed exactly this: ``~AsyncAllreduceWork`` ->
``~ThreadLocalState`` -> ``decref`` -> ``take_gil`` -> ``pthread_exit`` in ``ProcessGroupGloo::runLoop``
while the main thread was in ``Py_FinalizeEx``).

So no work launched in backward may have its main-thread reference dropped shortly before exit:

- each bucket keeps its work until the next backward starts, which hands the previous works to
  ``bury`` rather than dropping them: a step of a small model takes a few milliseconds, less than
  gloo's thread can be descheduled for, and a work dropped then could still be freed by that thread
  after the script ended (seen in CI's loops after the first fix, which buried only at exit);
- a reducer that dies (its DDP object was dropped) and, at interpreter exit, every live reducer hand
  their last works to ``bury`` as well: a graveyard that is never freed, so the main thread's reference is never
  dropped and the worker's cannot be the last. Entries older than ``_SAFE_AFTER_S`` are dropped when
  the next arrives or a reducer is built (long since let go by gloo, on a live interpreter). The
  default path's works all hold the same, reused bucket buffers, so this costs no memory while
  training; a dropped DDP object's buffers are held a few seconds; what remains at exit is reclaimed
  with the process. A comm hook's futures hold fresh tensors every step, so between steps they are
  dropped as before (an abort at exit stays possible there, as it is in torch's DDP).

The hooks hold the reducer weakly, so a dropped DDP object takes its reducer, buffers and
process-group reference with it.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import time
import weakref
from typing import Any, Iterable

# Seconds after which gloo's worker has surely let go of a finished work. It lets go microseconds
# after completion unless descheduled; this is many scheduler time slices on the most crowded machine.
_SAFE_AFTER_S = 5.0

_GRAVEYARD: "collections.deque[tuple[float, list[Any]]]" = collections.deque()
# One reference that nothing ever drops: finalisation clears the module's globals, but the list and
# the works in it stay alive until the process is gone.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_GRAVEYARD))


def bury(works: Iterable[Any], graveyard: "collections.deque" = _GRAVEYARD, clock: Any = time.monotonic,
         safe_after_s: float = _SAFE_AFTER_S) -> None:
    """Keep finished works (``Work`` objects or futures) alive for good; see the module docstring.

    Works buried more than ``safe_after_s`` ago are let go first (on a live interpreter, long after
    gloo's thread did): a dropped DDP object's bucket buffers are held that long, until the next call.
    Callable from ``__del__`` during finalisation: everything it uses comes in as default arguments,
    not through the module's globals, which may already be gone.
    """
    now = clock()
    while graveyard and now - graveyard[0][0] > safe_after_s:
        graveyard.popleft()
    kept = [w for w in works if w is not None]
    if kept:
        graveyard.append((now, kept))


def remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


_LIVE_REDUCERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register_for_exit(reducer: Any) -> None:
    bury(())  # let go of what earlier, dropped reducers left
    if not _LIVE_REDUCERS:
        atexit.register(_release_at_exit)  # once per process while reducers exist; a second call is harmless
    _LIVE_REDUCERS.add(reducer)


def _release_at_exit() -> None:
    # atexit runs before the interpreter starts finalising; the works go to the graveyard, not away.
    atexit.unregister(_release_at_exit)
    for reducer in list(_LIVE_REDUCERS):
        reducer.release_works()
        reducer.remove_hooks()
