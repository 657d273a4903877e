"""The sweep file: its model (SweepConfig, SearchSpace, AshaConfig), loading it and checking every
combination it stands for before anything starts (no Ray)."""
from __future__ import annotations

import copy
import itertools
import math
import os
from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from orchestrator.config import JobConfig, Section, apply_overrides, describe_validation_error, read_mapping
from orchestrator.errors import ConfigError

SWEEP_PREFIX = "sweep."  # tags the sweep sets on its runs


MAX_CHECKED_COMBINATIONS = 256  # discrete values checked together before anything starts (each alone beyond)


class SearchSpace(Section):
    """The values one config key takes: exactly one of grid (every value, crossed with the other
    grid keys), choice (one value per sample), uniform or loguniform ([low, high], one draw per
    sample)."""

    grid: Optional[list[Any]] = Field(None, min_length=1, description="Every one of these values is tried "
                                      "(a grid point; grid keys are crossed with each other).")
    choice: Optional[list[Any]] = Field(None, min_length=1, description="One of these values, drawn per sample.")
    uniform: Optional[list[float]] = Field(None, description="[low, high]: a float drawn uniformly per sample.")
    loguniform: Optional[list[float]] = Field(
        None, description="[low, high] with 0 < low: a float drawn uniformly in log space per sample (rates).")

    @model_validator(mode="after")
    def _one_kind(self) -> "SearchSpace":
        given = [k for k in ("grid", "choice", "uniform", "loguniform") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of grid, choice, uniform, loguniform; got {', '.join(given) or 'none'}")
        for kind in ("uniform", "loguniform"):
            bounds = getattr(self, kind)
            if bounds is None:
                continue
            if len(bounds) != 2 or not bounds[0] < bounds[1]:
                raise ValueError(f"{kind} needs [low, high] with low < high, got {bounds}")
            if kind == "loguniform" and bounds[0] <= 0:
                raise ValueError(f"loguniform needs 0 < low, got {bounds}")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in ("grid", "choice", "uniform", "loguniform") if getattr(self, k) is not None)

    def probes(self) -> list[Any]:
        """Values that stand for the space in the checks: every discrete value; a range's bounds
        and middle (arithmetic, or geometric for loguniform)."""
        if self.kind in ("grid", "choice"):
            return list(getattr(self, self.kind))
        lo, hi = getattr(self, self.kind)
        mid = math.sqrt(lo * hi) if self.kind == "loguniform" else (lo + hi) / 2
        return [lo, mid, hi]

    def to_tune(self) -> Any:
        from ray import tune

        value = getattr(self, self.kind)
        return {"grid": tune.grid_search, "choice": tune.choice}[self.kind](value) if self.kind in ("grid", "choice") \
            else {"uniform": tune.uniform, "loguniform": tune.loguniform}[self.kind](*value)


class AshaConfig(Section):
    """scheduler asha: Asynchronous Successive Halving stops trials whose metric trails the others'
    at the same epoch (ray.tune.schedulers.ASHAScheduler, time_attr epoch, max_t one past the
    largest stop.epochs of the trials, so a trial that ends at its last epoch is not also stopped by ASHA)."""

    grace_period: int = Field(1, ge=1, description="Epochs every trial runs before it can be stopped.")
    reduction_factor: float = Field(
        2.0, gt=1, description="At each rung (grace_period x reduction_factor^k epochs) only the best 1/reduction_factor "
        "of the trials seen there go on.")


