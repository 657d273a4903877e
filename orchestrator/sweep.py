"""Sweeps: a grid or random search over any config keys with Ray Tune, tracked as nested MLflow runs.

`python -m orchestrator sweep SWEEP.yaml` or `run_sweep(path_or_SweepConfig)`. The sweep file
names a base job config and a search space over dotted config keys; every trial is one
`ElasticTrainer.fit()` inside a Tune function trainable, in a placement group sized from the
trial's own config (so a sweep never asks the cluster for more than it has: trials that do not
fit together wait their turn). The driver opens one parent MLflow run; each trial is a child
run (tag `mlflow.parentRunId`) in the same experiment. At the end the parent gets a comparison
table and a plot of test accuracy against wall-clock seconds, per trial. See docs/sweeps.md.
"""
from __future__ import annotations

import copy
import itertools
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional, Sequence

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from orchestrator.config import JobConfig, Section, apply_overrides, yaml_shape_problem
from orchestrator.errors import ConfigError, TrainingError

MAX_CHECKED_COMBINATIONS = 256  # discrete values checked together before anything starts (each alone beyond)
READ_TIMEOUT_S = 60.0  # reading a trial's result back from MLflow
SWEEP_PREFIX = "sweep."  # tags the sweep sets on its runs


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
    metric: str = Field(
        "test_accuracy", min_length=1, description="The metric that ranks trials (and that the scheduler judges): one "
        "the base config's task produces (e.g. test_accuracy, test_r2, test_perplexity, your own task's) or train_loss; "
        "each trial reports every metric after every epoch.")
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

    def check_metric(self, goals: dict[str, str], task: str) -> None:
        """`metric` is one the base config's task produces (`goals`: name -> max|min), and `goal`
        agrees with it (unset: taken from it). ConfigError otherwise."""
        if self.metric not in goals:
            raise ConfigError(f"sweep error: metric: the {task} task has no metric {self.metric!r}; choose one of "
                              f"{', '.join(goals)}")
        natural = goals[self.metric]
        if self.goal is None:
            self.goal = natural
        elif self.goal != natural:
            raise ConfigError(f"sweep error: goal: goal {self.goal} for {self.metric} would rank the worst trial best; "
                              f"{self.metric} is {'maximised' if natural == 'max' else 'minimised'} (goal {natural})")

    def grid_size(self) -> int:
        return math.prod(len(s.grid) for s in self.search.values() if s.kind == "grid")


# ---- loading and checking (no Ray) ----------------------------------------------------------------
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
    raw = _read_yaml(path, "sweep file")
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
    base_raw = _read_yaml(base_path, "base config")
    for key in sweep.set:
        _check_key(key, "set")
    base_raw = apply_overrides(_with_values(base_raw, sweep.set), list(overrides))
    base = JobConfig.from_dict(base_raw)  # the base alone is valid (its error names the field)
    sweep.check_metric(base.metric_goals(), base.task.name)
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
        return JobConfig.model_validate(_with_values(base_raw, values))
    except ValidationError as exc:
        shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
        raise ConfigError(f"sweep error: search: with {shown}: {_describe(exc).removeprefix('sweep error: ')}") from None


