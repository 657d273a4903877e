"""ElasticTrainer: the Python API. `ElasticTrainer(JobConfig(...)).fit()` -> TrainResult."""
from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any, Optional, Sequence, Union

from orchestrator.config import JobConfig
from orchestrator.data.in_memory import Dataset
from orchestrator.data.planning import StreamedDataset
from orchestrator.data.loading import load_dataset
from orchestrator.errors import ConfigError, Interrupts
from orchestrator.models import build_model
from orchestrator.reporting.result import FinalMetrics, TrainResult


def check_inputs(config: JobConfig, data: Any = None) -> Union[Dataset, StreamedDataset]:
    """Everything that can be checked before anything starts: checkpoint.storage can be written,
    the tracking store answers, the factory imports and returns a module (with at least one
    parameter per shard), the data loads (a file source: is planned and its first rows decode),
    the model accepts the data's shape. ConfigError
    otherwise; nothing is written."""
    from orchestrator.persistence.checkpoint import check_storage
    from orchestrator.persistence.job_paths import settle_paths
    from orchestrator.reporting.tracking import check_store
    from policies.rules.registry import mode_spec

    for line in settle_paths(config):  # under `ray job submit --working-dir`: files that outlive the job
        print(f"orchestrator: {line}", file=sys.stderr, flush=True)
    check_storage(config.checkpoint.storage)
    check_store(config.tracking.tracking_uri)
    model = build_model(config.model.factory, config.model.kwargs, config.data.seed)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if any(mode_spec(m).sharded for m in config.strategy.modes()) and config.scaling.shards > n_params:
        raise ConfigError(f"config error: scaling.shards: {config.scaling.shards} shards for the {n_params} "
                          f"parameters of {config.model.factory}; at most one shard per parameter")
    from policies.rules.recipe import RecipeError, make_optimizer

    try:  # the optimizer's class takes the model's parameters and optimizer.kwargs
        make_optimizer(config.optimizer.model_dump(), model)
    except RecipeError as exc:
        raise ConfigError(str(exc)) from None
    check_memory_budget(config, model)
    if config.checkpoint.export:
        from orchestrator.persistence.export import check_export

        check_export(config.checkpoint.export, model, config.model.factory)
    dataset = _load_checked_data(config, data)
    example = dataset.example(2)  # decoded rows (a file source's first rows: it is only planned, not read)
    check_model_and_task(config, model, example.x, example.y, dataset.num_classes)
    parts = config.data.partitions or 4 * config.scaling.replicas  # a file source's planner checked its own
    if isinstance(dataset, Dataset) and parts > dataset.train_rows:
        raise ConfigError(f"config error: data.partitions: {parts} partitions for {dataset.train_rows} train rows")
    return dataset


def check_memory_budget(config: JobConfig, model: Any) -> None:
    """scaling.memory_per_replica_mb: a replica's parameters, gradients and optimizer state fit it
    (policies/rules/fsdp.py estimate_bytes), in every mode the run takes; ConfigError otherwise."""
    budget = config.scaling.memory_per_replica_mb
    if budget is None:
        return
    from policies.rules.fsdp import estimate_bytes

    n, opt = config.scaling.replicas, config.optimizer.model_dump()
    for mode in dict.fromkeys(config.strategy.modes()):
        need = estimate_bytes(model, opt, n, split=mode == "fsdp") / 1e6
        if need > budget:
            hint = ("" if mode == "fsdp" else
                    f"; strategy.mode fsdp splits them across the replicas "
                    f"({estimate_bytes(model, opt, n, split=True) / 1e6:.1f} MB a replica at {n} replicas)")
            raise ConfigError(f"config error: scaling.memory_per_replica_mb: {mode} needs {need:.1f} MB a replica for "
                              f"the parameters, gradients and {config.optimizer.name} state of {config.model.factory}, "
                              f"over the budget of {budget:g} MB{hint}")


def _load_checked_data(config: JobConfig, data: Any) -> Union[Dataset, StreamedDataset]:
    """The job's data: in memory (a Dataset) or a planned file source (a StreamedDataset),
    decoded with the task's dtypes."""
    try:
        task = config.task.build()
    except ValueError as exc:
        raise ConfigError(f"config error: task.name: {exc}") from None
    return load_dataset(config.data, data, task=task, replicas=config.scaling.replicas)


