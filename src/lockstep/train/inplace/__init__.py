"""In-place recovery: when a peer is lost mid-step, the survivors re-form the group in the same processes.

The one idea is the step commit (group.py): every rank applies its optimizer step only after a one-element
all-reduce that it enters once its gradient collectives returned, so a commit that completed anywhere proves every
rank's averages complete. When a collective fails, the survivors agree on who is left and on the step (regroup.py),
roll forward or back to it, and form generation g+1; the caller re-binds its DDP and re-deals the rest of the epoch
at the new size (recovery.py). A node that comes back is admitted at a step boundary the commit agreed on and
handed rank 0's state (admission.py, recovery.py). The store itself may go with node 0: the survivors move to a
standby store (store_move.py). Gloo cannot abort an operation in flight, so a watcher thread ends it the way a dead
peer would, by shutting the group's sockets (watcher.py). docs/preemptible.md shows it.

The parts, each one concept:

- ``group``: ``InPlaceGroup``, the default group generation by generation, and the step commit;
- ``regroup``: re-forming the group after a failed collective (check-in, the decision, what is no lost peer);
- ``admission``: admitting a node (the newcomers waiting in the store, rank 0's decision to grow);
- ``store_move``: the workers' store, the standby stores, the move when the store's node goes, the quorum after;
- ``watcher``: the heartbeat, the alarm, the socket shutdown;
- ``recovery``: ``Recovery``, the caller's side, written once (the Trainer and ``InPlaceRecovery`` hold one), and
  ``broadcast_state``;
- ``loop``: ``InPlaceRecovery``, a script's own loop;
- ``outcome``: ``Regrouped``, ``PeerLost``, ``PeersJoined``.
"""

from lockstep.train.inplace.group import InPlaceGroup, wanted
from lockstep.train.inplace.loop import InPlaceRecovery
from lockstep.train.inplace.outcome import PeerLost, PeersJoined, Regrouped
from lockstep.train.inplace.recovery import RecoveringLoop, Recovery, broadcast_state
from lockstep.train.inplace.store_move import may_go_on_without_store

__all__ = ["InPlaceGroup", "InPlaceRecovery", "PeerLost", "PeersJoined", "Recovery", "RecoveringLoop", "Regrouped",
           "broadcast_state", "may_go_on_without_store", "wanted"]