def _with_values(base_raw: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
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


def _read_yaml(path: str, what: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"{what} not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except RecursionError:
        raise ConfigError(f"{what} {path} cannot be read as YAML (nested too deeply)") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{what} {path} cannot be read as YAML ({' '.join(str(exc).split())[:200]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {path} must hold a mapping, got {type(raw).__name__}")
    why = yaml_shape_problem(raw)
    if why:
        raise ConfigError(f"{what} {path} cannot be read as YAML ({why})")
    return raw


def _describe(exc: ValidationError) -> str:
    from orchestrator.config import describe_validation_error

    return describe_validation_error(exc).replace("config error:", "sweep error:", 1)


class _TuneReport:
    """A reporting callback: after every epoch, the epoch's figures (and the child run's id, so the
    driver finds every trial's run) to Ray Tune. When Tune ends the trial (a scheduler stopped it),
    `tune.report` raises SystemExit in this thread; it is turned into KeyboardInterrupt so fit() ends
    the run as it does on Ctrl-C: MLflow run KILLED, actors stopped. The run's last epoch (its
    epoch limit, or the target reached with stop.at_target) is reported after fit() returns, so a
    scheduler's verdict on it cannot cut off a run that has done its training."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.stopped = False
        self.last: Optional[dict[str, Any]] = None  # the last epoch's row, reported once the run is finished

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("kind") != "epoch_end":
            return
        from ray import tune

        tracker = self.trainer.controller.tracker
        row = {"epoch": event["epoch"], "t_s": event.get("t", 0.0), "mlflow_run_id": tracker.run_id}
        row.update({k: event[k] for k in self.trainer.config.metric_goals() if k in event})
        if ends_the_run(self.trainer.config, event):
            self.last = row
            return
        try:
            tune.report(row)
        except SystemExit:
            self.stopped = True
            raise KeyboardInterrupt("the sweep's scheduler stopped this trial") from None

    def report_last(self) -> None:
        from ray import tune

        if self.last is not None:
            try:
                tune.report(self.last)
            except SystemExit:  # the run is finished; a scheduler's stop changes nothing now
                pass


def ends_the_run(config: JobConfig, epoch_end: dict[str, Any]) -> bool:
    """Whether the run stops after this epoch_end event: its epoch limit, or the target reached
    with stop.at_target (a stop by stop.max_wall_s is not known in advance)."""
    stop, target = config.stop, config.stop.the_target()
    return epoch_end["epoch"] >= stop.epochs or (stop.at_target and target is not None and target.reached(epoch_end))


def _trial(params: dict[str, Any], setup: dict[str, Any]) -> None:
    """Tune function trainable: one job with the sampled values over the base config, as a child
    MLflow run of the sweep's parent run."""
    from ray import tune

    from orchestrator.trainer import ElasticTrainer

    trial_id = tune.get_context().get_trial_id()
    raw = _with_values(setup["base_raw"], params)
    raw.setdefault("tracking", {}).update(tracking_uri=setup["tracking_uri"], experiment=setup["experiment"],
                                          run_name=f"{setup['run_name']}-{trial_id}")
    tags = {"mlflow.parentRunId": setup["parent_run_id"], f"{SWEEP_PREFIX}trial": trial_id,
            f"{SWEEP_PREFIX}params": json.dumps(params, sort_keys=True)}
    trainer = ElasticTrainer(JobConfig.from_dict(raw), show_progress=setup["show_progress"], run_tags=tags)
    report = _TuneReport(trainer)
    trainer.callbacks.append(report)
    try:
        trainer.fit()
    except KeyboardInterrupt:
        if not report.stopped:
            raise
        return  # stopped by the scheduler: fit marked the run KILLED; the driver adds the stopped_early tag
    report.report_last()


def trial_resources(config: JobConfig, driver_cpus: float) -> Any:
    """The placement group a trial needs: a bundle for its driver (empty when driver_cpus is 0)
    and one per replica ({CPU: cpus_per_replica[, GPU: gpus_per_replica]}). Tune captures the
    actors the trial starts into this group: the replicas take their bundles, spares reserve
    nothing. The partition server and the shards (no CPU either) are placed beside the trial's
    driver by node affinity, outside the group."""
    from ray.tune import PlacementGroupFactory

    s = config.scaling
    replica = {"CPU": s.cpus_per_replica, **({"GPU": s.gpus_per_replica} if s.gpus_per_replica > 0 else {})}
    head = {"CPU": driver_cpus} if driver_cpus > 0 else {}
    return PlacementGroupFactory([head] + [dict(replica) for _ in range(s.replicas)], strategy="PACK")


# ---- the driver -------------------------------------------------------------------------------------
@dataclass
class SweepResult:
    parent_run_id: str
    tracking_uri: str
    experiment_id: str
    metric: str
    goal: str
    best_run_id: Optional[str]
    best_trial: Optional[str]
    best_value: Optional[float]
    best_params: dict[str, Any]
    best_config: Optional[dict[str, Any]]
    rows: list[dict[str, Any]] = field(default_factory=list)  # the comparison table, one row per trial
    wall_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)


def run_sweep(sweep: SweepConfig | SweepPlan | str | os.PathLike, overrides: Sequence[str] = (),
              show_progress: bool = True) -> SweepResult:
    """Run a sweep (a file path, a SweepConfig or a checked SweepPlan) on Ray Tune. Uses the Ray
    cluster of the calling process, else RAY_ADDRESS, else starts (and stops) a local one.
    ConfigError on bad input (before Ray starts, or when the cluster cannot hold one trial);
    TrainingError when no trial finished."""
    import ray

    from orchestrator import cluster
    from orchestrator.tracking import Tracker, check_store

    t0 = time.perf_counter()
    plan = sweep if isinstance(sweep, SweepPlan) else (
        plan_sweep(sweep, overrides) if isinstance(sweep, SweepConfig) else load_sweep(sweep, overrides))
    spec, base = plan.sweep, JobConfig.from_dict(plan.base_raw)
    tracking_uri = _absolute_uri(base.tracking.tracking_uri)
    check_store(tracking_uri)
    base_raw = _absolute_paths(plan.base_raw)
    _check_inputs(plan)
    needs = [_trial_needs(c, spec.trial_driver_cpus) for c in plan.probes]
    started_ray = cluster.connect(max(n["CPU"] for n in needs))
    tracker = None
    tune_dir = spec.storage or tempfile.mkdtemp(prefix="eo-sweep-")
    status = "FAILED"
    try:
        _check_fits(needs)
        experiment = spec.experiment or base.tracking.experiment
        run_name = spec.run_name or f"sweep-{os.path.splitext(os.path.basename(plan.base_path))[0]}"
        tracker = Tracker(tracking_uri, experiment, run_name)
        _describe_parent(tracker, plan, base_raw)
        _say(show_progress, f"sweep: {plan.trials} trials; parent {tracker.where()}")
        setup = {"base_raw": base_raw, "tracking_uri": tracker.tracking_uri, "experiment": experiment,
                 "run_name": run_name, "parent_run_id": tracker.run_id, "show_progress": show_progress}
        grid = _tune(plan, setup, os.path.abspath(tune_dir), show_progress)
        rows, histories = _collect(grid, plan, tracker)
        result = _summarise(plan, tracker, rows, histories, time.perf_counter() - t0)
        status = "FINISHED" if any(r["status"] != "failed" for r in rows) else "FAILED"
        if status == "FAILED":
            raise TrainingError(f"every trial failed ({rows[0]['error'] if rows else 'no trial ran'})")
        return result
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if tracker is not None:
            tracker.set_tags({f"{SWEEP_PREFIX}status": status})
            tracker.finish(status)
        if spec.storage is None:
            shutil.rmtree(tune_dir, ignore_errors=True)
        if started_ray:
            ray.shutdown()


def _check_inputs(plan: SweepPlan) -> None:
    """What a trial's fit() checks before it starts (factory, data, checkpoint storage), once per
    distinct model and data among the probes: bad input is a ConfigError here, not a failed trial."""
    from orchestrator.trainer import check_inputs

    seen: set[str] = set()
    for config in plan.probes:
        key = json.dumps(config.model_dump(mode="json", include={"model", "data", "checkpoint", "scaling"}),
                         sort_keys=True)
        if key not in seen:
            seen.add(key)
            check_inputs(config)


def _trial_needs(config: JobConfig, driver_cpus: float) -> dict[str, float]:
    s = config.scaling
    return {"CPU": driver_cpus + s.replicas * s.cpus_per_replica, "GPU": s.replicas * s.gpus_per_replica,
            "replica_CPU": s.cpus_per_replica, "replica_GPU": s.gpus_per_replica}


def _check_fits(needs: list[dict[str, float]]) -> None:
    """The largest trial fits in the connected cluster (else Tune would wait for it forever)."""
    import ray

    from orchestrator.checks import bounded
    from orchestrator.cluster import RESOURCES_TIMEOUT_S, check_fits

    try:
        total = bounded(ray.cluster_resources, RESOURCES_TIMEOUT_S, "the Ray cluster's resources")
    except TimeoutError as exc:
        raise TrainingError(str(exc)) from None
    for key in ("CPU", "GPU"):
        biggest = max(needs, key=lambda n: n[key])
        if biggest[key] <= 0:
            continue
        have = total.get(key, 0.0)
        if biggest[key] > have + 1e-9:
            raise ConfigError(f"sweep error: one trial needs {biggest[key]:g} {key} (its replicas and driver), "
                              f"the cluster has {have:g}")
    for n in needs:
        check_fits(1, n["replica_CPU"], n["replica_GPU"])  # one replica fits on the largest node


def _describe_parent(tracker: Any, plan: SweepPlan, base_raw: dict[str, Any]) -> None:
    from orchestrator.tracking import environment_tags

    spec = plan.sweep
    tracker.log_params({"base": plan.base_path, "metric": spec.metric, "goal": spec.goal,
                        "num_samples": spec.num_samples, "max_concurrent_trials": spec.max_concurrent_trials,
                        "scheduler": spec.scheduler, "trials": plan.trials,
                        **{f"search.{k}": json.dumps(s.model_dump(exclude_none=True)) for k, s in spec.search.items()}})
    tracker.set_tags({"mode": "sweep", f"{SWEEP_PREFIX}keys": ", ".join(spec.search), **environment_tags()})
    tracker.log_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True), sort_keys=False), "sweep.yaml")
    tracker.log_text(yaml.safe_dump(base_raw, sort_keys=False), "base_config.yaml")


