"""The optimizer's config sections: its class and arguments, clipping, and its learning-rate schedule."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, field_validator, model_validator

from orchestrator.config.sections import Section


class ScheduleConfig(Section):
    """A factor on optimizer.lr by optimizer step (policies/rules/recipe.py Schedule, docs/training.md)."""

    name: str = Field(
        "constant", min_length=1, description="constant, linear, cosine, step or exponential; any "
        "torch.optim.lr_scheduler class by name (e.g. OneCycleLR, with its arguments in kwargs); or "
        "'module:function' called as function(step, steps) -> factor, counted after the warm-up."
    )
    warmup: float = Field(
        0, ge=0, description="Warm-up steps, the factor rising linearly to 1: < 1 a fraction of the run's planned "
        "optimizer steps, >= 1 a count."
    )
    min_factor: float = Field(
        0.0, ge=0, le=1, description="The floor: linear and cosine end at it, no schedule goes below it."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="step: step_size (default a third of the steps) and gamma (0.1); "
        "exponential: gamma (0.999); a torch.optim.lr_scheduler class: its own arguments."
    )

    @model_validator(mode="after")
    def _known(self) -> "ScheduleConfig":
        from policies.rules.recipe import RecipeError, Schedule

        try:
            schedule = Schedule(self.model_dump(), 1000)
            schedule.factor(schedule.warmup)  # the first step after the warm-up: built and called once
        except RecipeError as exc:
            raise ValueError(str(exc).removeprefix("config error: optimizer.schedule.name: ")
                             .removeprefix("config error: optimizer.schedule: ")) from None
        return self


class OptimizerConfig(Section):
    name: str = Field(
        "sgd", min_length=1, description="Any torch.optim class by its lower-case name (sgd, adamw, adam, rmsprop, "
        "nadam, adagrad, ...) or 'module:Class' (a torch.optim.Optimizer subclass). allreduce and local SGD replicas "
        "step with it; downpour shards apply it to their slices (an element-wise optimizer shards exactly; lbfgs, "
        "adafactor, muon and sparseadam are refused there); easgd replicas take their local steps with it (sgd: "
        "plain or, with strategy.momentum > 0, EAMSGD's Nesterov momentum; others need strategy.momentum 0)."
    )
    lr: float = Field(0.05, gt=0, description="Learning rate (per step, for the global batch).")
    momentum: float = Field(
        0.9, ge=0, lt=1, description="SGD momentum (sgd in allreduce and on downpour shards; easgd uses "
        "strategy.momentum instead); other optimizers take theirs in kwargs."
    )
    weight_decay: float = Field(0.0, ge=0, description="The optimizer's own weight decay (an L2 penalty added to the "
                                "gradient for sgd and adam, decoupled for adamw).")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="More arguments for the optimizer's class, e.g. {betas: [0.9, 0.95], "
        "eps: 1e-8} for adamw."
    )
    no_decay: list[str] = Field(
        default_factory=list, description="Parameters that take no weight decay: one whose name, or whose module's "
        "class name, holds one of these (case-insensitive), e.g. [bias, norm] (biases and LayerNorm/RMSNorm weights). "
        "They form a second parameter group with weight_decay 0. In the modes whose replicas step their own "
        "optimizer (allreduce, fsdp, local_sgd, gossip, easgd); refused in the others (their shards update flat "
        "slices, which have no names)."
    )
    schedule: Optional[ScheduleConfig] = Field(
        None, description="{name, warmup, min_factor, kwargs}: the learning rate's factor by optimizer step, the "
        "same clock in every mode, e.g. {name: cosine, warmup: 0.05, min_factor: 0.1}; a resize's linear scaling "
        "multiplies it. Default: constant."
    )
    clip_grad_norm: Optional[float] = Field(
        None, gt=0, description="Cap the gradient's global 2-norm at this: the reduced gradient in allreduce (equal "
        "to clipping in one process), each step's own gradient in the other modes. The norm before clipping is "
        "logged (grad_norm) either way."
    )

    @field_validator("name")
    @classmethod
    def _resolvable(cls, v: str) -> str:
        from policies.rules.recipe import RecipeError, optimizer_class

        try:
            optimizer_class(v)
        except RecipeError as exc:
            raise ValueError(str(exc).removeprefix("config error: optimizer.name: ")) from None
        return v
