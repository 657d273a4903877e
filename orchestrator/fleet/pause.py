"""The one pause gate: the partition server stops granting partitions, so the replicas pause at
their next partition boundary (allreduce: all after the same step).

    open --close()--> closed --open(share)--> open

Why the replicas pause is the Running state's, not the gate's (orchestrator/control/states.py:
`Pending.pause`: a mid-epoch switch, a grow's newcomers, an evacuation, a checkpoint inside the
epoch), set by whoever closed it; an interrupted run closes it too (RunContext.halt), with no
pause of the state's. Only one pause holds the gate at a time: `close()` sends nothing and
returns False while it is closed. `open()` lets the replicas go on; given `share`, it also says
how the rest of the epoch is leased (a switch into or out of a pinned mode), which is sent even
when the gate was open.
"""
from __future__ import annotations

import time
from typing import Any, Optional


class PauseGate:
    def __init__(self, server: Any = None) -> None:
        self.server = server  # the partition server's link (ServerLink), given once the run has started it
        self.closed = False
        self.closed_at = 0.0  # perf_counter when it last closed

    def close(self, timeout_s: Optional[float] = None) -> bool:
        """Pause the replicas; False (nothing sent) when the gate is already closed."""
        if self.closed:
            return False
        self.server.call("pause", True, **({"timeout_s": timeout_s} if timeout_s is not None else {}))
        self.closed, self.closed_at = True, time.perf_counter()
        return True

    def open(self, share: Optional[bool] = None) -> None:
        """Let the replicas go on (and, given `share`, lease the rest of the epoch that way)."""
        if not self.closed and share is None:
            return
        self.server.call("pause", False, **({"share": share} if share is not None else {}))
        self.closed = False
