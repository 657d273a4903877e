"""The run's reporting: MLflow (through the Tracker), the event log, the display, and callbacks.

Everything the controller tells the outside world goes through one `Reporter`, so a sweep's
reporter (or a test) plugs in as a callback instead of reading the controller's insides. A
callback is any object with optional `on_event(event: dict)`, `on_metrics(rows)` and
`on_state(change: dict)` methods (`on_state`: after every state change of the controller, with
the state left and the state entered, e.g. {"from": "Running", "to": "Reconfiguring", "plan":
"SwitchPlan", "epoch": 3}); a callback that raises is dropped with a warning, never the run.

`on_event` may return an action (`Action.STOP`, `Action.CHECKPOINT`, or their strings "stop",
"checkpoint"; None: nothing): the request is held (`requests`) for the policy that judges it:
a stop ends the run at the epoch's end (StopPolicy, the `stop` event names the callback), a
checkpoint is taken inside the epoch at the replicas' next pause (control/mid_epoch.py). Any
other value is a warning, and the callback is dropped.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional

from orchestrator.reporting.progress import ProgressDisplay
from orchestrator.reporting.tracking import Tracker


class Action(str, Enum):
    """What a callback's on_event may ask of the run."""

    STOP = "stop"
    CHECKPOINT = "checkpoint"


@dataclass
class Requests:
    """What the callbacks asked for that no policy has judged yet: for each action, who asked and
    after which event (the first to ask; None: nobody)."""

    stop: Optional[str] = None
    checkpoint: Optional[str] = None

    def ask(self, action: Action, who: str) -> None:
        if getattr(self, action.name.lower()) is None:
            setattr(self, action.name.lower(), who)

    def take(self, action: Action) -> Optional[str]:
        """Who asked for `action` (None: nobody), handed to the policy that judges it: asked no more."""
        who = getattr(self, action.name.lower())
        setattr(self, action.name.lower(), None)
        return who


class Reporter:
    def __init__(self, tracker: Optional[Tracker], display: Optional[ProgressDisplay], t0: float) -> None:
        self.tracker, self.display, self.t0 = tracker, display, t0
        self.callbacks: list[Any] = []
        self.requests = Requests()

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Record an event (events.jsonl in MLflow, the result JSON); stamped with the wall time."""
        fields.setdefault("t_wall", round(time.time(), 3))
        event = self.tracker.event(kind, self.t0, **fields) if self.tracker is not None else {"kind": kind, **fields}
        for cb, asked in self._call("on_event", event):
            if asked is None:
                continue
            try:
                action = Action(asked)
            except ValueError:
                print(f"warning: reporting callback {type(cb).__name__}.on_event returned {asked!r}, not an action "
                      f"({', '.join(a.value for a in Action)} or None); dropped", file=sys.stderr, flush=True)
                self.callbacks.remove(cb)
                continue
            self.requests.ask(action, f"{type(cb).__name__} after {kind}")
        return event

    def metrics(self, rows: list[tuple[str, float, int]]) -> None:
        if self.tracker is not None:
            self.tracker.log_metrics(rows)
        self._call("on_metrics", rows)

    def state(self, previous: Any, entered: Any) -> None:
        """The controller changed state: tell the callbacks that listen (on_state). Running
        handing itself on in the same epoch (what is pending changed, the epoch's streams opened,
        a further pass began) is no change of state."""
        if entered is previous or not any(hasattr(cb, "on_state") for cb in self.callbacks):
            return
        seg = getattr(entered, "segment", None)
        if type(entered) is type(previous) and seg is not None and seg.epoch == getattr(previous.segment, "epoch", None):
            return  # Running handing itself on (what is pending changed, its streams opened, a further pass)
        plan = getattr(entered, "plan", None)
        self._call("on_state", {"from": type(previous).__name__, "to": type(entered).__name__,
                                **({"plan": type(plan).__name__} if plan is not None else {}),
                                **({"epoch": seg.epoch} if seg is not None else {})})

    def say(self, text: str) -> None:
        if self.display is not None:
            self.display.line(text)

    def steps(self, epoch: int, step_in_epoch: int, loss: float, total: int) -> None:
        if self.display is not None:
            self.display.steps(epoch, step_in_epoch, loss, total)

    def _call(self, method: str, payload: Any) -> list[tuple[Any, Any]]:
        """Each callback's `method` on `payload`; (callback, what it returned) of those that ran."""
        returned = []
        for cb in list(self.callbacks):
            fn = getattr(cb, method, None)
            if fn is None:
                continue
            try:
                returned.append((cb, fn(payload)))
            except Exception as exc:
                print(f"warning: reporting callback {type(cb).__name__}.{method} failed ({exc}); dropped",
                      file=sys.stderr, flush=True)
                self.callbacks.remove(cb)
        return returned
