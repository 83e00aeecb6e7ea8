"""Run a benchmark worker on a few spawned processes of this host and collect its result; where results go."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Not benchmarks/results: run from a checkout, that tracked folder took every ad-hoc run (issue 34); the
# repository's .gitignore lists this one
DEFAULT_OUT = "lockstep-bench"
OUT_HELP = (f"directory for the JSON, markdown and PNG (default: {DEFAULT_OUT} under the current directory; "
            "'' writes none)")


def results_dir(parser: argparse.ArgumentParser, out: str) -> Path | None:
    """The absolute directory results go to, made now and checked writable (a bad --out fails before the
    benchmark runs, not after it), said on stdout; None for ``--out ''``."""
    if not out:
        print(f"{parser.prog}: no files written (--out '')")
        return None
    path = Path(out).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"argument --out: cannot create {path}: {e.strerror or e}")
    if not os.access(path, os.W_OK | os.X_OK):
        parser.error(f"argument --out: {path} is not writable")
    print(f"{parser.prog}: results go to {path} (--out DIR to change)", flush=True)
    return path


def spawn_and_collect(worker, world_size: int, port: int, cfg: dict, timeout_s: float, what: str):
    """Start ``worker(rank, world_size, port, cfg, queue)`` on ``world_size`` spawned processes and return
    the first ``("ok", payload)`` one puts on the queue; a rank that dies or a run past ``timeout_s``
    raises, naming the ranks (a silent death must not look like a hang).
    """
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world_size, port, cfg, q)) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                status, payload = q.get(timeout=1.0)
                break
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"{what} ranks {dead or 'all'} of {world_size} died or timed out "
                                       f"after {timeout_s:.0f} s") from None  # the queue's Empty says nothing
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(payload)
    return payload


@contextlib.contextmanager
def report_to_parent(rank: int, queue: Any) -> Iterator[list]:
    """A worker's side of ``spawn_and_collect``: the body fills the yielded list; rank 0 sends it as
    ``("ok", rows)``, any rank's exception is sent as ``("error", text)`` (a silent death would look
    like a hang), and the process group is destroyed either way.
    """
    import torch.distributed as dist

    rows: list = []
    try:
        yield rows
        if rank == 0:
            queue.put(("ok", rows))
    except BaseException as e:
        queue.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
