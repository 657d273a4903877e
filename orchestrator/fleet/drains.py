"""Preemption notices. A spot instance's notice reaches Ray as a drain of its node (the
autoscaler's, or `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds N`): the node keeps running its actors, takes no new ones, and goes
at the deadline. `DrainWatch` looks at the nodes being drained every DRAIN_POLL_S from the
Running loop (one thread, bounded: checks.Lane) so the controller moves the work off them
before the deadline (orchestrator/control/reconfig/evacuate.py)."""
from __future__ import annotations

import time
from typing import Optional

from orchestrator.checks import Lane

DRAIN_POLL_S = 1.0  # how often the nodes being drained are looked at
LOOK_TIMEOUT_S = 5.0


def draining_nodes() -> dict[str, int]:
    """{node id hex: deadline in ms since the epoch, 0 for none} of the nodes Ray is draining."""
    from ray._private.state import state

    return dict(state.get_draining_nodes())


class DrainWatch:
    def __init__(self, look=draining_nodes) -> None:
        self._look = look  # () -> {node id hex: deadline in ms since the epoch, 0 for none}
        self.lane = Lane("drain notices")
        self._next = 0.0
        self.draining: dict[str, float] = {}  # node id hex -> deadline (wall-clock seconds; 0: none)
        self.first_seen: dict[str, float] = {}  # node id hex -> when this run first saw it drained (wall clock)
        self.failed: Optional[str] = None  # why the last look failed (the view before it is kept)
        self.driver_node: Optional[str] = None  # the node this driver runs on (asked at the first need)
        self.driver_seen = False  # the drain of the driver's own node was reported
        self.driver_checkpoints = 0  # checkpoints taken for it (policies/decisions/checkpointing.py: due_for_drain)

    def look(self, now: Optional[float] = None) -> dict[str, float]:
        """The nodes being drained and their deadlines, looked at again once DRAIN_POLL_S has
        passed since the last look (a failed look keeps the last view and says why in `failed`)."""
        now = time.monotonic() if now is None else now
        if now >= self._next:
            self._next = now + DRAIN_POLL_S
            try:
                self.draining = {node: ms / 1000.0 for node, ms in self.lane.call(self._look, LOOK_TIMEOUT_S,
                                                                                    "the nodes being drained").items()}
                self.failed = None
                for node in self.draining:
                    self.first_seen.setdefault(node, time.time())
            except Exception as exc:  # noqa: BLE001 - a look that failed is not the run's failure
                self.failed = f"{type(exc).__name__}: {exc}"
        return self.draining

    def driver_deadline(self) -> Optional[float]:
        """The deadline of the driver's own node when it is being drained (0: none given), else
        None (in the last look's view)."""
        if self.driver_node is None:
            import ray

            self.driver_node = ray.get_runtime_context().get_node_id()
        return self.draining.get(self.driver_node)


def on_draining(nodes: dict[int, str], members: list[int], draining: dict[str, float]) -> dict[int, str]:
    """The members whose node is being drained: rank -> node id (pure)."""
    return {r: nodes[r] for r in members if nodes.get(r) in draining}