class SweepConfig(Section):
    """Its top-level keys: the base job config, the search space over the base's keys, how trials
    are ranked, scheduled and recorded."""

    base: str = Field(description="The job config every trial starts from (a YAML path; relative to the working "
                      "directory, else to the sweep file's directory or the nearest of its parents that has it).")
    set: dict[str, Any] = Field(default_factory=dict, description="Fixed `section.key: value` overrides applied to "
                                "base for every trial (as `--set`), e.g. {stop.epochs: 3}.")
    search: dict[str, SearchSpace] = Field(
        description="Dotted config keys -> search space: {grid: [..]}, {choice: [..]}, {uniform: [low, high]} or "
        "{loguniform: [low, high]}; e.g. strategy.mode: {grid: [allreduce, easgd]}.")
    num_samples: int = Field(1, ge=1, description="Samples per grid point (random keys drawn afresh each); trials = "
                             "num_samples x the product of the grid sizes.")
    metric: Optional[str] = Field(
        None, min_length=1, description="The metric that ranks trials (and that the scheduler judges): one the base "
        "config's task produces on the split it evaluates during the run (e.g. test_accuracy, test_r2, test_perplexity, "
        "your own task's; val_accuracy etc. with data.val_fraction) or train_loss; default: the base config's headline "
        "metric (its stop.target's, else the task's primary). Each trial reports every metric after every epoch.")
    goal: Optional[Literal["max", "min"]] = Field(
        None, description="max or min; default: the metric's own goal in the task (max for test_accuracy and test_r2, "
        "min for losses).")
    max_concurrent_trials: Optional[int] = Field(
        None, ge=1, description="At most this many trials at once; none = as many as the cluster holds (each trial "
        "reserves its replicas' CPUs, so trials that do not fit wait).")
    scheduler: Optional[Literal["asha"]] = Field(None, description="asha: stop trials that trail early (see asha); "
                                                 "none = every trial runs to its stop condition.")
    asha: AshaConfig = Field(default_factory=lambda: AshaConfig(), description="The ASHA scheduler's settings.")
    trial_driver_cpus: float = Field(
        0.0, ge=0, description="CPUs reserved for each trial's driver (the Tune trainable that runs the controller; "
        "it mostly waits on its actors); 0 = none (its placement group holds only the replicas' bundles).")
    experiment: Optional[str] = Field(None, min_length=1, description="MLflow experiment of the parent and child "
                                      "runs; default: the base config's tracking.experiment.")
    run_name: Optional[str] = Field(None, description="The parent run's name; default: sweep-<base file name>.")
    storage: Optional[str] = Field(
        None, description="Directory for Ray Tune's own trial records; default: a temporary directory removed after "
        "the sweep (the results live in MLflow).")
    max_wall_s: Optional[float] = Field(None, gt=0, description="End the whole sweep after this many seconds "
                                        "(Tune's time budget); none = no limit.")

    @field_validator("search")
    @classmethod
    def _some_keys(cls, v: dict[str, SearchSpace]) -> dict[str, SearchSpace]:
        if not v:
            raise ValueError("give at least one key to search over")
        return v

    def check_metric(self, goals: dict[str, str], task: str, headline: Optional[str] = None) -> None:
        """`metric` (unset: `headline`) is one the base config's runs are judged by (`goals`:
        name -> max|min), and `goal` agrees with it (unset: taken from it). ConfigError otherwise."""
        if self.metric is None:
            self.metric = headline or "test_accuracy"
        if self.metric not in goals:
            val = "val_" + self.metric.removeprefix("test_")
            hint = f" (the base config holds out a validation split: {val})" if val in goals else ""
            raise ConfigError(f"sweep error: metric: the {task} task has no metric {self.metric!r} to judge trials "
                              f"by{hint}; choose one of {', '.join(goals)}")
        natural = goals[self.metric]
        if self.goal is None:
            self.goal = natural
        elif self.goal != natural:
            raise ConfigError(f"sweep error: goal: goal {self.goal} for {self.metric} would rank the worst trial best; "
                              f"{self.metric} is {'maximised' if natural == 'max' else 'minimised'} (goal {natural})")

    def grid_size(self) -> int:
        return math.prod(len(s.grid) for s in self.search.values() if s.kind == "grid")


@dataclass
class SweepPlan:
    """A checked sweep: its file, the base config (as a dict, with the fixed overrides in), and
    the configs that stand for the search space (every discrete combination, ranges at their
    bounds and middle)."""

    sweep: SweepConfig
    base_raw: dict[str, Any]
    base_path: str
    probes: list[JobConfig]

    @property
    def trials(self) -> int:
        return self.sweep.num_samples * self.sweep.grid_size()


def load_sweep(path: str | os.PathLike, overrides: Sequence[str] = ()) -> SweepPlan:
    """Read and check a sweep file; `overrides` (`section.key=value`) apply to the base config.
    ConfigError (one line naming the key or file) on bad input; nothing is started."""
    path = os.fspath(path)
    raw = read_mapping(path, "sweep file")
    try:
        sweep = SweepConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
    return plan_sweep(sweep, overrides, os.path.dirname(os.path.abspath(path)))


