"""What a call to one actor came to, as a value: the group's calls to many replicas return one
per rank, and the failure policy is handed every death and hang among them, none guessed from
an exception that happened to surface first."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OK, DIED, HUNG, RAISED = "ok", "died", "hung", "raised"


@dataclass(frozen=True)
class Outcome:
    status: str  # ok | died (its actor is gone) | hung (no answer in time) | raised (the call failed)
    value: Any = None  # the answer, when ok
    detail: str = ""  # what went wrong, otherwise
    actor_error: bool = False  # raised with an actor's death in it (its own, or an input's maker's)

    @property
    def ok(self) -> bool:
        return self.status == OK
