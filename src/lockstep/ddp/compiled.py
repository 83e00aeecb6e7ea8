"""torch.compile with lockstep's DistributedDataParallel, in either order, as with torch's DDP.

- ``DDP(torch.compile(module))`` (nanoGPT's order). The DDP's forward runs eagerly and dynamo compiles
  the module's frames. AOTAutograd makes a compiled graph's backward one autograd node, so all of its
  gradients arrive together at its end and no bucket could start before the whole backward is done.
  torch's DDP avoids that by naming itself dynamo's *active DDP module* while the module runs; dynamo
  then splits the graph at bucket-sized boundaries (DDPOptimizer, ``torch._dynamo.backends.distributed``)
  and each piece's gradients arrive when its backward ends. The DDP's forward names lockstep's DDP the same
  way, so the same splits happen (dynamo reads ``bucket_bytes_cap`` and parameters' ``_ddp_ignored``).
  Where the cap is below dynamo's first-bucket size (1 MiB) dynamo would fail an assertion
  ("First bucket should be smaller/equal ..."), as it does with torch's DDP; lockstep then does not
  name itself and the graph stays whole (correct, with the buckets after the backward).
- ``torch.compile(DDP(module))`` (Accelerate's order). dynamo is handed the DDP's own forward. Its
  bookkeeping (clocks, the progress observer, collectives, join) has no place in a graph, and tracing
  it made dynamo warn about builtins it cannot trace (``time.monotonic``...). So under dynamo the
  forward leaves the trace at once (``forward_outside_dynamo``: a graph break), runs eagerly, and the
  module's frames are compiled as in the first order, split the same way. Once dynamo is loaded,
  lockstep's own files are among the directories it skips, as torch's are, so neither lockstep's
  helpers nor its gradient hooks are ever traced.

Cost without compile: one flag read and two class-attribute writes per forward. Nothing here imports
dynamo (seconds of start-up; torch's DDP imports it at construction): only a script that compiles does.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

_TorchDDP = torch.nn.parallel.DistributedDataParallel
DYNAMO_FIRST_BUCKET_BYTES = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1024 * 1024)  # DDPOptimizer's first bucket
skipped = False
COMPILED_AUTOGRAD = "torch._dynamo.compiled_autograd"  # the module; loaded with dynamo
COMPILED_REGION = "in_compiled_autograd_region"  # its flag, set while its trace runs (torch >= 2.5)


def skip_lockstep_in_dynamo() -> bool:
    """Add lockstep's package to the directories dynamo does not trace, once dynamo is loaded."""
    global skipped
    if not skipped and "torch._dynamo" in sys.modules:
        from torch._dynamo import trace_rules

        trace_rules.add("lockstep")
        skipped = True
    return skipped


def _forward_eagerly(forward: Any, inputs: tuple, kwargs: dict) -> Any:
    skip_lockstep_in_dynamo()  # dynamo is loaded: it is tracing the caller
    return forward(*inputs, **kwargs)


# A torch wrapper that imports dynamo on its first call only (under compile, where it is loaded already).
# recursive=False: this frame runs eagerly, the frames it calls are still offered to dynamo, so the
# module's own code is compiled while lockstep's (skipped by then) is not.
forward_outside_dynamo = torch._disable_dynamo(_forward_eagerly, recursive=False)


def _compiling() -> bool:  # torch < 2.5 (``in_compiled_call``)
    """Whether this runs inside a compiled call (dynamo's frame callback is set): a C call or two."""
    frames = torch._C._dynamo.eval_frame
    get = getattr(frames, "get_eval_frame_callback", None)
    if get is not None:
        return get() not in (None, False)
    previous = frames.set_eval_frame(None)  # torch < 2.5 has no getter: read it by putting it back
    frames.set_eval_frame(previous)
    return previous not in (None, False)


def refuse_compiled_autograd() -> None:
    """Raise where compiled autograd runs this backward (``torch._dynamo.compiled_autograd``).

    It traces the backward, gradient hooks included, into a graph and runs that: lockstep's hooks copy
    gradients into buckets and launch all-reduces outside any graph, so they would act on the trace's
    tensors and the real gradients would stay unaveraged, the ranks drifting apart without an error
    (seen: 0.004 apart after 3 steps). torch's DDP needs its Python reducer there
    (``torch._dynamo.config.optimize_ddp = "python_reducer"``), which traces functional collectives.
    Cost: a dict lookup per backward (the reducer reads the flags itself and calls this where one may be set).
    """
    compiled_autograd = sys.modules.get(COMPILED_AUTOGRAD)
    if compiled_autograd is None:
        return
    # Inside its trace: the region flag (torch >= 2.5; the "enabled" flag reads False there), or, before it
    # existed, the "enabled" flag (2.4); dynamo's compiling flag where the trace reaches this frame itself.
    region = getattr(compiled_autograd, COMPILED_REGION, None)
    inside = region if region is not None else getattr(compiled_autograd, "compiled_autograd_enabled", False)
    if inside or torch.compiler.is_compiling():
        raise RuntimeError(
            "lockstep's DistributedDataParallel does not support compiled autograd "
            "(torch._dynamo.compiled_autograd / torch._dynamo.config.compiled_autograd): its gradient hooks "
            "would run in the trace and the gradients would not be averaged. Run this backward without it "
            "(torch.compile of the model is supported), or use torch's DDP with "
            "torch._dynamo.config.optimize_ddp = 'python_reducer'."
        )


def module_for_dynamo(module: Any) -> Any:
    """``module`` as the DDP's forward calls it where it runs inside a compiled call (``frame_callback``): a module
    whose forward is torch's own (nn.Sequential...) gets a frame of its own, as torch.compile(module) gives it
    (dynamo skips such a frame when it is the first one offered)."""
    from torch._dynamo import external_utils, trace_rules

    return external_utils.wrap_inline(module) if trace_rules.check(module.forward) else module


# Dynamo's frame callback: set (not None or False) while this runs inside a compiled call. torch's C getter (>= 2.5;
# before, ``_compiling``'s True or False), read by the DDP's forward where lockstep is among dynamo's skipped files.
frame_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None) or _compiling
