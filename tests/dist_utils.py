"""Start a real group of ranks on gloo and collect what each returns.

Each rank is its own process, forked from a forkserver that imported torch once (the first ``run_ranks`` of a
pytest process starts it): a rank starts in ~0.1 s, where a freshly spawned one imports torch again (~2 CPU-s,
5-15 s of wall time on a loaded 2-core machine). ``LOCKSTEP_TEST_START=spawn`` spawns fresh interpreters instead.
Tests still run many cases inside one group (a module-scoped fixture calls ``run_ranks`` once and the test
functions assert on the returned per-rank results): a group's rendezvous and a model's set-up cost too.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
from typing import Any, Callable, Sequence

from lockstep.process_group import free_port

START_METHOD = os.environ.get("LOCKSTEP_TEST_START", "forkserver")
if START_METHOD not in ("forkserver", "spawn"):
    raise ValueError(f"LOCKSTEP_TEST_START must be forkserver or spawn, got {START_METHOD!r}")
if START_METHOD == "forkserver":
    # Imported once in the server, before any rank: no thread, no process group, no CUDA context exists there yet.
    # torch._dynamo too: torch.optim imports it at a rank's first optimizer (Optimizer.add_param_group is wrapped
    # by torch._disable_dynamo), ~1.1 CPU-s in every rank that builds one; preloaded, four files' ranks took
    # 68.7 CPU-s instead of 86.9 (test_ddp_parity, test_zero2, test_comm_hooks, test_memory; it starts no thread).
    mp.set_forkserver_preload(["torch", "torch.distributed", "lockstep.ddp", "torch._dynamo"])


def _child(fn, rank, world_size, port, args, result_queue, backend, timeout_s, init, env, parent):
    # A forked rank has the forkserver's environment and folder: take the caller's, as a spawned rank would.
    environ, cwd = parent
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.update(env or {})
    import faulthandler

    faulthandler.enable()  # a rank that dies of a signal (SIGSEGV, SIGABRT) prints every thread's stack first
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if init:
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        result = fn(rank, world_size, *args)
        # Plain bytes: a queued tensor would travel as shared memory that dies with this process.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        result_queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report everything, KeyboardInterrupt included
        result_queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    timeout_s: float = 240.0,
    backend: str = "gloo",
    init: bool = True,
    env: dict | None = None,
    pg_timeout_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new ranks (processes; see the module docstring).

    Returns the per-rank results in rank order. Raises AssertionError with every
    failing rank's traceback, or TimeoutError naming the ranks that never
    reported within ``timeout_s`` (the ranks are killed: a test never hangs).
    """
    ctx = mp.get_context(START_METHOD)
    result_queue = ctx.Queue()
    port = free_port()
    parent = (dict(os.environ), os.getcwd())
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, port, tuple(args), result_queue, backend, pg_timeout_s, init, env, parent),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s; reported: {_summary(results)}")
            try:
                rank, status, payload = result_queue.get(timeout=min(remaining, 1.0))
                results[rank] = (status, payload)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    # A rank died without reporting (segfault, os._exit): give the queue a moment, then fail.
                    time.sleep(0.5)
                    while not result_queue.empty():
                        rank, status, payload = result_queue.get()
                        results[rank] = (status, payload)
                    dead = [r for r in dead if r not in results]
                    if dead:
                        raise AssertionError(
                            f"ranks {dead} exited with codes {[procs[r].exitcode for r in dead]} without reporting; "
                            f"reported: {_summary(results)}"
                        )
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: payload for r, (status, payload) in results.items() if status == "error"}
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise AssertionError(f"ranks {sorted(errors)} raised:\n{text}")
    import torch

    return [torch.load(io.BytesIO(results[r][1]), weights_only=False) for r in range(world_size)]


def _summary(results: dict) -> str:
    return "; ".join(f"rank {r}: {status} {str(payload)[-300:]}" for r, (status, payload) in sorted(results.items()))