def _tune(plan: SweepPlan, setup: dict[str, Any], storage: str, show_progress: bool) -> Any:
    from ray import tune

    spec = plan.sweep
    base_raw, driver_cpus = setup["base_raw"], spec.trial_driver_cpus

    def resources(params: dict[str, Any]) -> Any:
        return trial_resources(JobConfig.from_dict(_with_values(base_raw, params)), driver_cpus)

    scheduler = None
    if spec.scheduler == "asha":
        from ray.tune.schedulers import ASHAScheduler

        # max_t one past the last epoch: ASHA stops a trial that reaches max_t, and a trial that ends
        # by its own stop condition must finish its run (final checkpoint, result.json), not be cut off
        max_t = max(c.stop.epochs for c in plan.probes) + 1
        scheduler = ASHAScheduler(time_attr="epoch", max_t=max_t, grace_period=min(spec.asha.grace_period, max_t - 1),
                                  reduction_factor=spec.asha.reduction_factor)
    trainable = tune.with_resources(tune.with_parameters(_trial, setup=setup), resources)
    tuner = tune.Tuner(
        trainable, param_space={k: s.to_tune() for k, s in spec.search.items()},
        tune_config=tune.TuneConfig(metric=spec.metric, mode=spec.goal, num_samples=spec.num_samples,
                                    max_concurrent_trials=spec.max_concurrent_trials, scheduler=scheduler,
                                    time_budget_s=spec.max_wall_s),
        run_config=tune.RunConfig(name="sweep", storage_path=storage, verbose=1 if show_progress else 0,
                                  callbacks=[_child_runs_callback(setup["tracking_uri"])],
                                  failure_config=tune.FailureConfig(max_failures=0)),
    )
    return tuner.fit()


