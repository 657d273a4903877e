"""The job config: typed, validated, documented; YAML is a view of these models.

Every field carries a one-line description (docs/config.md, written by orchestrator/config_docs.py). Unknown keys are errors.
`JobConfig.from_yaml(path, overrides)` is the one way in from the outside world; it raises
`ConfigError` with a single line naming the field or file on bad input.
"""
from __future__ import annotations

import os
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer,
                      model_validator)

from orchestrator.errors import ConfigError
from policies.stop import Target


class Section(BaseModel):
    """A config section: unknown keys are errors; every field has a description (docs/config.md,
    orchestrator/config_docs.py)."""

    # inf and nan (also `1e400`, which overflows to inf) are rejected in every float field
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(Section):
    factory: str = Field(
        "examples.models:mnist_cnn",
        description="'module:function' returning a torch.nn.Module; importable on every Ray worker.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the factory."
    )

    @field_validator("factory")
    @classmethod
    def _module_colon_function(cls, v: str) -> str:
        module, sep, func = v.partition(":")
        if not sep or not module or not func:
            raise ValueError(f"must look like 'module:function', got {v!r}")
        return v


class DataConfig(Section):
    source: str = Field(
        "builtin:mnist5k",
        description="Dataset: builtin:mnist5k (5,000 real MNIST digits), builtin:digits (scikit-learn 8x8 "
        "digits), builtin:synthetic (Gaussian blobs), or a Parquet / CSV / Arrow IPC file or directory: a local "
        "path or any pyarrow filesystem URI (file://, s3://, gs://, hdfs://).",
    )
    label_column: Union[str, list[str]] = Field(
        "label", description="The target column (class ids for classification; a fixed-size-list column gives "
        "[n, k] targets), or a list of columns (targets [n, k], e.g. several regression targets); cast to the "
        "task's target dtype by the builtin decoder."
    )
    feature_columns: Optional[list[str]] = Field(
        None, description="Feature columns (numeric or fixed-size lists, concatenated into one vector of the task's "
        "input dtype, float32 for classification and regression); default: every column but the label and id columns."
    )
    decode: Optional[str] = Field(
        None, description="'module:function' turning a pyarrow.Table of rows into (inputs, targets), each a numpy "
        "array or torch tensor (or a dict of them) with the table's rows first; runs where rows are read (on the "
        "replica's node for file sources); default: the builtin decoder (feature_columns, feature_shape, "
        "label_column). See docs/data.md."
    )
    feature_shape: Optional[list[int]] = Field(
        None, description="Reshape each feature vector, e.g. [1, 28, 28] for images; default: flat."
    )
    id_column: Optional[str] = Field(None, description="Column of row ids (reported in traces); default: row number.")
    test_fraction: float = Field(
        0.2, gt=0, lt=1, description="Share of rows held out for testing: file sources hold out each row whose "
        "position hashes (with seed) below it, without reading the data; in-memory data a seeded random share."
    )
    test_source: Optional[str] = Field(None, description="A separate test set (same format rules); overrides test_fraction.")
    batch_size: int = Field(64, gt=0, description="Samples per step per replica; the last batch of each "
                            "partition is shorter when the partition's rows are not a multiple.")
    seed: int = Field(0, ge=0, lt=2**32, description="Seed for the split, partition order and shuffling; runs are "
                      "reproducible.")
    partitions: Optional[int] = Field(
        None, gt=0, description="Partitions the train split is cut into; default 4 x replicas (file sources: at "
        "least that, and enough that each holds at most ~64 MB of the source). Any count works in "
        "every mode (lock-step modes give a replica with fewer batches empty steps); a multiple of "
        "scaling.replicas keeps allreduce replicas equally busy."
    )
    prefetch_partitions: int = Field(
        2, ge=0, description="File sources: partitions a replica reads ahead of the one it trains on (each read "
        "on its node into the object store); bounds a replica's data in memory to 1 + this many partitions."
    )
    shuffle: bool = Field(True, description="Reshuffle partition order and rows within partitions every epoch "
                          "(file sources: partitions are contiguous row ranges, so this is a local shuffle).")

    @field_validator("source")
    @classmethod
    def _known_source(cls, v: str) -> str:
        from orchestrator.data import BUILTIN_SOURCES

        if v.startswith("builtin:") and v.removeprefix("builtin:") not in BUILTIN_SOURCES:
            names = ", ".join(f"builtin:{n}" for n in BUILTIN_SOURCES)
            raise ValueError(f"unknown builtin dataset {v!r}; choose one of {names}")
        return v

    @field_validator("label_column")
    @classmethod
    def _label_names(cls, v: Any) -> Any:
        names = [v] if isinstance(v, str) else v
        if not names or any(not n for n in names):
            raise ValueError("give a column name or a non-empty list of column names")
        return v

    @field_validator("decode")
    @classmethod
    def _decode_colon_function(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            module, sep, func = v.partition(":")
            if not sep or not module or not func:
                raise ValueError(f"must look like 'module:function', got {v!r}")
        return v

    @field_validator("feature_shape")
    @classmethod
    def _positive_dims(cls, v: Optional[list[int]]) -> Optional[list[int]]:
        if v is not None and (not v or any(d < 1 for d in v)):
            raise ValueError(f"dimensions must be >= 1, got {v}")
        return v


class TaskConfig(Section):
    """What is learned and how it is judged (policies/tasks.py, docs/tasks.md)."""

    name: str = Field(
        "classification", min_length=1, description="classification (cross-entropy; test_loss, test_accuracy), "
        "regression (mean squared error; test_loss, test_mse, test_mae, test_r2), language_model (next-token "
        "cross-entropy; test_loss, test_perplexity), or 'module:function' returning your own task."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the task's constructor.")

    def build(self) -> Any:
        """The task object (policies.tasks.load_task); ValueError on a task that cannot be loaded."""
        from policies.tasks import load_task

        return load_task(self.name, self.kwargs)


class TargetConfig(Section):
    """stop.target: the metric a run is judged by and the value that counts as reached."""

    metric: str = Field(min_length=1, description="A metric the task produces (e.g. test_r2) or train_loss.")
    goal: Literal["max", "min"] = Field(description="max: reached at value or above; min: at value or below.")
    value: float = Field(description="The target value.")


class OptimizerConfig(Section):
    name: Literal["sgd", "adam", "adagrad"] = Field(
        "sgd", description="The update rule: allreduce replicas step with it; downpour shards apply it (sgd or "
        "adagrad); easgd replicas take their local steps with it (sgd: plain or, with strategy.momentum > 0, "
        "EAMSGD's Nesterov momentum; adam and adagrad need strategy.momentum 0)."
    )
    lr: float = Field(0.05, gt=0, description="Learning rate (per step, for the global batch).")
    momentum: float = Field(
        0.9, ge=0, lt=1, description="SGD momentum (sgd in allreduce and on downpour shards; easgd uses "
        "strategy.momentum instead)."
    )
    weight_decay: float = Field(0.0, ge=0, description="L2 penalty added to the gradient.")


MODE_OPTIONS = {
    "allreduce": ("bucket_mb",),
    "downpour": ("n_fetch", "n_push", "max_in_flight", "max_staleness", "staleness_lr", "warmstart_steps"),
    "easgd": ("tau", "alpha", "variant", "momentum"),
}
UNTIL_COUNTS = ("epochs", "steps", "seconds")  # spent in the phase


class PhaseOptimizer(Section):
    """A phase's own optimizer settings: each given one overrides optimizer.* while the phase runs
    (e.g. a lower momentum for downpour's shards than for allreduce)."""

    lr: Optional[float] = Field(None, gt=0, description="As optimizer.lr.")
    momentum: Optional[float] = Field(None, ge=0, lt=1, description="As optimizer.momentum.")
    weight_decay: Optional[float] = Field(None, ge=0, description="As optimizer.weight_decay.")


class PhaseConfig(Section):
    """One phase of strategy.phases: a mode, that mode's options (each overrides the strategy.*
    value of the same name) and when the phase ends."""

    mode: Literal["allreduce", "downpour", "easgd"] = Field(description="The phase's synchronization mode.")
    until: Optional[dict[str, float]] = Field(
        None, description="One of {epochs: N}, {steps: N}, {seconds: S} spent in this phase, or {metric: threshold} "
        "for any metric the task produces or train_loss: reached (a metric whose goal is max, e.g. test_accuracy) or "
        "fallen to (goal min, e.g. test_loss)."
    )
    optimizer: Optional[PhaseOptimizer] = Field(None, description="This phase's optimizer.* overrides.")
    bucket_mb: Optional[float] = Field(None, gt=0, description="allreduce: as strategy.bucket_mb.")
    n_fetch: Optional[int] = Field(None, ge=1, description="downpour: as strategy.n_fetch.")
    n_push: Optional[int] = Field(None, ge=1, description="downpour: as strategy.n_push.")
    max_in_flight: Optional[int] = Field(None, ge=1, description="downpour: as strategy.max_in_flight.")
    max_staleness: Optional[int] = Field(None, ge=0, description="downpour: as strategy.max_staleness.")
    staleness_lr: Optional[bool] = Field(None, description="downpour: as strategy.staleness_lr.")
    warmstart_steps: Optional[int] = Field(None, ge=0, description="downpour: as strategy.warmstart_steps.")
    tau: Optional[int] = Field(None, ge=1, description="easgd: as strategy.tau.")
    alpha: Optional[float] = Field(None, gt=0, le=1, description="easgd: as strategy.alpha.")
    variant: Optional[Literal["async", "sync"]] = Field(None, description="easgd: as strategy.variant.")
    momentum: Optional[float] = Field(None, ge=0, lt=1, description="easgd: as strategy.momentum.")

    @field_validator("until")
    @classmethod
    def _one_condition(cls, v: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        if v is None:
            return v
        if len(v) != 1:
            raise ValueError(f"give exactly one condition, got {sorted(v) or 'none'}")
        (key, value), = v.items()
        if not key.isidentifier():
            raise ValueError(f"unknown condition {key!r}; choose one of {', '.join(UNTIL_COUNTS)} or a metric name")
        if value <= 0 or (key in ("epochs", "steps") and value != int(value)):
            raise ValueError(f"{key} must be {'a whole number ' if key in ('epochs', 'steps') else ''}> 0, got {value}")
        return v

    @model_validator(mode="after")
    def _options_of_its_mode(self) -> "PhaseConfig":
        for mode, options in MODE_OPTIONS.items():
            given = [o for o in options if getattr(self, o) is not None]
            if mode != self.mode and given:
                raise ValueError(f"{given[0]} is {'an' if mode[0] in 'ae' else 'a'} {mode} option; this phase's mode is {self.mode}")
        return self


class AdaptiveConfig(Section):
    """strategy.switch adaptive: from the step times the replicas report, go asynchronous while a
    replica straggles and come back when it recovers (policies/switching.py)."""

    sync_mode: Literal["allreduce"] = Field("allreduce", description="The mode while no replica straggles.")
    async_mode: Literal["downpour", "easgd"] = Field(
        "easgd", description="The mode while one does (asynchronous: the others do not wait for it); easgd runs "
        "as variant async with the strategy.* easgd options."
    )
    slow_ratio: float = Field(
        2.0, gt=1, description="A replica straggles when its compute time per step is at least this many times "
        "the median replica's."
    )
    recover_ratio: float = Field(
        1.4, gt=1, description="It has recovered when the slowest replica's ratio is at most this (below "
        "slow_ratio: the gap is the hysteresis)."
    )
    patience: int = Field(
        2, ge=1, description="Consecutive observations (one per replica progress report) a condition must hold."
    )
    min_phase_s: float = Field(3.0, ge=0, description="No switch sooner than this many seconds after the last one.")
    sync_optimizer: Optional[PhaseOptimizer] = Field(None, description="optimizer.* overrides in the synchronous mode.")
    async_optimizer: Optional[PhaseOptimizer] = Field(
        None, description="optimizer.* overrides in the asynchronous mode (e.g. a lower momentum for downpour)."
    )

    @model_validator(mode="after")
    def _hysteresis(self) -> "AdaptiveConfig":
        if self.recover_ratio >= self.slow_ratio:
            raise ValueError(f"recover_ratio ({self.recover_ratio}) must be below slow_ratio ({self.slow_ratio})")
        return self


class StrategyConfig(Section):
    mode: Literal["allreduce", "downpour", "easgd"] = Field(
        "allreduce", description="Synchronization mode: allreduce (synchronous data parallel), downpour "
        "(asynchronous SGD via parameter shards) or easgd (elastic averaging); see docs/modes.md."
    )
    timeout_s: float = Field(
        60.0, gt=0, description="Timeout of each call to the parameter shards and the partition server, and of the replicas' control calls (collectives and progress: fault_tolerance.hang_timeout_s)."
    )
    bucket_mb: float = Field(
        25.0, gt=0, description="Bucket size (MiB) for gradient all-reduce; the first bucket closes at "
        "1 MiB so the last layers' all-reduce overlaps the rest of the backward pass."
    )
    n_fetch: int = Field(1, ge=1, description="downpour: pull parameters from the shards every n_fetch steps.")
    n_push: int = Field(1, ge=1, description="downpour: push the accumulated gradient every n_push steps.")
    max_in_flight: int = Field(2, ge=1, description="downpour: pushes outstanding before a replica waits.")
    max_staleness: Optional[int] = Field(
        None, ge=0, description="downpour: a replica more than this many steps ahead of the slowest waits (SSP); "
        "none = unbounded."
    )
    staleness_lr: bool = Field(False, description="downpour: shards step eta / staleness for stale gradients.")
    warmstart_steps: int = Field(0, ge=0, description="downpour: rank 0 trains alone for this many steps first.")
    tau: int = Field(4, ge=1, description="easgd: elastic exchange with the center every tau steps.")
    alpha: Optional[float] = Field(
        None, gt=0, le=1, description="easgd: elastic coefficient; default 0.9 / replicas (beta = 0.9)."
    )
    variant: Literal["async", "sync"] = Field("async", description="easgd: asynchronous, or synchronous at a barrier.")
    momentum: float = Field(
        0.0, ge=0, lt=1, description="easgd: local Nesterov momentum (EAMSGD) when > 0; optimizer.name sgd only."
    )
    phases: Optional[list[PhaseConfig]] = Field(
        None, description="A run in phases, each {mode, that mode's options, until}: e.g. [{mode: downpour, n_push: "
        "4, until: {epochs: 2}}, {mode: allreduce, until: {test_accuracy: 0.96}}, {mode: easgd, tau: 8}]. `until`: "
        "epochs, steps or seconds spent in the phase, or a metric threshold (test_accuracy reached, test_loss or "
        "train_loss fallen to); the last phase has none and runs until the run stops. A phase's options override "
        "the strategy.* values above; none = one phase of strategy.mode. See docs/modes.md."
    )
    switch: Literal["schedule", "adaptive"] = Field(
        "schedule", description="Who picks the mode: schedule (strategy.phases, or strategy.mode throughout) or "
        "adaptive (strategy.adaptive switches between a synchronous and an asynchronous mode while the run goes)."
    )
    adaptive: AdaptiveConfig = Field(
        default_factory=lambda: AdaptiveConfig(), description="The adaptive switch policy's rules (switch: adaptive)."
    )

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        """A run in phases is dumped without strategy.mode (its default would read as the
        one-mode form, and mode with phases is a config error): config.yaml and a checkpoint's
        config load back as they were given."""
        out = handler(self)
        if self.phases is not None and "mode" not in self.model_fields_set:
            out.pop("mode", None)
        return out

    @model_validator(mode="after")
    def _phases_fit(self) -> "StrategyConfig":
        if self.phases is None:
            if self.switch == "adaptive" and self.variant == "sync":
                raise ValueError("switch adaptive switches to and from asynchronous EASGD; strategy.variant "
                                 "sync cannot take part")
            return self
        if "mode" in self.model_fields_set:
            raise ValueError("set mode (one mode) or phases, not both")
        if self.switch == "adaptive":
            raise ValueError("switch adaptive picks the modes itself; remove phases or use "
                             "switch: schedule")
        if not self.phases:
            raise ValueError("phases: give at least one phase")
        for i, phase in enumerate(self.phases):
            last = i == len(self.phases) - 1
            if last and phase.until is not None:
                raise ValueError(f"phases[{i}]: the last phase runs until the run stops; remove its until")
            if not last and phase.until is None:
                raise ValueError(f"phases[{i}]: every phase but the last needs until (epochs, steps, "
                                 "seconds or a metric threshold)")
            variant = phase.variant if phase.variant is not None else self.variant
            if len(self.phases) > 1 and phase.mode == "easgd" and variant == "sync":
                raise ValueError(f"phases[{i}]: synchronous EASGD cannot switch mid-run (its rounds are "
                                 "not paused yet); use variant async in a run with several phases")
        return self

    def plan(self) -> list[dict[str, Any]]:
        """The strategy of each phase, in order: every strategy.* value with the phase's own
        options over it, `until` (None for the last) and `optimizer` (its optimizer.* overrides). `switch: adaptive`: the synchronous
        and the asynchronous mode it moves between (no until; the policy decides)."""
        base = self.model_dump(exclude={"phases", "switch", "adaptive"})

        def opt(o: Optional[PhaseOptimizer]) -> dict[str, Any]:
            return o.model_dump(exclude_none=True) if o is not None else {}

        if self.switch == "adaptive":
            a = self.adaptive
            return [{**base, "mode": m, "variant": "async", "until": None, "optimizer": opt(o)}
                    for m, o in ((a.sync_mode, a.sync_optimizer), (a.async_mode, a.async_optimizer))]
        phases = self.phases or [PhaseConfig(mode=self.mode)]
        return [{**base, **phase.model_dump(exclude_none=True, exclude={"until", "optimizer"}), "until": phase.until,
                 "optimizer": opt(phase.optimizer)} for phase in phases]

    def modes(self) -> list[str]:
        """Every mode the run can take."""
        return [p["mode"] for p in self.plan()]




class ScalingConfig(Section):
    replicas: int = Field(2, ge=1, description="Number of ModelReplica actors.")
    cpus_per_replica: float = Field(1.0, gt=0, description="Logical CPUs per replica (also its torch threads).")
    gpus_per_replica: float = Field(
        0.0, ge=0, description="GPUs per replica; > 0 selects the NCCL backend (allreduce: 0 or at least 1, "
        "NCCL cannot put two ranks on one GPU)."
    )
    shards: int = Field(
        1, ge=1, description="ParameterShard actors (downpour, easgd); they reserve no CPU; at most one per "
        "model parameter."
    )
    min_replicas: int = Field(
        1, ge=1, description="The fewest replicas the run goes on with when a dead replica is not replaced "
        "(fault_tolerance.max_replica_restarts spent, or its node gone and no room elsewhere: a shrink); below it "
        "the run fails."
    )
    max_replicas: Optional[int] = Field(
        None, ge=1, description="The most replicas the run may grow to when the cluster has room; none = "
        "scaling.replicas (no growth beyond it; a run that shrank grows back to it). New replicas start when room "
        "is seen and join once ready, at the replicas' next partition boundary; while below it the run asks the "
        "autoscaler for the room "
        "(docs/elasticity.md)."
    )
    lr_scaling: Literal["linear", "none"] = Field(
        "linear", description="How the learning rate follows the replica count on a resize: linear (optimizer.lr "
        "x replicas / scaling.replicas, a rise reached by a warmup of lr_warmup_steps) or none (optimizer.lr "
        "throughout). Applies to allreduce (its batch is replicas x data.batch_size); easgd keeps beta = replicas "
        "x alpha; downpour's rate does not change."
    )
    lr_warmup_steps: int = Field(
        100, ge=0, description="Steps of the linear ramp from the current learning rate up to the new one after a "
        "grow (lr_scaling linear); 0 = at once. A shrink lowers the rate at once."
    )
    poll_s: float = Field(
        5.0, gt=0, description="Seconds between two looks at the cluster's resources by the scaling policy (a "
        "replica whose node dies is seen at once, without waiting for a poll)."
    )
    grow_after: int = Field(
        2, ge=1, description="Consecutive polls that must see room for another replica before the run grows (a "
        "shrink after lost resources is at once)."
    )
    wait_for_room_s: float = Field(
        600.0, ge=0, le=86400, description="On a cluster the run joins (RAY_ADDRESS, `ray job submit`, an earlier "
        "ray.init) that cannot hold the starting replicas yet: ask the autoscaler for them and wait up to this "
        "many seconds for the room (a cluster scaling up from zero worker nodes), then exit 2 naming what is "
        "short. 0 = refuse at once. A local cluster the run starts itself is never waited for."
    )

    def max_or_replicas(self) -> int:
        """max_replicas, or replicas when it is unset (no growth)."""
        return self.max_replicas if self.max_replicas is not None else self.replicas


class FaultToleranceConfig(Section):
    max_replica_restarts: int = Field(
        3, ge=0, description="Replicas replaced per run (a dead, hung or raising replica is replaced by a new "
        "actor or a spare); past it a dead replica is dropped if scaling.min_replicas allows, else the run fails."
    )
    restart_backoff_s: float = Field(
        0.0, ge=0, description="Seconds to wait before the n-th replacement in a row: restart_backoff_s * "
        "2^(n-1), at most 30 s; 0 replaces at once. A run that goes one epoch without a failure starts over at n = 1."
    )
    spares: int = Field(
        0, ge=0, description="Idle replicas started with the run (model built, no CPU reserved; with GPUs each holds its GPU): a failed replica "
        "is replaced at once by a spare, which is then started afresh in the background."
    )
    hang_timeout_s: float = Field(
        60.0, gt=0, description="A replica that reports no progress for this long is hung: it is killed and "
        "replaced. allreduce: also the process group's collective timeout. A parameter shard or the partition "
        "server whose pings go unanswered for half of it is killed and rebuilt (from its snapshot, its journal)."
    )
    shard_snapshot_every_s: float = Field(
        5.0, gt=0, description="downpour, easgd: seconds between snapshots of each parameter shard, from which a "
        "dead shard is rebuilt (the replicas replay the updates they pushed since)."
    )


class SlowWindow(Section):
    """A deliberate straggler: replica `rank` slowed while its step count or the training time
    is inside the window."""

    rank: int = Field(ge=0, description="The replica to slow.")
    delay_s: Optional[float] = Field(None, ge=0, description="Seconds added to each of its steps.")
    factor: Optional[float] = Field(
        None, ge=1, description="Or: its steps take this many times as long (after each step it sleeps factor - 1 "
        "times that step's duration)."
    )
    from_step: Optional[int] = Field(None, ge=0, description="From this step of the replica on (default: the start).")
    to_step: Optional[int] = Field(None, ge=0, description="Until this step (default: the end).")
    from_s: Optional[float] = Field(None, ge=0, description="From this many seconds after training started.")
    to_s: Optional[float] = Field(None, ge=0, description="Until this many seconds after training started.")

    @model_validator(mode="after")
    def _one_way(self) -> "SlowWindow":
        if (self.delay_s is None) == (self.factor is None):
            raise ValueError("give delay_s or factor (one of them)")
        if (self.from_step is not None or self.to_step is not None) and (self.from_s is not None or self.to_s is not None):
            raise ValueError("give the window in steps (from_step, to_step) or seconds (from_s, to_s), not both")
        return self


class FaultsConfig(Section):
    slow_replicas: list[SlowWindow] = Field(
        default_factory=list, description="Straggler experiments: a list of windows {rank, delay_s or factor, "
        "from_step/to_step or from_s/to_s}; or the short form {rank: seconds added to each step} (all run long)."
    )

    @field_validator("slow_replicas", mode="before")
    @classmethod
    def _short_form(cls, v: Any) -> Any:
        if isinstance(v, dict):
            for rank, delay in v.items():
                if not isinstance(rank, int) or rank < 0 or not isinstance(delay, (int, float)) or delay < 0:
                    raise ValueError(f"ranks and delays must be >= 0, got {rank}: {delay}")
            return [{"rank": rank, "delay_s": delay} for rank, delay in v.items()]
        return v


class StopConfig(Section):
    epochs: int = Field(5, ge=1, description="Stop after this many epochs.")
    target: Optional[TargetConfig] = Field(
        None, description="{metric: NAME, goal: max|min, value: X}: stop once the metric reaches the value (goal max: "
        "at or above; min: at or below). NAME is a metric the task produces (checked before the run starts)."
    )
    target_accuracy: Optional[float] = Field(
        None, gt=0, le=1, description="Classification shorthand for target {metric: test_accuracy, goal: max, value: "
        "this} (0..1]."
    )
    at_target: bool = Field(
        True, description="End the run at the target; false only records time_to_target_s."
    )

    @model_validator(mode="after")
    def _one_target(self) -> "StopConfig":
        if self.target is not None and self.target_accuracy is not None:
            raise ValueError("give stop.target or stop.target_accuracy, not both")
        return self

    def the_target(self) -> Optional[Target]:
        """The target as one value, whichever way it was given (None: no target)."""
        if self.target_accuracy is not None:
            return Target("test_accuracy", "max", self.target_accuracy)
        return Target(self.target.metric, self.target.goal, self.target.value) if self.target is not None else None
    max_wall_s: Optional[float] = Field(None, gt=0, description="Stop after this many seconds of training.")


class TrackingConfig(Section):
    experiment: str = Field("elastic-orchestrator", min_length=1, description="MLflow experiment name.")
    tracking_uri: Optional[str] = Field(
        None, description="MLflow tracking URI; default: MLflow's own default (MLFLOW_TRACKING_URI or local). A "
        "new experiment in a sqlite store keeps its artifacts in `mlruns/<experiment>/` beside the database file."
    )
    run_name: Optional[str] = Field(None, description="MLflow run name; default: MLflow picks one.")
    register_as: Optional[str] = Field(
        None, min_length=1, description="Also register the run's final model (logged as `runs:/<run id>/model`) in "
        "the MLflow model registry under this name, as a new version; default: not registered."
    )
    log_every_steps: int = Field(10, ge=1, description="Log train loss and samples/s every this many steps.")
    progress_interval_s: float = Field(
        1.0, ge=0, description="Replicas send their progress rows (one every log_every_steps steps, each with its own "
        "step and figures) to the driver at most this often, and the rest with the epoch's end; 0 = each row at once. "
        "Sending less often costs the step loops less."
    )


RUN_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"


class RunConfig(Section):
    name: Optional[str] = Field(
        None, pattern=RUN_NAME, description="Names the run (also `--name NAME` on the command line): its checkpoints "
        "go to `<checkpoint.storage>/<name>/`, and starting a run of the same name again goes on from its newest good "
        "checkpoint, in the same MLflow run (the console says so); a finished run of that name is refused, and a "
        "config that differs from the checkpoint's in anything but `stop` is refused, naming the keys. Letters, "
        "digits, `_`, `.` and `-`, up to 128. Default: none; a fresh run whose checkpoints go to "
        "`<checkpoint.storage>/<mlflow run id>/` (`orchestrator resume` goes on from those). Also the MLflow run "
        "name when tracking.run_name is not set."
    )


class CheckpointConfig(Section):
    storage: str = Field(
        "runs/checkpoints",
        description="Where checkpoints go: a local path or any pyarrow.fs URI (file://, s3://, gs://, hdfs://).",
    )
    every_epochs: int = Field(
        1, ge=0, description="Checkpoint at the end of every N-th epoch (by default every epoch, so a killed run can "
        "go on; docs/fault-tolerance.md gives the cost); 0 = off (with every_s 0 too: only the final model)."
    )
    every_s: float = Field(
        0.0, ge=0, description="Also checkpoint at the first epoch end at least this many seconds after the last "
        "checkpoint was written (or training started); checked only at epoch ends, so a checkpoint can come up to an "
        "epoch later than this; 0 = off."
    )
    keep: int = Field(
        3, ge=1, description="Checkpoints kept per run, each `<storage>/<run.name or mlflow run id>/ckpt-<step>-<tag>.pt` with a `.json` "
        "sidecar (its length and sha256): after each save all but the newest `keep` (by step) are deleted. The "
        "extra copies model.pt and interrupted.pt are never deleted."
    )


class JobConfig(Section):
    """A whole job. Build it in Python, or load it from YAML with `JobConfig.from_yaml`."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="What to train.")
    task: TaskConfig = Field(default_factory=TaskConfig, description="What is learned and how it is judged.")
    data: DataConfig = Field(default_factory=DataConfig, description="What to train on.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="How to step.")
    strategy: StrategyConfig = Field(default_factory=StrategyConfig, description="How replicas synchronize.")
    scaling: ScalingConfig = Field(default_factory=ScalingConfig, description="How many replicas, how big.")
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
        if "downpour" in self.strategy.modes() and self.optimizer.name not in ("sgd", "adagrad"):
            raise ValueError(f"optimizer.name: downpour shards apply sgd or adagrad, not {self.optimizer.name}")
        return self

    @model_validator(mode="after")
    def _metrics_known(self) -> "JobConfig":
        """stop.target's metric and each phase's `until` metric are ones the task produces."""
        try:
            task = self.task.build()
        except ValueError as exc:
            raise ValueError(f"task.name: {exc}") from None
        known = {**dict(task.goals), "train_loss": "min"}
        names = ", ".join(known)
        target = self.stop.the_target()
        if target is not None and target.metric not in known:
            raise ValueError(f"stop.target.metric: the {self.task.name} task has no metric {target.metric!r}; "
                             f"choose one of {names}")
        for i, phase in enumerate(self.strategy.phases or []):
            key = next(iter(phase.until or {}), None)
            if key is not None and key not in UNTIL_COUNTS and key not in known:
                raise ValueError(f"strategy.phases[{i}].until: unknown condition {key!r}; choose one of "
                                 f"{', '.join(UNTIL_COUNTS)} or a metric of the {self.task.name} task ({names})")
        return self

    def metric_goals(self) -> dict[str, str]:
        """Every metric name a run of this job produces, with its goal (the task's and train_loss)."""
        return {**dict(self.task.build().goals), "train_loss": "min"}

    def headline_metric(self) -> str:
        """The metric the run is judged by: stop.target's, else the task's primary metric
        (classification: test_accuracy)."""
        from policies.tasks import primary_metric

        target = self.stop.the_target()
        return target.metric if target is not None else primary_metric(self.task.build())

    @model_validator(mode="after")
    def _optimizer_fits(self) -> "JobConfig":
        opt = self.optimizer
        for phase in self.strategy.plan():
            if phase["mode"] == "easgd" and opt.name != "sgd" and phase["momentum"] > 0:
                raise ValueError(f"strategy.momentum is EAMSGD's Nesterov momentum for optimizer.name sgd; set it "
                                 f"to 0 with optimizer.name {opt.name} (got {phase['momentum']})")
        return self

    @model_validator(mode="after")
    def _scaling_fits(self) -> "JobConfig":
        gpus = self.scaling.gpus_per_replica
        if "allreduce" in self.strategy.modes() and 0 < gpus < 1:
            raise ValueError(f"scaling.gpus_per_replica: allreduce needs a whole GPU per replica (NCCL cannot put "
                             f"two ranks on one GPU), got {gpus}")
        missing = sorted(w.rank for w in self.faults.slow_replicas if w.rank >= self.scaling.replicas)
        if missing:
            raise ValueError(f"faults.slow_replicas: no replica of rank {missing[0]}; ranks are 0.."
                             f"{self.scaling.replicas - 1} (scaling.replicas {self.scaling.replicas})")
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
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        try:
            with open(path, encoding="utf-8") as f:
                raw = yaml.safe_load(f) or {}
        except RecursionError:
            raise ConfigError(f"config file {path} is not valid YAML: nested too deeply") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {path} is not UTF-8 text ({exc.reason}: byte "
                              f"0x{exc.object[exc.start]:02x})") from None
        except OSError as exc:
            raise ConfigError(f"config file {path} cannot be read ({exc.strerror or exc})") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            problem = " ".join(str(getattr(exc, "problem", None) or getattr(exc, "reason", None) or exc).split())
            raise ConfigError(f"config file {path}{where} is not valid YAML: {problem}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
        why = yaml_shape_problem(raw)
        if why:
            raise ConfigError(f"config file {path} is not valid YAML: {why}")
        return cls.from_dict(raw, overrides)

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


MAX_YAML_VALUES = 1_000_000  # a config (or sweep) file's values, its aliases expanded


def yaml_shape_problem(value: Any) -> Optional[str]:
    """Why a loaded YAML value cannot be a config, or None: it contains itself (an alias inside
    its own anchor), nests too deeply, or holds more than MAX_YAML_VALUES values once its aliases
    are expanded (a few lines of anchors can stand for billions of values, which every later
    copy or dump of the config would expand)."""
    sizes: dict[int, int] = {}
    open_ids: set[int] = set()

    def size(v: Any) -> int:
        if not isinstance(v, (dict, list)):
            return 1
        key = id(v)
        if key in sizes:
            return sizes[key]
        if key in open_ids:
            raise _Shape("a value contains itself (an alias inside its own anchor)")
        open_ids.add(key)
        items = [*v.keys(), *v.values()] if isinstance(v, dict) else v
        n = 1
        for item in items:
            n += size(item)
            if n > MAX_YAML_VALUES:
                raise _Shape(f"more than {MAX_YAML_VALUES:,} values once its aliases are expanded")
        open_ids.discard(key)
        sizes[key] = n
        return n

    try:
        size(value)
    except _Shape as exc:
        return str(exc)
    except RecursionError:
        return "nested too deeply"
    return None


class _Shape(Exception):
    pass


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
            value = yaml.safe_load(text) if text.strip() else ""
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