def check_model_and_task(config: JobConfig, model: Any, x: Any, y: Any, num_classes: Optional[int] = None) -> None:
    """The model accepts a sample of the decoded inputs `x` (and with task model_loss the targets
    `y` as labels=), its output holds what the task reads (policies/rules/outputs.py), and the task
    can score it against `y` (loss and evaluation); ConfigError naming the field otherwise."""
    import torch

    from policies.rules.batches import as_tensors, shape_of
    from policies.rules.outputs import predictions, run_model
    from policies.rules.tasks import Classification, ModelLoss

    task = config.task.build()
    x, y = as_tensors(x), as_tensors(y)
    try:
        with torch.no_grad():
            out = run_model(model, task, x, y)
    except Exception as exc:
        given = " (and labels=)" if getattr(task, "labels_to_model", False) else ""
        raise ConfigError(f"config error: model.factory: {config.model.factory} does not accept {config.data.source} inputs of "
                          f"shape {shape_of(x)}{given} ({type(exc).__name__}: {' '.join(str(exc).split())})") from None
    try:
        preds = predictions(out, with_loss=getattr(task, "labels_to_model", False))
    except ValueError as exc:
        raise ConfigError(f"config error: model.factory: {config.model.factory}: {exc}") from None
    if isinstance(task, Classification) and num_classes is not None and (preds.ndim != 2 or preds.shape[1] < num_classes):
        raise ConfigError(f"config error: model.factory: {config.model.factory} outputs shape {list(preds.shape[1:])}, "
                          f"needs one logit per class ({num_classes})")
    try:
        with torch.no_grad():
            loss = task.loss(out, y)
            metrics = task.finish(task.evaluate(out, y))
        float(loss)
    except Exception as exc:
        raise ConfigError(f"config error: task.name: the {config.task.name} task cannot score {config.model.factory}'s "
                          f"outputs ({list(preds.shape[1:])}) against the targets {shape_of(y)} "
                          f"({type(exc).__name__}: {' '.join(str(exc).split())})") from None
    if isinstance(task, ModelLoss) and abs(float(loss) - metrics["test_loss"]) > 1e-3 * max(1.0, abs(float(loss))):
        raise ConfigError(f"config error: task.kwargs.causal: {config.model.factory}'s own loss ({float(loss):.4f}) is "
                          f"not the one its logits give with causal: {str(task.causal).lower()} "
                          f"({metrics['test_loss']:.4f}); the model {'does not shift' if task.causal else 'shifts'} "
                          f"its labels (try causal: {str(not task.causal).lower()})")


