"""The watcher: each rank's heartbeat in the store, and the thread that ends the group's collectives on an alarm.

Gloo cannot abort an operation in flight (``ProcessGroupGloo.abort()`` and ``shutdown()`` leave a blocked ``wait``
blocked, measured with torch 2.13), so the watcher ends it the way a dead peer would: it shuts down the group's
connected TCP sockets, and the blocked operation fails at once. It raises the alarm itself when a member's heartbeat
stood still for ``ALARM_SILENT_S`` (a frozen rank, a cut link: no socket closes then). The group's gloo timeout
(``LOCKSTEP_INPLACE_TIMEOUT_S``, 60 s) bounds what neither ends (a cut link with no heartbeat store either).
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
from typing import Protocol

import torch.distributed as dist

from lockstep.keys import beat_key, generation_key
from lockstep.train.inplace.admission import Joins
from lockstep.train.inplace.regroup import ALARM_SILENT_S
from lockstep.train.inplace.store_move import STANDBY_CONNECT_S, Stores

BEAT_S = 0.2  # each rank's heartbeat in the store


def shut_sockets(fds: set[int], keep_port: int) -> None:
    """Shut down the connected sockets among ``fds`` (not a listener: gloo aborts the process on a failed
    accept; not the store's connections on ``keep_port``, a client's or, where this process serves the store,
    the server's): a gloo wait on them fails at once."""
    for fd in fds:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and not sock.getsockopt(
                    socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and keep_port not in (
                    sock.getpeername()[1], sock.getsockname()[1]):
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected, or gone meanwhile
        finally:
            sock.close()


class Watched(Protocol):
    """What the watcher reads of its group (``InPlaceGroup``), and the two things it may ask of it."""

    me: int
    members: list[int]
    generation: int
    joins: Joins
    stores: Stores

    def shut_group(self, generation: int) -> None: ...
    def raise_alarm(self, client: dist.Store | None = None) -> None: ...


class Watcher:
    """One rank's heartbeat and watch, on a thread of its own with a store client of its own (the main thread's may
    wait in a store call). ``seen``: launch rank -> (its last heartbeat, when it changed), read by the re-formation
    (who is silent) and the admission (who still beats)."""

    def __init__(self, group: Watched):
        self.group = group
        self.seen: dict[int, tuple[int, float]] = {}
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Heartbeat and watch (again, after ``stop``: a Trainer's second ``fit``)."""
        if self.thread is None or not self.thread.is_alive():
            self.stopped.clear()
            self.thread = threading.Thread(target=self._run, name="lockstep-inplace", daemon=True)
            self.thread.start()
            # a process that leaves without stopping it (an error raised while the Trainer is built) must not exit
            # with the thread in a store call: the interpreter's exit would abort the process (SIGABRT)
            atexit.register(self.stop)

    def stop(self) -> None:
        self.stopped.set()
        atexit.unregister(self.stop)
        if self.thread is not None:
            self.thread.join(timeout=2 * BEAT_S + 1)

    def restart_silence(self, members: list[int]) -> None:
        """After a move to another store: judge silence from now (every heartbeat so far went to the old one)."""
        self.seen = dict.fromkeys(members, (-1, time.monotonic()))

    def _run(self) -> None:
        client, moves = None, -1
        while not self.stopped.wait(BEAT_S):
            try:
                if client is None or moves != self.group.stores.moves:  # first, after a failed call, after a move
                    moves, client = self.group.stores.moves, None
                    client = self.group.stores.connect(STANDBY_CONNECT_S)
                self._beat(client)
            except Exception:  # the store is slow or gone: the gloo timeout still bounds the step
                client = None  # a TCPStore client whose server went away never reconnects by itself
                continue

    def _beat(self, client: dist.Store) -> None:
        group = self.group
        client.add(beat_key(group.me), 1)
        now = time.monotonic()
        for r in group.members:
            beat = client.add(beat_key(r), 0)
            if self.seen.get(r, (None,))[0] != beat:
                self.seen[r] = (beat, now)
        group.joins.poll(client, now, self.seen, group.members)
        generation = group.generation
        if client.check([generation_key(generation, "alarm")]):
            group.shut_group(generation)
        elif any(now - t > ALARM_SILENT_S for r, (_, t) in self.seen.items() if r in group.members):
            group.raise_alarm(client)  # a member froze or its link was cut: nothing else would end our waits
