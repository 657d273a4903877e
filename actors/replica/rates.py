"""A replica's learning rate, step by step: optimizer.schedule's factor at the replica's
optimizer step (policies/rules/recipe.py Schedule), times a resize's linear-scaling ramp in modes with
a global batch (policies/decisions/lr_scaling.py), put into the mode's worker before each step."""
from __future__ import annotations

from typing import Any, Optional

from policies.decisions.lr_scaling import warmup_lr
from policies.rules.recipe import Schedule


class Rates:
    def __init__(self, schedule: Optional[dict[str, Any]], steps: int) -> None:
        self.schedule = Schedule(schedule, steps) if schedule else None
        self.ramp: Optional[dict[str, float]] = None  # a resize's learning-rate factor (set_lr_scale)

    @property
    def moving(self) -> bool:
        """The rate changes from step to step (a schedule, or a resize's ramp)."""
        return self.schedule is not None or self.ramp is not None

    def factor(self, step: int, global_batch: bool) -> float:
        """optimizer.lr's factor for optimizer step `step`."""
        factor = self.schedule.factor(step) if self.schedule is not None else 1.0
        if self.ramp is not None and global_batch:
            r = self.ramp
            factor *= warmup_lr(r["target"], r["start"], step - r["from_step"], int(r["steps"]))
        return factor

    def apply(self, worker: Any, lr: float, step: int, global_batch: bool) -> None:
        """The rate of step `step` into the worker's local optimizer (downpour: the factor its
        local steps and its pushes carry to the shards); `lr`: optimizer.lr of the phase."""
        if worker is None or not self.moving:
            return
        factor = self.factor(step, global_batch)
        if hasattr(worker, "lr_factor"):
            worker.lr_factor = factor
        opt = getattr(worker, "optimizer", None)
        if opt is not None:
            for group in opt.param_groups:
                group["lr"] = lr * factor

    @staticmethod
    def current(worker: Any, lr: float) -> Optional[float]:
        """The rate of the next step: the local optimizer's, or (downpour) the shards' for this
        replica's pushes (None: neither)."""
        opt = getattr(worker, "optimizer", None)
        if opt is not None:
            return float(opt.param_groups[0]["lr"])
        if hasattr(worker, "lr_factor"):
            return float(lr * worker.lr_factor)
        return None
