"""Elastic membership for ``lockstep launch --nnodes MIN:MAX``: parsing, numbering, and the one-line report.

torch's elastic agent and its c10d rendezvous already re-form the group with the nodes
still alive (torchrun's ``--nnodes MIN:MAX``): a lost node makes the survivors' workers
fail, the agent restarts them (counted against ``--max-restarts``, as torchrun counts it),
and the next round completes with whoever joined once ``MIN`` nodes are there and the
last call has passed; a node that arrives while the job runs makes every agent restart its
workers at the next re-rendezvous (not counted, as in torchrun). What this module adds:
the nodes of a round are numbered by ``--node-rank`` among those present (node 0 serves
the rendezvous store: on the restart path it must stay; in place the survivors go on without
it, launch/rendezvous.py), and after every round but the first the launcher
prints one line saying which node left or joined, the old and new world size and the step
the workers resumed from, which the Trainer (or ``lockstep.resume``) reports through the
workers' store.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

from lockstep.keys import INPLACE_REPORT_KEY, REPORT_ENV, RESUME_KEY

JOB_KEY = "lockstep/job_id"  # in the rendezvous store: node 0's agent sets the job's id (keys.JOB_ENV), all read it
DEFAULT_LAST_CALL_S = 5.0  # how long a round waits for more nodes once MIN joined (torchrun's default: 30)


def parse_nnodes(value: str) -> tuple[int, int]:
    """``"N"`` -> (N, N); ``"MIN:MAX"`` -> (MIN, MAX), torchrun's syntax; argparse's error otherwise."""
    pieces = value.split(":")
    try:
        if len(pieces) not in (1, 2):
            raise ValueError
        low, high = (int(pieces[0]), int(pieces[-1]))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX (integers), got {value!r}") from None
    if low < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: the number of nodes must be >= 1, got {low}")
    if low > high:
        raise argparse.ArgumentTypeError(f"{value!r}: MIN {low} is larger than MAX {high}")
    return low, high


def describe_change(old: list[dict] | None, new: list[dict], nproc: int) -> str | None:
    """'node 1 (10.0.0.2) left; world size 4 -> 2', or None for the first round. Nodes are the rendezvous
    records ({"node_rank", "addr", "host"}); every node runs ``nproc`` workers."""
    if old is None:
        return None
    def name(n: dict) -> str:
        return f"node {n['node_rank']} ({n['addr']})"
    before, after = {n["node_rank"]: n for n in old}, {n["node_rank"]: n for n in new}
    left = [name(before[r]) for r in sorted(before.keys() - after.keys())]
    joined = [name(after[r]) for r in sorted(after.keys() - before.keys())]
    what = "; ".join([f"{', '.join(left)} left"] * bool(left) + [f"{', '.join(joined)} joined"] * bool(joined))
    sizes = f"world size {len(old) * nproc} -> {len(new) * nproc}"
    return f"{what}: {sizes}" if what else f"the same {len(new)} node(s) restarted: {sizes}"


class ResumeReport(threading.Thread):
    """Prints the membership line once the workers of this round have said which step they resumed from.

    Reads ``RESUME_KEY`` from the round's workers' store (a client of its own; polled once a second,
    nothing else). Stopped by the next round: then the line goes out without a step."""

    def __init__(self, change: str, host: str, port: int):
        super().__init__(name="lockstep-resume-report", daemon=True)
        self.change, self.host, self.port = change, host, port
        self.stop = threading.Event()

    def run(self) -> None:
        from lockstep.launch.liveness import connect

        step = None
        try:
            store = connect(self.host, self.port, 10)
            while not self.stop.wait(1.0):
                if store.check([RESUME_KEY]):
                    step = json.loads(store.get(RESUME_KEY))
                    break
        except Exception:  # the round ended (store gone): report what is known
            pass
        if step is None:
            tail = "; the workers reported no resume step"
        elif step.get("step") is None:
            tail = "; the workers started from the beginning (no checkpoint)"
        else:
            tail = f"; resumed from step {step['step']}"
        print(f"lockstep launch: {self.change}{tail}", file=sys.stderr, flush=True)


def describe_in_place(record: dict, nodes: list[dict], nproc: int) -> tuple[str, list[dict]]:
    """'node 1 (10.201.0.2) left at step 812: world 4 -> 2 in 1.8 s, 0 steps lost', and the nodes that left;
    for a grow, 'node 1 (10.201.0.2) joined at step 815: world 2 -> 4 in 6.2 s from its launch, the others
    paused 0.4 s', and the nodes that joined.

    ``record`` is what the workers' new rank 0 wrote (train/inplace/): the launch ranks that left (or the
    ids that joined), the sizes, the step the group went on from, the seconds from the first alarm (from the
    newcomers' launcher start) to the first step at the new size. Launch rank r ran on the round's node
    r // nproc (nodes numbered by --node-rank); a newcomer's node is in the record's ``where``."""
    where = record.get("where", {})
    ranks = record.get("joined") or record["left"]

    def node_of(r: int) -> dict | None:
        return where.get(str(r)) or (nodes[r // nproc] if r // nproc < len(nodes) else None)

    named: dict[int, dict] = {}
    for r in ranks:
        if (n := node_of(r)) is not None:
            named.setdefault(n["node_rank"], n)
    found = [named[k] for k in sorted(named)]
    names = ", ".join(f"node {n['node_rank']} ({n['addr']})" for n in found) or f"ranks {ranks}"
    on = [(node_of(r) or {}).get("node_rank") for r in ranks]
    if any(on.count(n["node_rank"]) != nproc for n in found):  # only some of a node's workers
        names += f" (ranks {ranks})"
    sizes = f"world {record['old_world']} -> {record['world']}"
    if record.get("joined"):
        return (f"{names} joined at step {record['step']}: {sizes} in {record['seconds']:.1f} s from its launch, "
                f"the others paused {record['paused']:.1f} s"), found
    return (f"{names} left at step {record['step']}: {sizes} in {record['seconds']:.1f} s, "
            f"{record['lost']} steps lost"), found


class InPlaceReport(threading.Thread):
    """Prints a line for each in-place re-formation the workers record in their store, and hands the nodes that
    left to ``on_left`` (the rendezvous handler forgets them), those that joined to ``on_joined``. Polled every
    0.2 s on a client of its own; the workers keep the newest record's number under ``/latest`` (a launcher that
    joins a running job starts after it). A generation whose record never came (the group re-formed again before its
    first step, or the store moved) is passed over once a later one is there.
    """

    def __init__(self, host: str, port: int, nodes: list[dict], nproc: int, on_left, on_joined=None,
                 generation: int = 1):
        super().__init__(name="lockstep-inplace-report", daemon=True)
        self.host, self.port, self.nodes, self.nproc, self.on_left = host, port, nodes, nproc, on_left
        self.on_joined = on_joined
        self.generation = generation  # the next re-formation to report (a report moved to another store goes on)
        self.stop = threading.Event()

    def run(self) -> None:
        from lockstep.launch.liveness import connect
        from lockstep.network import accepts

        latest_key, store = f"{INPLACE_REPORT_KEY}/latest", None
        while not self.stop.wait(0.2):
            try:
                if store is None:  # first, and after a failed call (a slow store, a loaded machine): again
                    if not accepts(self.host, self.port, 1.0):
                        continue  # gone (the round ended, or its node: the handler stops this thread then)
                    store = connect(self.host, self.port, 10)
                latest = int(store.get(latest_key)) if store.check([latest_key]) else None
                while latest is not None and self.generation <= latest:
                    key = f"{INPLACE_REPORT_KEY}/{self.generation}"
                    if store.check([key]):
                        self._say(json.loads(store.get(key)))
                    self.generation += 1
            except Exception:  # a client out of step with the server: a new one
                store = None

    def _say(self, record: dict) -> None:
        line, named = describe_in_place(record, self.nodes, self.nproc)
        print(f"lockstep launch: {line}", file=sys.stderr, flush=True)
        if record.get("joined"):
            if self.on_joined is not None:
                self.on_joined(named)
        else:
            self.on_left(named)


def report_resume(step: int | None, world_size: int, from_world_size: int | None = None) -> None:
    """Worker side: tell ``lockstep launch`` the step this run resumed from (None: from the start).

    A no-op outside ``lockstep launch`` or on any rank but global rank 0."""
    if os.environ.get(REPORT_ENV) != "1" or os.environ.get("RANK") != "0":
        return
    import datetime

    import torch.distributed as dist

    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                              datetime.timedelta(seconds=10))
        store.set(RESUME_KEY, json.dumps({"step": step, "world_size": world_size, "from": from_world_size}))
    except Exception as e:  # a report only: training goes on without it
        print(f"lockstep: could not report the resume step to the launcher: {e}", file=sys.stderr, flush=True)
