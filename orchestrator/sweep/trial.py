"""One trial: `ElasticTrainer.fit()` inside a Ray Tune function trainable, its epochs reported to
Tune, and the resources its placement group asks for."""
from __future__ import annotations

import json
from typing import Any, Optional

from orchestrator.config import JobConfig
from orchestrator.sweep.schema import SWEEP_PREFIX, with_values


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
        self.previous: Optional[dict[str, Any]] = None  # the last row reported

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("kind") == "test_evaluated":  # a validation split: the test figures join the last row
            base = self.last or self.previous
            if base is not None:
                self.last = {**base, **{k: event[k] for k in self.trainer.config.metric_goals() if k in event}}
            return
        if event.get("kind") != "epoch_end":
            return
        from ray import tune

        tracker = self.trainer.controller.tracker
        row = {"epoch": event["epoch"], "t_s": event.get("t", 0.0), "mlflow_run_id": tracker.run_id}
        row.update({k: event[k] for k in self.trainer.config.metric_goals() if k in event})
        if ends_the_run(self.trainer.config, event):
            self.last = row
            return
        self.previous = row
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
    stop, target = config.stop, config.target()
    return epoch_end["epoch"] >= stop.epochs or (stop.at_target and target is not None and target.reached(epoch_end))


def trial(params: dict[str, Any], setup: dict[str, Any]) -> None:
    """Tune function trainable: one job with the sampled values over the base config, as a child
    MLflow run of the sweep's parent run."""
    from ray import tune

    from orchestrator.trainer import ElasticTrainer

    trial_id = tune.get_context().get_trial_id()
    raw = with_values(setup["base_raw"], params)
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
