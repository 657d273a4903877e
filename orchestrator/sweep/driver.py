"""run_sweep: check the sweep, open the parent MLflow run, run the trials on Ray Tune, collect
and summarise them."""
from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import time
from typing import Any, Optional, Sequence

import yaml

from orchestrator.config import JobConfig
from orchestrator.errors import ConfigError, TrainingError
from orchestrator.sweep.schema import SWEEP_PREFIX, SweepConfig, SweepPlan, load_sweep, plan_sweep, with_values
from orchestrator.sweep.summary import READ_TIMEOUT_S, SweepResult, collect, summarise
from orchestrator.sweep.trial import trial, trial_resources






def run_sweep(sweep: SweepConfig | SweepPlan | str | os.PathLike, overrides: Sequence[str] = (),
              show_progress: bool = True) -> SweepResult:
    """Run a sweep (a file path, a SweepConfig or a checked SweepPlan) on Ray Tune. Uses the Ray
    cluster of the calling process, else RAY_ADDRESS, else starts (and stops) a local one.
    ConfigError on bad input (before Ray starts, or when the cluster cannot hold one trial);
    TrainingError when no trial finished."""
    import ray

    from orchestrator.fleet import cluster
    from orchestrator.reporting.tracking import Tracker, check_store

    t0 = time.perf_counter()
    plan = sweep if isinstance(sweep, SweepPlan) else (
        plan_sweep(sweep, overrides) if isinstance(sweep, SweepConfig) else load_sweep(sweep, overrides))
    spec, base = plan.sweep, JobConfig.from_dict(plan.base_raw)
    tracking_uri = absolute_uri(base.tracking.tracking_uri)
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
        say(show_progress, f"sweep: {plan.trials} trials; parent {tracker.where()}")
        setup = {"base_raw": base_raw, "tracking_uri": tracker.tracking_uri, "experiment": experiment,
                 "run_name": run_name, "parent_run_id": tracker.run_id, "show_progress": show_progress}
        grid = _tune(plan, setup, os.path.abspath(tune_dir), show_progress)
        rows, histories = collect(grid, plan, tracker)
        result = summarise(plan, tracker, rows, histories, time.perf_counter() - t0)
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
    from orchestrator.fleet.cluster import RESOURCES_TIMEOUT_S, check_fits

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
    from orchestrator.reporting.tracking import environment_tags

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
        return trial_resources(JobConfig.from_dict(with_values(base_raw, params)), driver_cpus)

    scheduler = None
    if spec.scheduler == "asha":
        from ray.tune.schedulers import ASHAScheduler

        # max_t one past the last epoch: ASHA stops a trial that reaches max_t, and a trial that ends
        # by its own stop condition must finish its run (final checkpoint, result.json), not be cut off
        max_t = max(c.stop.epochs for c in plan.probes) + 1
        scheduler = ASHAScheduler(time_attr="epoch", max_t=max_t, grace_period=min(spec.asha.grace_period, max_t - 1),
                                  reduction_factor=spec.asha.reduction_factor)
    trainable = tune.with_resources(tune.with_parameters(trial, setup=setup), resources)
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


def absolute_uri(uri: Optional[str]) -> str:
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
    from orchestrator.data.torch_data import is_function_source

    data = out.get("data") or {}
    for key in ("source", "test_source"):
        value = data.get(key)
        if isinstance(value, str) and "://" not in value and not value.startswith("builtin:") \
                and not is_function_source(value):  # a torch Dataset's 'module:function' is no path
            data[key] = os.path.abspath(value)
    return out


def say(show: bool, text: str) -> None:
    if show:
        print(text, flush=True)