class ElasticTrainer:
    """Train `config` on Ray. Uses the Ray cluster of the calling process when it has one,
    else RAY_ADDRESS, else starts (and afterwards stops) a local one."""

    def __init__(self, config: JobConfig, show_progress: bool = True, data: Any = None,
                 resume: Optional[dict[str, Any]] = None, callbacks: Sequence[Any] = (),
                 run_tags: Optional[dict[str, str]] = None) -> None:
        """`data`: optional in-memory training data instead of `config.data.source`: (x, y) numpy
        arrays, a dict of columns, a pandas DataFrame or a pyarrow Table, or a map-style
        torch.utils.data.Dataset (or a (train, test) pair of them), see docs/data.md.
        `resume`: a checkpoint's state (`orchestrator.persistence.resume.find_checkpoint`): the run goes on
        from it, in the same MLflow run. `callbacks`: reporting callbacks (orchestrator/reporting/reporter.py),
        e.g. a sweep's trial reporting each epoch to Ray Tune. `run_tags`: extra tags on the MLflow
        run (a sweep's trial: `mlflow.parentRunId`)."""
        self.config = config
        self.callbacks = list(callbacks)
        self.run_tags = dict(run_tags or {})
        self.resume = resume
        self.resumed_from: Optional[str] = None  # the checkpoint a run goes on from (check() / the caller)
        self.skipped: list = []  # newer checkpoints passed over, (name, why)
        self.data = data
        self.show_progress = show_progress
        self.controller = None
        self._dataset: Optional[Union[Dataset, StreamedDataset]] = None
        self._trace_ids = False  # tests: record the row ids every replica consumes

    def check(self) -> Union[Dataset, StreamedDataset]:
        """Validate what can be validated before starting anything (ConfigError on bad input). A
        named run (`run.name`) with a checkpoint goes on from it: found here, so a finished run or
        a changed config is refused before anything starts."""
        if self._dataset is None:
            self._dataset = check_inputs(self.config, self.data)
            if self.resume is None and self.config.run.name:
                from orchestrator.persistence.resume import named_checkpoint

                self.resumed_from, self.resume, self.skipped = named_checkpoint(self.config)
        return self._dataset

    def say_resuming(self) -> None:
        """The console lines of a run that goes on: the checkpoints passed over, and where from."""
        for name, why in self.skipped:
            print(f"orchestrator: skipped checkpoint {name}: {why}", file=sys.stderr, flush=True)
        if self.resume is not None:
            named = f"run {self.config.run.name}: " if self.config.run.name else ""
            place = (self.resume.get("run") or {}).get("in_epoch")
            where = f"inside epoch {place['epoch']}" if place else f"after epoch {self.resume['epoch']}"
            print(f"{named}resuming MLflow run {self.resume['mlflow_run_id']} from {self.resumed_from} ({where})",
                  flush=True)
        elif self.config.run.name:
            print(f"run {self.config.run.name}: no checkpoint yet, starting it", flush=True)

    def _look_in_memory(self, started_ray: bool) -> None:
        """checkpoint.in_memory: a run that goes on (by name or `resume`) takes its keeper's copy
        when it is of the same run as the stored checkpoint check() found and at least as new (or
        there is none). A state handed in without its path (`resume=` from Python) is kept."""
        cfg = self.config
        if not cfg.checkpoint.in_memory:
            return
        if started_ray:
            print("orchestrator: warning: checkpoint.in_memory: the Ray cluster this run started ends with it, and "
                  "its keeper too; join a cluster (RAY_ADDRESS) for a copy that outlives the driver",
                  file=sys.stderr, flush=True)
            return
        if (not cfg.run.name and self.resume is None) or (self.resume is not None and self.resumed_from is None):
            return
        from orchestrator.persistence.resume import newer_in_memory

        where, state, why = newer_in_memory(cfg, self.resumed_from, self.resume)
        if state is not None:
            self.resumed_from, self.resume = where, state
        elif self.resume is not None:
            print(f"orchestrator: not going on from memory: {why}", file=sys.stderr, flush=True)

    def fit(self) -> TrainResult:
        import ray

        from orchestrator.fleet import cluster
        from orchestrator.control.controller import Controller
        from orchestrator.reporting.progress import ProgressDisplay

        t0 = time.perf_counter()
        cfg = self.config
        dataset = self.check()
        connected_here = not ray.is_initialized()
        started_ray = cluster.connect(cfg.scaling.replicas * cfg.scaling.cpus_per_replica)
        for where in (cfg.checkpoint.storage, cfg.tracking.tracking_uri or ""):
            warning = cluster.node_local(where) if where else None
            if warning:
                print(f"orchestrator: warning: {warning}", file=sys.stderr, flush=True)
        try:  # before any actor: a cluster that cannot hold the replicas is bad input
            self._look_in_memory(started_ray)
            self.say_resuming()
            if started_ray:  # no autoscaler can add to a cluster started here: say so at once
                cluster.check_fits(cfg.scaling.replicas, cfg.scaling.cpus_per_replica, cfg.scaling.gpus_per_replica)
            else:
                cluster.wait_for_room(cfg.scaling.replicas, cfg.scaling.cpus_per_replica,
                                      cfg.scaling.gpus_per_replica, cfg.scaling.wait_for_room_s,
                                      say=lambda line: print(line, flush=True))
        except BaseException:
            if connected_here:  # leave nothing behind: stop the cluster we started, or leave the one we joined
                ray.shutdown()
            raise
        interrupts = Interrupts()  # this run's own: another trainer in the process never sees it
        previous_handlers = _interrupts_handled(interrupts)  # after ray.init, which installs its own
        display = ProgressDisplay(cfg.stop.epochs, enabled=self.show_progress)
        self.controller = ctl = Controller(cfg, dataset, None, t0, display, trace_ids=self._trace_ids,
                                           resume=self.resume, interrupts=interrupts)
        ctl.report.callbacks.extend(self.callbacks)
        tracker, status = None, "FAILED"
        try:
            ctl.launch()  # replica processes boot while MLflow opens its store
            ctl.tracker = tracker = _open_tracking(cfg, self.resume["mlflow_run_id"] if self.resume else None)
            _describe_run(tracker, cfg)
            if self.run_tags:
                tracker.set_tags(self.run_tags)
            display.line(f"tracking to {tracker.where()}")
            totals = ctl.run()
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            _end_on_interrupt(ctl, tracker, display, t0)
            raise
        finally:
            display.close()
            ctl.shutdown()
            if tracker is not None and status == "FAILED":
                tracker.event("ended", t0, status=status)
                _log_decisions(tracker, ctl)
                _log_plot(tracker, FAILED_PLOT_TIMEOUT_S)
                tracker.finish(status)
            if started_ray:
                ray.shutdown()
            for sig, handler in (previous_handlers or {}).items():
                signal.signal(sig, handler)
        result = _result(cfg, totals, tracker, time.perf_counter() - t0, ctl.phases)
        tracker.event("finished", t0, wall_s=round(result.wall_s, 3))
        tracker.log_metrics([("wall_s", result.wall_s, totals.steps),
                             ("samples_per_s_whole", result.samples_per_s, totals.steps),
                             ("steady_samples_per_s", result.steady_samples_per_s, totals.steps)]
                            + [(f"state_s.{name}", seconds, totals.steps) for name, seconds in result.state_s.items()])
        tracker.log_text(result.to_json(), "result.json")
        _log_decisions(tracker, ctl)
        _log_plot(tracker)
        tracker.finish("FINISHED")
        if self.show_progress:
            print(f"{result.headline(ctl.metric)}\n"
                  f"{tracker.where()}\n  view it: mlflow ui --backend-store-uri {tracker.tracking_uri}\n"
                  f"checkpoint: {result.checkpoint}", flush=True)
        return result


