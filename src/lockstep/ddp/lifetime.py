"""What a reducer leaves behind, and when it goes: the process must exit 0 however the script ends.

A work launched inside backward used to hold a Python object (torch's thread-local state captured
with backward's ``contextvars`` context) and so could abort the process if gloo's worker thread was
the last to let go of it while the interpreter was finalising; ``collectives.clean`` has the story.
The reducer now launches everything inside backward through ``launch_clean``, so its works hold no
Python object and may be dropped by any thread at any time: each bucket keeps its work until the
next backward starts (``Reducer.release_works(keep=False)``), as torch's DDP keeps its own, and a direct bucket's
work lets go of that step's gradient then.

What stays, in case a work still holds a Python object (a Python dispatcher or function mode active
around a user's backward is in the same thread-local state): a reducer that dies (its DDP object was
dropped) and, at interpreter exit, every live reducer hand their last works to ``bury``, a graveyard
that is never freed, so the main thread's reference is never dropped and the worker's cannot be the
last. Entries older than ``_SAFE_AFTER_S`` and completed are dropped when the next arrives or a reducer is
built (long since let go by gloo, on a live interpreter). The buckets' works are not buried at every step any
more: held for seconds, the works of every step pinned glibc's heap (RSS +0.4 to +0.7 GB for the 10.5M MLP,
all of it given back by ``malloc_trim``), where torch's DDP holds none.

The hooks hold the reducer weakly, so a dropped DDP object takes its reducer, buffers and
process-group reference with it.

Not only the reducer's works: any collective's work holds its tensors, and a tensor whose Python object
was dropped while the work still held it owns that object, so freeing it takes the GIL too. gloo's
worker lets go of a work a few microseconds after waking the waiter, unless the scheduler takes the
core from it there; if the script then runs to interpreter exit first (a ``barrier()`` and
``destroy_process_group()`` right after a library's ``all_gather``), the worker frees it inside
``Py_FinalizeEx`` and the process aborts (a core from Transformers' Trainer under lockstep, 1 run in
100: ``runLoop`` -> ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``).
``settle_gloo_workers``, run at exit, waits (GIL released) until no gloo worker is on a core or waiting
for one, so they have let go before finalisation starts.

Not only at finalisation: torch 2.4 frees a ``ProcessGroup`` without releasing the GIL, and its destructor
joins gloo's workers. A work dropped in flight (a forward that raises inside ``join()`` drops its "not joined"
all-reduce) is freed by the worker when it completes, which takes the GIL: if the group's last reference goes
first (the traceback that held the DDP object, freed as a multiprocessing child exits), both wait for good
(torch's ``test_ddp_uneven_input_exception``, 1 run in 2 on torch 2.4, torch's own DDP too). Works that
can be dropped in flight (the join's, the Trainer's stop flag) are buried as they are launched, and the
graveyard keeps a work until it has completed, however old.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import os
import time
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

# Seconds after which gloo's worker has surely let go of a finished work. It lets go microseconds
# after completion unless descheduled; this is many scheduler time slices on the most crowded machine.
_SAFE_AFTER_S = 5.0

_GRAVEYARD: collections.deque[tuple[float, list[Any]]] = collections.deque()
# One reference that nothing ever drops: finalisation clears the module's globals, but the list and
# the works in it stay alive until the process is gone.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_GRAVEYARD))


def _finished(works: list[Any]) -> bool:
    """Every work completed (a ``Work``'s ``is_completed``, a future's ``done``; anything else counts as finished):
    one still queued behind a slow peer keeps its place, and those buried after it, however old."""
    for work in works:
        done = getattr(work, "is_completed", None) or getattr(work, "done", None)
        if done is not None and not done():
            return False
    return True


def bury(works: Iterable[Any], graveyard: collections.deque = _GRAVEYARD, clock: Any = time.monotonic,
         safe_after_s: float = _SAFE_AFTER_S, finished: Any = _finished) -> None:
    """Keep works (``Work`` objects or futures), finished or in flight, alive for good; see the module docstring.

    Works buried more than ``safe_after_s`` ago and finished are let go first (on a live interpreter, long after
    gloo's thread did): a dropped DDP object's bucket buffers are held that long, until the next call.
    Callable from ``__del__`` during finalisation: everything it uses comes in as default arguments,
    not through the module's globals, which may already be gone.
    """
    now = clock()
    while graveyard and now - graveyard[0][0] > safe_after_s and finished(graveyard[0][1]):
        graveyard.popleft()
    kept = [w for w in works if w is not None]
    if kept:
        graveyard.append((now, kept))


def let_go_of_finished(graveyard: collections.deque = _GRAVEYARD) -> None:
    """Drop every finished work now, whatever its age: called when a group was destroyed and re-formed in place
    (``lockstep.train.inplace``), whose works all failed or completed, so that its sockets and buffers go."""
    kept = [entry for entry in graveyard if not _finished(entry[1])]
    graveyard.clear()
    graveyard.extend(kept)


def release_works(state: dict, keep: bool, clear: bool = True) -> None:
    """A reducer's works (its buckets', its status and NaN-check exchanges') from its ``__dict__``: buried
    where ``keep``, and unset on the reducer where ``clear``. Read from the dict because a reducer that failed
    in ``__init__`` may lack any of them, and ``__del__`` must not raise."""
    holders = [state.get(k) for k in ("usage", "nonfinite")]
    buckets = state.get("buckets", ())
    works = [b.work for b in buckets] + [getattr(h, "last_work", None) for h in holders]
    if keep:
        bury(works)
    if clear:
        for bucket in buckets:
            bucket.work = None
        for holder in holders:
            if holder is not None:
                holder.last_work = None


def remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class ExitingReducer(Protocol):
    """What exit asks of a live reducer."""

    def release_works(self, keep: bool = True) -> None: ...
    def remove_hooks(self) -> None: ...


_LIVE_REDUCERS: weakref.WeakSet[ExitingReducer] = weakref.WeakSet()


def register_for_exit(reducer: ExitingReducer, handles: list) -> None:
    """Until ``reducer`` is collected: its works are let go of at exit (``_release_at_exit``). Once it is: its
    parameters' ``handles`` are removed (the parameters outlive a dropped DDP object)."""
    weakref.finalize(reducer, remove_handles, handles)
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
    settle_gloo_workers()


GLOO_WORKER_NAME = "pt_gloo_runloop"  # what torch >= 2.5 names ProcessGroupGloo's worker threads (2.4: unnamed)
_TASKS = "/proc/self/task"


def gloo_worker_states(tasks: str = _TASKS) -> dict[int, str]:
    """Thread id -> scheduler state ("R": on a core or waiting for one, "S": asleep, ...) of this process's
    gloo worker threads, read from /proc (Linux). Empty where there is no /proc or the threads are unnamed."""
    states: dict[int, str] = {}
    try:
        tids = os.listdir(tasks)
    except OSError:
        return states
    for tid in tids:
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                if f.read().strip() != GLOO_WORKER_NAME:
                    continue
            with open(f"{tasks}/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        states[int(tid)] = stat[stat.rindex(")") + 2]  # the field after the name, which may hold spaces and ")"
    return states


def settle_gloo_workers(timeout_s: float = 0.25, poll_s: float = 0.001, states: Any = gloo_worker_states,
                        clock: Any = time.monotonic, sleep: Any = time.sleep) -> bool:
    """Wait until no gloo worker thread is runnable in two polls in a row, ``poll_s`` apart, at most ``timeout_s``.

    A worker that has just finished a collective is runnable ("R") until it has let go of the work and is
    back waiting for the next (asleep); a worker waiting for the GIL is asleep, but gets it during the sleep
    between the polls (``time.sleep`` releases it). A worker inside a collective that waits for a peer is
    asleep too: the poll does not wait for it (that work may never complete). True when settled (also when
    there are no named workers), False on the timeout. Costs two /proc reads per worker and ~``poll_s`` at exit.
    """
    deadline = clock() + timeout_s
    quiet = 0
    while True:
        found = states()
        if not found:
            return True
        quiet = quiet + 1 if "R" not in found.values() else 0
        if quiet >= 2:
            return True
        if clock() >= deadline:
            return False
        sleep(poll_s)
