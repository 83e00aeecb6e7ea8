"""What a re-formation of the in-place group tells its caller: ``Regrouped``, and the errors that carry it.

Every part of in-place recovery (the step commit, re-forming the group, admitting a node) ends in one ``Regrouped``:
the new generation, this rank's place in it, and the step every member now stands at. The caller (the Trainer, or a
script's ``InPlaceRecovery``) re-binds and re-deals from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Regrouped:
    """What the survivors agreed on: the new generation, this rank's place in it, and the step to go on from."""

    generation: int
    rank: int
    world_size: int
    old_world_size: int
    left: list[int]  # the launch ranks that left
    committed: int  # the step every survivor now stands at
    rolled_forward: bool  # this rank applied the agreed step itself (its commit failed after the others')
    alarm_at: float  # wall time of the first alarm (time.time()); of the decision to grow, for a grow
    joined: tuple[int, ...] = ()  # the ids of the newcomers admitted (a grow: ``left`` is empty then)
    joiners_t0: float | None = None  # a grow: wall time the newcomers' launcher started (the earliest)
    newcomer: bool = False  # this process is one of ``joined``: it takes the state from rank 0


class PeerLost(RuntimeError):
    """A peer was lost and the survivors re-formed the group: ``outcome`` says how (``Regrouped``)."""

    def __init__(self, outcome: Regrouped):
        super().__init__(f"lost rank(s) {outcome.left}: the group re-formed at world size {outcome.world_size}")
        self.outcome = outcome


class PeersJoined(PeerLost):
    """Nodes came back and joined at a step boundary: the group grew (``outcome.joined``) and the newcomers hold
    this job's state. A ``PeerLost``, so a loop that catches that iterates the loader again, at the new size."""

    def __init__(self, outcome: Regrouped):
        RuntimeError.__init__(self, f"rank(s) {list(outcome.joined)} joined: the group re-formed at world size "
                                    f"{outcome.world_size}")
        self.outcome = outcome