INTERRUPT_RECORD_TIMEOUT_S = 1.0  # `ray job stop` sends SIGKILL 3 s after SIGTERM: the record goes first
INTERRUPT_CHECKPOINT_TIMEOUT_S = 15.0
FAILED_PLOT_TIMEOUT_S = 10.0  # a failed run's training.png: the store may be what failed


def _log_decisions(tracker, ctl) -> None:
    """The control loop's decisions (orchestrator/control/decide.py: DecisionLog), as the run's
    `decisions.jsonl` artifact: `decide.replay` checks them again without the run."""
    log = ctl.context.ledger.decisions
    if log.records:
        tracker.log_text(log.jsonl(), "decisions.jsonl")


def _interrupts_handled(interrupts: "Interrupts"):
    """SIGTERM (`ray job stop`, a scheduler) ends the run like Ctrl-C (SIGINT): MLflow KILLED,
    then a checkpoint if time allows; both go to the run's `Interrupts.handler`, which holds an
    interrupt back while a fan-out of calls is being sent. Only the main thread can set
    handlers; returns the previous handlers to restore."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return {sig: signal.signal(sig, interrupts.handler) for sig in (signal.SIGTERM, signal.SIGINT)}


def _end_on_interrupt(ctl, tracker, display, t0: float) -> None:
    """Ctrl-C / SIGTERM. First the record, within about a second: the MLflow run is marked
    KILLED and events.jsonl written (a SIGKILL may follow soon). Then keep what was learned if
    time allows: the replicas stop at their next partition boundary (RunContext.halt) and rank 0
    gives its state; the checkpoint's path is added to the run's events. None while a rollback is
    pending (the replicas hold the model it undoes: the last checkpoint is kept)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a repeated SIGTERM does not cut this short
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C does
    if tracker is not None:
        tracker.event("ended", t0, status="KILLED")
        tracker.finish("KILLED", timeout_s=INTERRUPT_RECORD_TIMEOUT_S)
    if tracker is None or not ctl.replicas or ctl.steps_per_epoch == 0:  # never got going
        return
    if ctl.rolling_back:  # the replicas hold the model the rollback undoes: the last checkpoint is the one to go on from
        display.line("interrupted while a switch was being rolled back: no checkpoint (the last one is kept)")
    else:
        try:
            ctl.halt(INTERRUPT_RECORD_TIMEOUT_S)
            path = ctl.checkpoint("interrupted", INTERRUPT_CHECKPOINT_TIMEOUT_S, named="interrupted.pt",
                                  probation=ctl.probation).path  # and an event; a switch on probation stays on it
            display.line(f"interrupted: checkpoint written to {path}")
        except Exception as exc:  # the run is ending either way; say why nothing was saved
            display.line(f"interrupted: no checkpoint ({exc})")
    _log_plot(tracker, INTERRUPT_RECORD_TIMEOUT_S)
    tracker.flush(INTERRUPT_RECORD_TIMEOUT_S)