def plan_sweep(sweep: SweepConfig, overrides: Sequence[str] = (), relative_to: Optional[str] = None) -> SweepPlan:
    """Check `sweep` against its base config: every search key is a config field, every value
    (or range bound) validates with the base, and so does every combination of the discrete
    values (up to MAX_CHECKED_COMBINATIONS). ConfigError otherwise."""
    base_path = _find_base(sweep.base, relative_to)
    base_raw = read_mapping(base_path, "base config")
    for key in sweep.set:
        _check_key(key, "set")
    base_raw = apply_overrides(with_values(base_raw, sweep.set), list(overrides))
    base = JobConfig.from_dict(base_raw)  # the base alone is valid (its error names the field)
    sweep.check_metric(base.judged_goals(), base.task.name, base.headline_metric())
    if base.run.name or "run.name" in sweep.search:
        raise ConfigError("sweep error: run.name: trials are not named runs (they would share one checkpoint "
                          "directory and go on from each other's checkpoints); leave run.name unset in a sweep")
    if base.checkpoint.in_memory or "checkpoint.in_memory" in sweep.search:
        raise ConfigError("sweep error: checkpoint.in_memory: a trial is not started again by name, and the scheduler's "
                          "stops would leave a keeper holding each stopped trial's checkpoint; leave it off in a sweep")
    for key in sweep.search:
        _check_key(key, "search")
    probes: list[JobConfig] = []
    for key, space in sweep.search.items():
        for value in space.probes():
            probes.append(_probe(base_raw, {key: value}))
    discrete = {k: s.probes() for k, s in sweep.search.items() if s.kind in ("grid", "choice")}
    ranges = {k: s.probes()[0] for k, s in sweep.search.items() if s.kind not in ("grid", "choice")}
    if discrete and math.prod(len(v) for v in discrete.values()) <= MAX_CHECKED_COMBINATIONS:
        for combo in itertools.product(*discrete.values()):
            probes.append(_probe(base_raw, {**dict(zip(discrete, combo)), **ranges}))
    for config in probes:
        s = config.scaling
        if s.max_or_replicas() > s.replicas:  # the new replicas would wait for bundles the group does not have
            raise ConfigError(f"sweep error: scaling.max_replicas: a trial's placement group holds its "
                              f"scaling.replicas ({s.replicas}) replicas, it cannot grow to {s.max_replicas}; "
                              "leave max_replicas unset in a sweep")
    return SweepPlan(sweep, base_raw, base_path, probes)


def _probe(base_raw: dict[str, Any], values: dict[str, Any]) -> JobConfig:
    try:
        return JobConfig.model_validate(with_values(base_raw, values))
    except ValidationError as exc:
        shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
        raise ConfigError(f"sweep error: search: with {shown}: {_describe(exc).removeprefix('sweep error: ')}") from None


def with_values(base_raw: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A copy of `base_raw` with each dotted key set to its value."""
    out = copy.deepcopy(base_raw)
    for key, value in values.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"sweep error: {key}: {part} is not a section")
        node[last] = value
    return out


def _check_key(key: str, field: str) -> None:
    """`key` names a JobConfig field (or an entry of a dict field such as model.kwargs.hidden)."""
    parts = key.split(".")
    model: Any = JobConfig
    for i, part in enumerate(parts):
        where = ".".join(parts[:i]) or "the config"
        if not part:
            raise ConfigError(f"sweep error: {field}.{key}: not a config key (empty part)")
        if model is dict:  # under a free-form mapping (model.kwargs): any key
            return
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            known = ", ".join(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else ""
            raise ConfigError(f"sweep error: {field}.{key}: not a config key ({where} has no {part!r}"
                              f"{'; it has ' + known if known else ''})")
        ann = model.model_fields[part].annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else (
            dict if getattr(ann, "__origin__", None) is dict else None)
        if model is None and i < len(parts) - 1:
            raise ConfigError(f"sweep error: {field}.{key}: not a config key ({'.'.join(parts[:i + 1])} is a value, "
                              "not a section)")


def _find_base(base: str, relative_to: Optional[str]) -> str:
    candidates = [os.path.abspath(base)]
    while relative_to and not os.path.isabs(base):  # the sweep file's directory, then its parents
        candidates.append(os.path.join(relative_to, base))
        parent = os.path.dirname(relative_to)
        relative_to = parent if parent != relative_to else None
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise ConfigError(f"sweep error: base: config file not found: {base}")


def _describe(exc: ValidationError) -> str:
    return describe_validation_error(exc).replace("config error:", "sweep error:", 1)
