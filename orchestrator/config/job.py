"""The job config: typed, validated, documented; YAML is a view of these models.

Every field carries a one-line description (docs/config.md, written by orchestrator/cli/config_docs.py). Unknown keys are errors.
`JobConfig.from_yaml(path, overrides)` is the one way in from the outside world; it raises
`ConfigError` with a single line naming the field or file on bad input.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import yaml
from pydantic import Field, ValidationError, model_validator

from orchestrator.errors import ConfigError

from orchestrator.config.sections import (CheckpointConfig, DataConfig, EvalConfig, ModelConfig, RunConfig, Section,
                                          StopConfig, TaskConfig, TrackingConfig)
from orchestrator.config.optim import OptimizerConfig
from orchestrator.config.fleet import FaultsConfig, FaultToleranceConfig, ScalingConfig
from orchestrator.config.strategy import UNTIL_COUNTS, StrategyConfig
from orchestrator.config.yaml_file import DuplicateKey, load_text, read_mapping, yaml_shape_problem
from policies.decisions.stop import Target
from policies.rules.registry import mode_spec
from policies.rules.tasks import primary_metric, split_metric


class JobConfig(Section):
    """A whole job. Build it in Python, or load it from YAML with `JobConfig.from_yaml`."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="What to train.")
    task: TaskConfig = Field(default_factory=TaskConfig, description="What is learned and how it is judged.")
    data: DataConfig = Field(default_factory=DataConfig, description="What to train on.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="How to step.")
    strategy: StrategyConfig = Field(default_factory=StrategyConfig, description="How replicas synchronize.")
    scaling: ScalingConfig = Field(default_factory=ScalingConfig, description="How many replicas, how big.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="When to evaluate besides each epoch's end.")
    stop: StopConfig = Field(default_factory=StopConfig, description="When to stop.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    run: RunConfig = Field(default_factory=RunConfig, description="The run's name (resume by name).")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    fault_tolerance: FaultToleranceConfig = Field(
        default_factory=FaultToleranceConfig, description="What happens when replicas or shards fail."
    )
    faults: FaultsConfig = Field(default_factory=FaultsConfig, description="Fault injection for experiments.")

    @model_validator(mode="after")
    def _mode_fits(self) -> "JobConfig":
        from policies.rules.recipe import shardable

        why = shardable(self.optimizer.name)
        if self.optimizer.name == "lbfgs" and self.strategy.modes() != ["sandblaster"]:
            raise ValueError("optimizer.name: lbfgs needs a closure that re-evaluates the whole batch's loss, which no "
                             "mode's step gives; choose a first-order optimizer (sgd, adamw, ...), or strategy.mode "
                             "sandblaster (full-batch L-BFGS over the replicas)")
        unused = self.strategy.unused_option()
        if unused is not None:
            raise ValueError(unused)
        if "sandblaster" in self.strategy.modes():
            refusals = [(len(self.strategy.plan()) > 1, "is one mode for the whole run (no strategy.phases or switch): "
                         "its L-BFGS history lives on the shards and means nothing to another mode"),
                        (self.checkpoint.every_steps > 0 or self.checkpoint.every_s > 0,
                         "checkpoints at pass (epoch) ends only: set checkpoint.every_steps and every_s to 0 (a pass's "
                         "task sums are not in a checkpoint)"),
                        (self.model.precision == "fp16", "takes model.precision fp32 or bf16 (fp16's loss scaler is not "
                         "applied to the summed gradients it pushes)"),
                        (self.optimizer.schedule is not None, "takes no optimizer.schedule (its step is L-BFGS's: "
                         "strategy.step_size)"),
                        (self.data.adaptive_batch is not None, "takes no data.adaptive_batch (each pass's gradient is "
                         "the whole epoch's)")]
            refused = next((reason for bad, reason in refusals if bad), None)
            if refused is not None:
                raise ValueError(f"strategy.mode sandblaster {refused}")
        if "fsdp" in self.strategy.modes():
            refusals = [(len(self.strategy.plan()) > 1, "is one mode for the whole run (no strategy.phases or switch): "
                         "its state is split across the replicas, which no other mode takes"),
                        (self.model.precision == "fp16", "takes model.precision fp32 or bf16 (fp16's loss scaler is "
                         "not applied to split gradients)"),
                        (self.model.compile, "does not take model.compile (the model is rebuilt and re-sharded on a regroup)")]
            refused = next((reason for bad, reason in refusals if bad), None)
            if refused is not None:
                raise ValueError(f"strategy.mode fsdp {refused}")
        pushed = [m for m in ("downpour", "hogwild") if m in self.strategy.modes()]
        if pushed and why is not None:
            raise ValueError(f"optimizer.name: {pushed[0]}'s shards apply the optimizer to their slices, and "
                             f"{self.optimizer.name} {why}; choose an element-wise one (sgd, adamw, adagrad, ...)")
        if "hogwild" in self.strategy.modes() and self.scaling.shards != 1:
            raise ValueError(f"scaling.shards: hogwild keeps the whole parameter vector in one shard's shared memory; "
                             f"set it to 1 (got {self.scaling.shards})")
        return self

    @model_validator(mode="after")
    def _one_validation_split(self) -> "JobConfig":
        if self.data.val_fraction > 0 and self.data.val_source is not None:
            raise ValueError("data.val_source: a validation set is given, so data.val_fraction must stay 0 (choose one)")
        return self

    @model_validator(mode="after")
    def _metrics_known(self) -> "JobConfig":
        """stop.target's metric and each phase's `until` metric are ones the task produces."""
        try:
            task = self.task.build()
        except ValueError as exc:
            raise ValueError(f"task.name: {exc}") from None
        known = self.judged_goals(task)
        names = ", ".join(known)
        target = self.target()
        if target is not None and target.metric not in known:
            held = (f" (with data.val_fraction the run is judged on the validation split: "
                    f"{split_metric(target.metric, 'val')})") if self.validated and target.metric in task.goals else ""
            raise ValueError(f"stop.target.metric: the {self.task.name} task has no metric {target.metric!r} to judge "
                             f"during the run{held}; choose one of {names}")
        watch = self.stop.watch
        if watch is not None and watch.metric not in known:
            raise ValueError(f"stop.watch.metric: the {self.task.name} task has no metric {watch.metric!r} to judge "
                             f"during the run; choose one of {names}")
        for i, phase in enumerate(self.strategy.phases or []):
            key = next(iter(phase.until or {}), None)
            if key is not None and key not in UNTIL_COUNTS and key not in known:
                raise ValueError(f"strategy.phases[{i}].until: unknown condition {key!r}; choose one of "
                                 f"{', '.join(UNTIL_COUNTS)} or a metric of the {self.task.name} task ({names})")
        return self

    @property
    def validated(self) -> bool:
        """A validation split is held out (data.val_fraction) or given (data.val_source): the
        run is judged on it."""
        return self.data.val_fraction > 0 or self.data.val_source is not None

    @property
    def eval_split(self) -> str:
        """The split every evaluation during the run is on: "val" or "test"."""
        return "val" if self.validated else "test"

    def judged_goals(self, task: Any = None) -> dict[str, str]:
        """The metrics a run is judged by while it trains (targets, until, early stopping, the
        best checkpoint, sweeps), with their goals: the task's on the evaluated split, and
        train_loss."""
        task = task or self.task.build()
        return {**{split_metric(k, self.eval_split): g for k, g in dict(task.goals).items()}, "train_loss": "min"}

    def metric_goals(self) -> dict[str, str]:
        """Every metric name a run of this job produces, with its goal: the judged ones, and with
        a validation split the test split's too (evaluated once, at the end)."""
        task = self.task.build()
        return {**self.judged_goals(task), **(dict(task.goals) if self.validated else {})}

    def target(self) -> Optional[Target]:
        """stop.target, with stop.target_accuracy's shorthand on the evaluated split."""
        target = self.stop.the_target()
        if target is not None and self.stop.target_accuracy is not None:
            return Target(split_metric(target.metric, self.eval_split), target.goal, target.value)
        return target

    def headline_metric(self) -> str:
        """The metric the run is judged by: stop.target's, else the task's primary metric on the
        evaluated split (classification: test_accuracy, or val_accuracy with data.val_fraction)."""
        target = self.target()
        return target.metric if target is not None else split_metric(primary_metric(self.task.build()), self.eval_split)

    def watched(self) -> tuple[str, str]:
        """(metric, goal) early stopping and checkpoint.keep_best watch: stop.watch, else the
        headline metric with its goal."""
        watch = self.stop.watch
        metric = watch.metric if watch is not None else self.headline_metric()
        goal = watch.goal if watch is not None and watch.goal is not None else self.metric_goals()[metric]
        return metric, goal

    @model_validator(mode="after")
    def _optimizer_fits(self) -> "JobConfig":
        opt = self.optimizer
        flat = [m for m in dict.fromkeys(self.strategy.modes()) if not mode_spec(m).named_optimizer]
        if opt.no_decay and flat:
            raise ValueError(f"optimizer.no_decay: {', '.join(flat)} update{'s' if len(flat) == 1 else ''} flat slices "
                             "of the parameters on the shards, which have no names; no_decay is for allreduce, fsdp, "
                             "local_sgd, gossip and easgd")
        for phase in self.strategy.plan():
            if phase["mode"] == "easgd" and opt.name != "sgd" and phase["momentum"] > 0:
                raise ValueError(f"strategy.momentum is EAMSGD's Nesterov momentum for optimizer.name sgd; set it "
                                 f"to 0 with optimizer.name {opt.name} (got {phase['momentum']})")
        return self

    @model_validator(mode="after")
    def _max_steps_fits(self) -> "JobConfig":
        """stop.max_steps: the replicas stop themselves after that update, which they all count
        alike only in lock step."""
        if self.stop.max_steps is None:
            return self
        apart = [p["mode"] for p in self.strategy.plan()
                 if not mode_spec(p["mode"]).lock_step(p) or mode_spec(p["mode"]).coordinated]
        if apart:
            raise ValueError(f"stop.max_steps counts updates every replica takes together; {apart[0]} replicas "
                             "update the model each on its own: use stop.epochs or stop.max_wall_s")
        return self

    @model_validator(mode="after")
    def _scaling_fits(self) -> "JobConfig":
        backups = max((p["backup_replicas"] for p in self.strategy.plan() if p["mode"] == "allreduce"), default=0)
        if backups and backups >= self.scaling.replicas:
            implied = (" (strategy.adaptive.async_mode backup runs its straggler phase with at least 1)"
                       if self.strategy.switch == "adaptive" and self.strategy.adaptive.async_mode == "backup" else "")
            raise ValueError(f"strategy.backup_replicas ({backups}){implied} must be below scaling.replicas "
                             f"({self.scaling.replicas}): a step applies the first replicas - backup_replicas "
                             "gradients")
        missing = sorted(w.rank for w in self.faults.slow_replicas if w.rank >= self.scaling.replicas)
        if missing:
            raise ValueError(f"faults.slow_replicas: no replica of rank {missing[0]}; ranks are 0.."
                             f"{self.scaling.replicas - 1} (scaling.replicas {self.scaling.replicas})")
        return self

    @model_validator(mode="after")
    def _adaptive_batch_fits(self) -> "JobConfig":
        """data.adaptive_batch measures the noise across equal shares of one allreduce phase."""
        a, plan = self.data.adaptive_batch, self.strategy.plan()
        if a is None:
            return self
        phase = plan[0]
        refusals = [(len(plan) > 1 or phase["mode"] != "allreduce", "needs one allreduce phase (no strategy.phases or switch)"),
                    (phase["balance"] or phase["backup_replicas"], "needs equal shares (no strategy.balance or backup_replicas)"),
                    (self.scaling.replicas < 2, "needs scaling.replicas >= 2 (the noise is measured across replicas)"),
                    (phase["compression"] == "powersgd", "needs the replicas' own gradient norms, which strategy.compression "
                     "powersgd does not measure"),
                    (self.data.batch_size * a.factor > a.max, f"max ({a.max}) leaves no room to grow data.batch_size "
                     f"({self.data.batch_size}) by factor ({a.factor})")]
        why = next((reason for refused, reason in refusals if refused), None)
        if why is not None:
            raise ValueError(f"data.adaptive_batch: {why}")
        return self

    @model_validator(mode="after")
    def _replica_range(self) -> "JobConfig":
        s = self.scaling
        if s.min_replicas > s.replicas:
            raise ValueError(f"scaling.min_replicas ({s.min_replicas}) is more than scaling.replicas ({s.replicas}); "
                             "need min_replicas <= replicas <= max_replicas")
        if s.max_replicas is not None and s.max_replicas < s.replicas:
            raise ValueError(f"scaling.max_replicas ({s.max_replicas}) is less than scaling.replicas ({s.replicas}); "
                             "need min_replicas <= replicas <= max_replicas")
        return self

    @classmethod
    def from_dict(cls, raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> "JobConfig":
        """Validate a nested dict plus `section.key=value` overrides; ConfigError on bad input."""
        raw = apply_overrides(raw, overrides)
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc)) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> "JobConfig":
        """Load a YAML file (a missing or malformed file is a ConfigError naming the file)."""
        return cls.from_dict(read_mapping(os.fspath(path), "config file"), overrides)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """The config as `section.key -> value` (MLflow params)."""
        out: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict) and value:
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = value

        walk("", self.model_dump(mode="json"))
        return out


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Return a copy of `raw` with each `a.b.c=value` set; values are parsed as YAML scalars
    (so `0.1` is a float, `[1, 28, 28]` a list) and then coerced by the field's type."""
    import copy

    out = copy.deepcopy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        try:
            value = load_text(text) if text.strip() else ""
        except DuplicateKey as exc:
            raise ConfigError(f"--set {key}: {exc}") from None
        except (yaml.YAMLError, RecursionError):
            value = text
        why = yaml_shape_problem(value)
        if why:
            raise ConfigError(f"--set {key}: {why}")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {part} is not a section")
            node = child
        node[parts[-1]] = value
    return out


def describe_validation_error(exc: ValidationError) -> str:
    """One line naming the first bad field: `optimizer.lr: Input should be greater than 0 (got -1)`."""
    import re

    err = exc.errors()[0]
    # a key the user wrote is shown as written when it is a plain (or dotted) name, else quoted: an
    # empty key, or one holding spaces or newlines, would read as something else or break the line
    loc = ".".join(str(p) if re.fullmatch(r"[A-Za-z0-9_.-]+", str(p)) else repr(p) for p in err["loc"])
    msg = " ".join(err["msg"].removeprefix("Value error, ").split())
    if not loc:  # a rule across fields: the message names them
        return f"config error: {msg}"
    if err["type"] == "extra_forbidden":
        return f"config error: unknown key {loc}"
    given = err.get("input")
    shown = "" if isinstance(given, (dict, list)) or given is None else f" (got {given!r})"
    return f"config error: {loc}: {msg}{shown}"