def _log_plot(tracker, timeout_s: Optional[float] = None) -> None:
    """training.png (orchestrator/reporting/plots.py) into the run, waiting up to timeout_s (default: the
    tracker's file timeout); a failure to draw it is said on stderr."""
    from orchestrator.reporting.plots import log_training_plot

    log_training_plot(tracker, warn=lambda line: print(f"orchestrator: {line}", file=sys.stderr, flush=True),
                      timeout_s=timeout_s)


def _open_tracking(cfg: JobConfig, run_id: Optional[str] = None):
    from orchestrator.reporting.tracking import Tracker

    tracker = Tracker(cfg.tracking.tracking_uri, cfg.tracking.experiment, cfg.tracking.run_name or cfg.run.name,
                      run_id=run_id)
    if cfg.tracking.tensorboard:
        from orchestrator.reporting.tensorboard import TensorBoardScalars

        tracker.mirror_to(TensorBoardScalars(cfg.tracking.tensorboard, cfg.run.name or tracker.run_id))
    return tracker


def _describe_run(tracker, cfg: JobConfig) -> None:
    from orchestrator.reporting.tracking import environment_tags

    if not tracker.resumed:  # a resumed run has them (MLflow refuses a param logged twice with another value)
        tracker.log_params(cfg.flat())
    tracker.set_tags({"mode": run_mode(cfg), "modes": " -> ".join(cfg.strategy.modes()),
                      "replicas": cfg.scaling.replicas, **environment_tags()})
    tracker.log_text(cfg.to_yaml(), "config.yaml")


def run_mode(cfg: JobConfig) -> str:
    """The run's mode: its one mode, or `phases` / `adaptive` when it switches."""
    if cfg.strategy.switch == "adaptive":
        return "adaptive"
    modes = cfg.strategy.modes()
    return modes[0] if len(modes) == 1 else "phases"


def _result(cfg: JobConfig, totals, tracker, wall_s: float, phases: list) -> TrainResult:
    return TrainResult(
        mlflow_run_id=tracker.run_id, mode=run_mode(cfg), replicas=cfg.scaling.replicas, phases=phases,
        epochs=totals.epochs, steps=totals.steps, samples=totals.samples, wall_s=wall_s,
        samples_per_s=totals.samples / max(totals.epoch_wall_s, 1e-9),
        steady_samples_per_s=totals.samples / max(totals.train_s, 1e-9),
        startup_s=totals.startup_s, time_to_target_s=totals.time_to_target_s,
        final=FinalMetrics({**totals.metrics, "train_loss": totals.train_loss}),
        stop_reason=totals.stop_reason, checkpoint=totals.checkpoint,
        tracking_uri=tracker.tracking_uri, experiment_id=tracker.experiment_id,
        rows_per_epoch=list(totals.rows_per_epoch), state_s=dict(totals.state_s), events=tracker.events,
    )
