"""StopPolicy: decides after each epoch whether the run ends, and says why."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class EpochSnapshot:
    epoch: int  # epochs completed
    metrics: dict[str, float] = field(default_factory=dict)  # the epoch's task metrics and train_loss
    elapsed_s: float = 0.0  # seconds since training started
    asked: Optional[str] = None  # a callback asked the run to stop: who, after which event
    steps: int = 0  # the model's updates so far (the replicas stop at stop.max_steps, inside an epoch)


@dataclass(frozen=True)
class Target:
    """A metric and the value that counts as reached: at or above it (goal max) or at or below
    it (goal min)."""

    metric: str
    goal: str  # "max" | "min"
    value: float

    def reached(self, metrics: dict[str, float]) -> bool:
        x = metrics.get(self.metric)
        if x is None or x != x:  # missing or nan: not reached
            return False
        return x >= self.value if self.goal == "max" else x <= self.value

    def describe(self) -> str:
        return f"{self.metric} {'>=' if self.goal == 'max' else '<='} {self.value:g}"


@dataclass(frozen=True)
class StopDecision:
    stop: bool
    reason: str  # the rule and the numbers, e.g. "epochs: 5 >= stop.epochs (5)"


CONTINUE = StopDecision(False, "")


@dataclass(frozen=True)
class StopPolicy:
    epochs: int
    target: Optional[Target] = None
    at_target: bool = True
    max_wall_s: Optional[float] = None
    max_steps: Optional[int] = None

    def decide(self, snap: EpochSnapshot) -> StopDecision:
        if snap.asked is not None:
            return StopDecision(True, f"callback: {snap.asked} asked to stop")
        t = self.target
        if t is not None and self.at_target and t.reached(snap.metrics):
            return StopDecision(True, f"target: {t.metric} {snap.metrics[t.metric]:.4f} "
                                      f"{'>=' if t.goal == 'max' else '<='} stop.target ({t.value:g})")
        if self.max_steps is not None and snap.steps >= self.max_steps:
            return StopDecision(True, f"max_steps: {snap.steps} >= stop.max_steps ({self.max_steps})")
        if snap.epoch >= self.epochs:
            return StopDecision(True, f"epochs: {snap.epoch} >= stop.epochs ({self.epochs})")
        if self.max_wall_s is not None and snap.elapsed_s >= self.max_wall_s:
            return StopDecision(True, f"wall: {snap.elapsed_s:.1f}s >= stop.max_wall_s ({self.max_wall_s})")
        return CONTINUE


@dataclass
class ChanceWatch:
    """A classification run whose test loss sits at chance level, ln K for K classes (the loss
    of predicting every class alike), at `patience` epoch ends in a row after it had learned
    (test loss below half of ln K once) has diverged as surely as one whose loss is not finite:
    `observe` says why, else None."""

    classes: int
    patience: int = 2
    at_chance: float = 0.98  # a loss at or above this fraction of ln K is at chance level
    learned: bool = False
    streak: int = 0

    def observe(self, test_loss: float) -> Optional[str]:
        import math

        chance = math.log(self.classes)
        if test_loss == test_loss and test_loss < 0.5 * chance:
            self.learned, self.streak = True, 0
            return None
        self.streak = self.streak + 1 if self.learned and not test_loss < self.at_chance * chance else 0
        if self.streak < self.patience:
            return None
        return (f"test loss {test_loss:.4f} at chance level (ln {self.classes} = {chance:.4f}: every class alike) "
                f"at {self.streak} epoch ends in a row, after it had been below {0.5 * chance:.4f}")


@dataclass
class BestWatch:
    """The headline metric's best epoch so far, for checkpoint.keep_best and
    stop.early_stopping: an epoch is better when it beats the best by more than `min_delta`
    in the metric's direction (`goal` max or min). `patience`: epochs without such a gain
    before early stopping says stop (None: never). A checkpoint part (`position`/`restore`),
    so a resumed run goes on counting."""

    metric: str
    goal: str  # "max" | "min"
    min_delta: float = 0.0
    patience: Optional[int] = None
    best: Optional[float] = None
    best_epoch: int = 0
    since: int = 0  # epochs since the best

    def observe(self, epoch: int, metrics: dict[str, float]) -> bool:
        """Take an epoch's metrics; True when it is the new best (a NaN or missing value never is)."""
        x = metrics.get(self.metric)
        if x is None or x != x:
            self.since += 1
            return False
        better = (self.best is None or (x > self.best + self.min_delta if self.goal == "max"
                                        else x < self.best - self.min_delta))
        if better:
            self.best, self.best_epoch, self.since = float(x), epoch, 0
        else:
            self.since += 1
        return better

    def stop(self) -> Optional[StopDecision]:
        """Early stopping's decision, when `patience` epochs went by without a gain."""
        if self.patience is None or self.best is None or self.since < self.patience:
            return None
        return StopDecision(True, f"early stopping: {self.metric} has not improved on {self.best:.4f} (epoch "
                                  f"{self.best_epoch}) by more than {self.min_delta:g} for {self.since} epochs "
                                  f"(stop.early_stopping.patience {self.patience})")

    def state_dict(self) -> dict:
        return {"best": self.best, "best_epoch": self.best_epoch, "since": self.since}

    def load_state_dict(self, saved: Optional[dict]) -> None:
        if saved:
            self.best, self.best_epoch, self.since = saved["best"], saved["best_epoch"], saved["since"]
