"""The failure policy: what to do when a replica dies, hangs or raises. Pure, no Ray.

The controller turns whatever it saw (an actor that died, a stream that stopped moving, an
exception from the user's model or data) into a `ReplicaFailure` value and asks
`FailurePolicy.decide`; the decision is one of:
- `Replace(rank, backoff_s)`: start a replacement (a spare, or a new actor) for that rank after
  `backoff_s`;
- `Drop(rank)`: go on without it (the replacement budget is spent and `scaling.min_replicas`
  allows a smaller group);
- `Fail(reason)`: end the run, saying what died and why.

Rules, in order (each decision's `reason` names the rule and its numbers):
1. An exception raised by user code on a replica that is itself a replacement, equal to the
   error that replaced its predecessor, ends the run: retrying a deterministic error forever
   helps nobody (`same error twice in a row on a fresh replica`).
2. While restarts used < `max_restarts`: replace, after `backoff_s * 2^(n-1)` (at most
   `MAX_BACKOFF_S`) where n counts replacements since the last epoch without a failure.
3. Else drop the replica if the group keeps at least `min_replicas`, else fail.
Before rule 2: a replica whose replacement cannot be placed (`placeable=False`: its node is
gone and the cluster has no room elsewhere, see orchestrator/control/reconfig/elastic.py) is dropped at once if
`min_replicas` allows (a shrink: `Drop.shrink`), else the run fails; no restart is spent on it
and no replacement waits for capacity that is not there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

MAX_BACKOFF_S = 30.0
CAUSES = ("died", "hung", "error", "preempted")  # preempted: moved off a drained node, not a failure (reconfig/evacuate.py)


@dataclass(frozen=True)
class ReplicaFailure:
    rank: int
    cause: str  # died: the process or node is gone; hung: no progress for hang_timeout_s; error: user code raised
    detail: str  # one line: what was seen
    traceback: str = ""  # cause "error": the replica's traceback
    replacement: bool = False  # the failed replica was itself started to replace one

    def __post_init__(self) -> None:
        if self.cause not in CAUSES:
            raise ValueError(f"cause must be one of {CAUSES}, got {self.cause!r}")


@dataclass(frozen=True)
class Replace:
    rank: int
    backoff_s: float
    reason: str


@dataclass(frozen=True)
class Drop:
    rank: int
    reason: str
    shrink: bool = False  # the cluster had no room for a replacement (not a spent restart budget)


@dataclass(frozen=True)
class Fail:
    reason: str


Decision = Union[Replace, Drop, Fail]


@dataclass
class FailurePolicy:
    max_restarts: int
    backoff_s: float = 0.0
    min_replicas: int = 1
    restarts: int = 0  # replacements made this run
    in_a_row: int = 0  # replacements since the last epoch without a failure
    last_error: dict[int, str] = field(default_factory=dict)  # rank -> the error that replaced its replica

    def decide(self, failure: ReplicaFailure, survivors: int, placeable: bool = True,
               capacity_note: str = "") -> Decision:
        """`survivors`: replicas still alive besides the failed one. `placeable`: a replacement
        could be placed now (a spare, or room in the cluster); `capacity_note` says what was seen."""
        what = f"replica {failure.rank} {failure.cause} ({failure.detail})"
        if not placeable:
            note = f": {capacity_note}" if capacity_note else ""
            if survivors >= self.min_replicas:
                return Drop(failure.rank, f"SHRINK: {what}; no room for a replacement{note}; {survivors} replicas "
                                          f">= min_replicas {self.min_replicas}", shrink=True)
            return Fail(f"{what}; no room for a replacement{note} and {survivors} replicas left < "
                        f"scaling.min_replicas {self.min_replicas}")
        if failure.cause == "error":
            previous = self.last_error.get(failure.rank)
            if failure.replacement and previous == failure.detail:
                return Fail(f"{what}: the same error twice in a row on a fresh replica; not retried\n"
                            f"{failure.traceback}".rstrip())
            self.last_error[failure.rank] = failure.detail
        else:
            self.last_error.pop(failure.rank, None)
        if self.restarts < self.max_restarts:
            self.restarts += 1
            self.in_a_row += 1
            backoff = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (self.in_a_row - 1)) if self.backoff_s else 0.0
            return Replace(failure.rank, backoff,
                           f"REPLACE: {what}; restarts {self.restarts} of max_replica_restarts {self.max_restarts}")
        if survivors >= self.min_replicas:
            return Drop(failure.rank, f"DROP: {what}; max_replica_restarts ({self.max_restarts}) spent, "
                                      f"{survivors} replicas >= min_replicas {self.min_replicas}")
        return Fail(f"{what}; max_replica_restarts ({self.max_restarts}) spent and {survivors} replicas left < "
                    f"scaling.min_replicas {self.min_replicas}" +
                    (f"\n{failure.traceback}".rstrip() if failure.traceback else ""))

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the policy, so a resumed run has the budget it had left."""
        return {"restarts": self.restarts, "in_a_row": self.in_a_row,
                "last_error": {str(r): e for r, e in self.last_error.items()}}

    def load_state_dict(self, position: dict) -> None:
        self.restarts, self.in_a_row = int(position["restarts"]), int(position["in_a_row"])
        self.last_error = {int(r): e for r, e in position.get("last_error", {}).items()}

    def epoch_without_failure(self) -> None:
        """The backoff starts over after an epoch with no failure."""
        self.in_a_row = 0


def error_detail(exc_type: str, message: str) -> str:
    """The line two errors are compared by: the exception type and its message's first line."""
    first = (message or "").strip().splitlines()
    return f"{exc_type}: {first[0] if first else ''}".strip()


# how each cause is seen, for the replica_failed event
DETECTED_BY = {"died": "actor died (its epoch stream failed)", "error": "exception raised in the replica",
               "hung": "no progress for fault_tolerance.hang_timeout_s",
               "preempted": "its node is being drained (a preemption notice)"}
