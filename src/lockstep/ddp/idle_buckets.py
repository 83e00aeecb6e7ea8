"""A bucket's memory between steps under bucket views: given back while nothing but the reducer holds it.

With bucket views (lockstep's None, torch's True) the buckets are the gradients, one model's worth (G), kept
by torch's reducer for the model's life. After ``zero_grad()`` (set_to_none, every torch optimizer's default)
no ``.grad`` points into them any more, yet the next forward stacks its activations on parameters + buckets.
On a model whose activations peak at the end of forward that sum is the step's peak, and the buckets are G of
it for nothing: measured on benchmarks/memory.py's transformer (39 MB of gradients), the step peaked at the
start of backward at parameters + buckets + 11 MB of activations, where torch's default copies peak at its end
at parameters + buckets + gradients + 2 MB; so bucket views saved 0.77 G, not G (issue #30).

So at a synchronised forward's start (``release_idle``) a bucket that no ``.grad`` and nothing outside the
reducer holds gives its storage back (``untyped_storage().resize_(0)``, as FSDP frees its unsharded
parameters), and the first gradient of the next backward to land in it allocates it again
(``ensure_resident``), when the activations already freed make room. The peak is then the larger of
parameters + activations and parameters + buckets + what activations are left: torch's default's, less G.
Every slot is written before its bucket is sent (``copy_in``: a missing gradient's slot is zeroed, the spare
element is set at launch), so the fresh storage's contents are never read. What it costs: one allocation per
bucket per backward (on CPU the kernel's fresh pages; on a GPU the caching allocator's), as torch's default
pays for each fresh gradient, and a reference count per parameter per forward.

A storage resized to 0 under a live tensor is a crash on access, so a bucket stays resident wherever anything
else may read it (``_held_elsewhere``): a ``.grad`` that is a slot (``zero_grad(set_to_none=False)``, no
``zero_grad`` at all, ``zero_grad`` called after the forward), a slot, the bucket or its flat buffer kept by
user code or a comm hook's state, any other tensor made on its storage.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from lockstep.ddp.reducer_state import Bucket
from lockstep.ddp.step import COPY

# sys.getrefcount of a tensor only the bucket holds, read as ``_held_elsewhere`` reads it: a slot (the list's
# entry, the loop's name, the call's argument); the flat view (the bucket's attribute, the argument). A tensor
# held from C++ (a ``.grad``, a work) has its Python object referenced once more while it is.
_SLOT_REFS, _ATTR_REFS = 3, 2


def release_idle(buckets: Sequence[Bucket], mode: str) -> int:
    """At a synchronised forward's start: give back the storage of every bucket nothing but the reducer holds
    (bucket-view modes only: in COPY mode ``.grad`` is never a slot, and the fast path keeps the views).
    Returns the bytes given back."""
    if mode == COPY:
        return 0
    released = 0
    for bucket in buckets:
        if bucket.released or bucket.plan.sparse:
            continue
        work = bucket.work
        if work is not None:
            if _in_flight(work):
                continue
            # Its last work, finished at the end of the last backward, holds the buffer (and so keeps its Python
            # object referenced): let go of it now rather than at the next backward's start (``lifetime``: a
            # finished work may be dropped at any time).
            bucket.work = work = None
        if _held_elsewhere(bucket):
            continue
        storage = bucket.buffer.untyped_storage()
        released += storage.nbytes()
        storage.resize_(0)
        bucket.released = True
    return released


def ensure_resident(bucket: Bucket) -> None:
    """Before anything writes the bucket: its storage back, if ``release_idle`` gave it away (contents undefined:
    every slot is written before the bucket is sent)."""
    if bucket.released:
        buffer = bucket.buffer
        buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        bucket.released = False


def _in_flight(work: object) -> bool:
    is_completed = getattr(work, "is_completed", None) or getattr(work, "done", None)
    return is_completed is not None and not is_completed()


def _held_elsewhere(bucket: Bucket) -> bool:
    """Whether a tensor or a Python reference outside the reducer may read the bucket's memory.

    Two counts, both exact: Python references to each of the bucket's own tensors (a ``.grad`` that is a slot
    holds one: autograd keeps the slot's Python object alive), and the tensors on the bucket's storage (another
    view, ``p.grad.view(-1)``, a hook's ``gradients()``), against what the bucket itself made.
    """
    getrefcount = sys.getrefcount
    # The buffer itself is not checked: it is never handed out, and the slots, views of it, hold it from C++ (a
    # view keeps its base), which keeps its Python object referenced once more; a tensor made on it shows below.
    if getrefcount(bucket.flat) > _ATTR_REFS:  # what a comm hook gets as its bucket's buffer()
        return True
    for view in bucket.views:
        if getrefcount(view) > _SLOT_REFS:
            return True
    own_tensors = 2 + len(bucket.views)  # buffer, flat, the slots
    compressed = bucket.compressed
    if compressed is not None and compressed.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr():
        # ``fused_compress``'s wire view of the buffer's bytes, its slots, and the buffer seen as the wire dtype that
        # it is a slice of (a view across dtypes is a base of its own, which the slice holds).
        base = compressed._base
        own_tensors += 1 + len(bucket.compressed_views) + (base is not None and base is not bucket.buffer)
    storage = bucket.buffer.untyped_storage()
    # + 1: ``storage``, the Python object just made, holds the storage too.
    return torch._C._storage_Use_Count(storage._cdata) > own_tensors + 1