def _child_runs_callback(tracking_uri: str) -> Any:
    """A Tune callback on the driver: a trial that ended without finishing its run (a scheduler
    stopped it) has its child run marked KILLED with tag sweep.stopped_early; a trial that errored
    has its run marked FAILED if it is still RUNNING (the trial actor died)."""
    from mlflow.tracking import MlflowClient
    from ray import tune

    from orchestrator.checks import bounded

    client = MlflowClient(tracking_uri)

    def mark(trial: Any, status: str, early: bool) -> None:
        run_id = (trial.last_result or {}).get("mlflow_run_id")
        if not run_id:
            return

        def write() -> None:
            run = client.get_run(run_id)
            if run.info.status == "FINISHED" or (not early and run.info.status != "RUNNING"):
                return
            if early:
                client.set_tag(run_id, f"{SWEEP_PREFIX}stopped_early", "true")
            client.set_terminated(run_id, status)

        try:
            bounded(write, READ_TIMEOUT_S, f"marking run {run_id}")
        except Exception as exc:  # the record is worse off; the sweep goes on
            print(f"orchestrator: sweep: could not mark run {run_id} {status} ({exc})", flush=True)

    class ChildRuns(tune.Callback):
        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            mark(trial, "KILLED", early=True)

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            mark(trial, "FAILED", early=False)

    return ChildRuns()


