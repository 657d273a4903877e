"""The one pause gate: the partition server stops granting partitions, so the replicas pause at
their next partition boundary (allreduce: all after the same step), and the gate says why.

    open  --close("switch")--> a mid-epoch phase switch is waited for     (orchestrator/control/reconfig/phase_switch.py)
          --close("grow")-->   ready newcomers join the running epoch     (orchestrator/control/reconfig/elastic.py)
          --close("halt")-->   an interrupted run stops for its checkpoint (RunContext.halt)
          --close("evacuate")--> members on a drained node move off it (orchestrator/control/reconfig/evacuate.py)
          --close("checkpoint")--> a checkpoint is taken inside the epoch (orchestrator/control/mid_epoch.py)

Only one reason holds the gate at a time: a switch is not decided while a grow holds it, and a
grow does not close it while a switch is pending. `open()` lets the replicas go on; given
`share`, it also says how the rest of the epoch is leased (a switch into or out of a pinned
mode), which is sent even when the gate was open.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

REASONS = ("switch", "grow", "halt", "evacuate", "checkpoint")


class PauseGate:
    def __init__(self, server: Callable[[], Any]) -> None:
        self._server = server  # the controller's ServerLink (it exists once the run has started)
        self.reason: Optional[str] = None
        self.closed_at = 0.0  # perf_counter when it last closed

    @property
    def closed(self) -> bool:
        return self.reason is not None

    def close(self, reason: str, timeout_s: Optional[float] = None) -> bool:
        """Pause the replicas for `reason`; False (nothing sent) when the gate is already closed."""
        if reason not in REASONS:
            raise ValueError(f"reason must be one of {REASONS}, got {reason!r}")
        if self.closed:
            return False
        self._server().call("pause", True, **({"timeout_s": timeout_s} if timeout_s is not None else {}))
        self.reason, self.closed_at = reason, time.perf_counter()
        return True

    def open(self, share: Optional[bool] = None) -> None:
        """Let the replicas go on (and, given `share`, lease the rest of the epoch that way)."""
        if not self.closed and share is None:
            return
        self._server().call("pause", False, **({"share": share} if share is not None else {}))
        self.reason = None
