"""The suite's levels: what the README's test command runs, and the heavier cases behind switches.

The README's command stays under 15 minutes on a loaded 2-core machine. A case that repeats what a cheaper one already
covers (another variant of a library run, torch's DDP-under-RPC suite beside lockstep's own RPC checks, a 4-rank
oversubscribed run beside the 3-rank one, the rarer exit paths) runs only with ``LOCKSTEP_FULL=1``. The other
switches (``LOCKSTEP_MULTINODE_FULL``, ``LOCKSTEP_COMPILED_LIBRARIES``, ``LOCKSTEP_KILL_RUNS``,
``LOCKSTEP_EXIT_RUNS``) each raise one family; tests/README.md lists them with their cost.
"""

from __future__ import annotations

import os

import pytest

FULL = os.environ.get("LOCKSTEP_FULL") == "1"


def full_only(cost: str) -> pytest.MarkDecorator:
    """Skip unless ``LOCKSTEP_FULL=1``; ``cost`` says what running it costs (shown in the skip reason)."""
    return pytest.mark.skipif(not FULL, reason=f"{cost}: set LOCKSTEP_FULL=1")