def _collect(grid: Any, plan: SweepPlan, tracker: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One table row per trial, from Tune's results and each finished child run's result.json;
    and each trial's (seconds, the sweep's metric) history for the plot."""
    from orchestrator.checks import bounded
    from orchestrator.trainer import run_mode

    rows, histories = [], {}
    for res in grid:
        params = {k: res.config.get(k) for k in plan.sweep.search}
        last = res.metrics or {}
        trial_id = last.get("trial_id") or (os.path.basename(res.path) if res.path else "?")
        run_id = last.get("mlflow_run_id") or None
        df = res.metrics_dataframe
        if df is not None and "t_s" in df:
            histories[trial_id] = (list(df["t_s"]), list(df.get(plan.sweep.metric, [])), params)
        summary: dict[str, Any] = {}
        if run_id:
            try:
                summary = bounded(lambda r=run_id: _run_summary(tracker.client, r), READ_TIMEOUT_S, f"run {run_id}")
            except Exception:
                summary = {}
        cfg = JobConfig.from_dict(_with_values(plan.base_raw, params))
        status = ("failed" if res.error is not None else "finished" if summary.get("status") == "FINISHED"
                  else "stopped_early" if summary.get("stopped_early") else summary.get("status", "unknown").lower())
        rows.append({
            "trial": trial_id, "run_id": run_id, "status": status, "mode": run_mode(cfg),
            "params": params, "epochs": last.get("epoch"),
            "time_to_target_s": summary.get("time_to_target_s"),
            "final": {k: last[k] for k in cfg.metric_goals() if last.get(k) is not None},
            "metric": last.get(plan.sweep.metric),
            "samples_per_s": summary.get("samples_per_s"),
            "wall_s": summary.get("wall_s"),
            "error": " ".join(str(res.error).split())[:300] if res.error is not None else None,
        })
    rows.sort(key=lambda r: r["trial"])
    return rows, histories


def _run_summary(client: Any, run_id: str) -> dict[str, Any]:
    run = client.get_run(run_id)
    out: dict[str, Any] = {"status": run.info.status,
                           "stopped_early": run.data.tags.get(f"{SWEEP_PREFIX}stopped_early") == "true"}
    if run.info.status == "FINISHED":
        with tempfile.TemporaryDirectory() as tmp:
            try:
                with open(client.download_artifacts(run_id, "result.json", tmp), encoding="utf-8") as f:
                    result = json.load(f)
                out.update(time_to_target_s=result.get("time_to_target_s"), samples_per_s=result.get("samples_per_s"),
                           wall_s=result.get("wall_s"))
            except Exception:
                pass
    return out


def _summarise(plan: SweepPlan, tracker: Any, rows: list[dict[str, Any]], histories: dict[str, Any],
               wall_s: float) -> SweepResult:
    spec = plan.sweep
    ranked = [r for r in rows if r["metric"] is not None and r["status"] != "failed"]
    best = (max if spec.goal == "max" else min)(ranked, key=lambda r: r["metric"]) if ranked else None
    best_config = JobConfig.from_dict(_with_values(plan.base_raw, best["params"])).model_dump(mode="json") \
        if best else None
    result = SweepResult(
        parent_run_id=tracker.run_id, tracking_uri=tracker.tracking_uri, experiment_id=tracker.experiment_id,
        metric=spec.metric, goal=spec.goal or "max", best_run_id=best["run_id"] if best else None,
        best_trial=best["trial"] if best else None, best_value=best["metric"] if best else None,
        best_params=best["params"] if best else {}, best_config=best_config, rows=rows, wall_s=wall_s)
    tracker.log_text(comparison_csv(rows), "comparison.csv")
    tracker.log_text(comparison_markdown(rows, spec.metric), "comparison.md")
    tracker.log_text(result.to_json(), "sweep_result.json")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "metric_vs_time.png")
        plot_metric(histories, path, spec.metric)
        tracker.log_file(path)
    if best:
        tracker.set_tags({f"{SWEEP_PREFIX}best_run_id": best["run_id"], f"{SWEEP_PREFIX}best_trial": best["trial"]})
        tracker.log_metrics([(f"best_{spec.metric}", best["metric"], 0)])
    return result


COLUMNS = ("trial", "status", "mode", "params", "metric", "time_to_target_s", "final", "samples_per_s", "epochs",
           "run_id")


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, dict):
        return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def comparison_csv(rows: list[dict[str, Any]]) -> str:
    import csv
    import io

    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(COLUMNS)
    for r in rows:
        writer.writerow([_cell(r.get(c)) for c in COLUMNS])
    return buf.getvalue()


def comparison_markdown(rows: list[dict[str, Any]], metric: str) -> str:
    lines = [f"# Sweep: trials compared (ranked by {metric})", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot_metric(histories: dict[str, tuple[list[float], list[float], dict[str, Any]]], path: str,
                metric: str = "test_accuracy") -> None:
    """The sweep's metric against the trial's wall-clock seconds, one line per trial (Agg
    backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for trial, (secs, acc, params) in sorted(histories.items()):
        if secs and acc:
            ax.plot(secs, acc, marker="o", label=f"{trial}: {_cell(params)}")
    ax.set_xlabel("wall-clock seconds since the trial started")
    label = metric.replace("_", " ")
    ax.set_ylabel(label)
    ax.set_title(f"Sweep: {label} per trial")
    ax.grid(alpha=0.3)
    if histories:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- paths a trial (another process, another working directory) must see as the driver does ------
def _absolute_uri(uri: Optional[str]) -> str:
    """The tracking URI with a relative local store made absolute (trials run in Tune's trial
    directories, maybe on other nodes; the driver's default is passed on explicitly)."""
    import mlflow

    uri = uri or mlflow.get_tracking_uri()
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.abspath(uri.removeprefix("sqlite:///"))
    if uri.startswith("file:") and not uri.startswith("file://"):
        return "file://" + os.path.abspath(uri.removeprefix("file:"))
    if "://" not in uri and not uri.startswith("databricks"):
        return os.path.abspath(uri)
    return uri


def _absolute_paths(raw: dict[str, Any]) -> dict[str, Any]:
    """checkpoint.storage and local data paths made absolute (Tune runs each trial in its own
    working directory)."""
    out = copy.deepcopy(raw)
    ck = out.setdefault("checkpoint", {})
    storage = ck.get("storage", JobConfig().checkpoint.storage)
    if "://" not in storage:
        ck["storage"] = os.path.abspath(storage)
    data = out.get("data") or {}
    for key in ("source", "test_source"):
        value = data.get(key)
        if isinstance(value, str) and "://" not in value and not value.startswith("builtin:"):
            data[key] = os.path.abspath(value)
    return out


def _say(show: bool, text: str) -> None:
    if show:
        print(text, flush=True)
