"""StopPolicy: decides after each epoch whether the run ends, and says why."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class EpochSnapshot:
    epoch: int  # epochs completed
    test_accuracy: float
    elapsed_s: float  # seconds since training started


@dataclass(frozen=True)
class StopDecision:
    stop: bool
    reason: str  # the rule and the numbers, e.g. "epochs: 5 >= stop.epochs (5)"


CONTINUE = StopDecision(False, "")


@dataclass(frozen=True)
class StopPolicy:
    epochs: int
    target_accuracy: Optional[float] = None
    at_target: bool = True
    max_wall_s: Optional[float] = None

    def decide(self, snap: EpochSnapshot) -> StopDecision:
        if self.target_accuracy is not None and self.at_target and snap.test_accuracy >= self.target_accuracy:
            return StopDecision(True, f"target: test_accuracy {snap.test_accuracy:.4f} >= stop.target_accuracy ({self.target_accuracy})")
        if snap.epoch >= self.epochs:
            return StopDecision(True, f"epochs: {snap.epoch} >= stop.epochs ({self.epochs})")
        if self.max_wall_s is not None and snap.elapsed_s >= self.max_wall_s:
            return StopDecision(True, f"wall: {snap.elapsed_s:.1f}s >= stop.max_wall_s ({self.max_wall_s})")
        return CONTINUE
