"""The config sections of what is trained, on what, and how it is kept: model, data, task,
optimizer, stop rules, tracking, the run's name and checkpoints (orchestrator/config/job.py puts
them together)."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from policies.decisions.stop import Target


class Section(BaseModel):
    """A config section: unknown keys are errors; every field has a description (docs/config.md,
    orchestrator/cli/config_docs.py)."""

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
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Forward and loss under torch.autocast in this dtype on the replica's device (bf16 works "
        "on CPU too); parameters, gradients, optimizer state and the reduction stay fp32. fp16 scales the loss "
        "(torch.amp.GradScaler) and skips a step whose gradient holds inf/NaN, every allreduce replica alike. "
        "See docs/training.md."
    )
    compile: bool = Field(
        False, description="torch.compile the model on each replica, once per replica process (not again at a switch "
        "or a reload); the first steps pay the compile time."
    )

    @field_validator("factory")
    @classmethod
    def _module_colon_function(cls, v: str) -> str:
        module, sep, func = v.partition(":")
        if not sep or not module or not func:
            raise ValueError(f"must look like 'module:function', got {v!r}")
        return v


class AdaptiveBatchConfig(Section):
    """data.adaptive_batch: allreduce's batch grows with the measured gradient noise
    (policies/decisions/batch_size.py, docs/modes-allreduce-options.md "Adaptive batch size")."""

    max: int = Field(gt=0, description="The largest batch per replica (at least data.batch_size, where it starts).")
    factor: int = Field(2, ge=2, description="Each growth multiplies the batch by this, while the result is at most "
                        "max.")


class DataConfig(Section):
    source: str = Field(
        "builtin:mnist5k",
        description="Dataset: builtin:mnist5k (5,000 real MNIST digits), builtin:digits (scikit-learn 8x8 "
        "digits), builtin:synthetic (Gaussian blobs), or a Parquet / CSV / Arrow IPC file or directory: a local "
        "path or any pyarrow filesystem URI (file://, s3://, gs://, hdfs://), or 'module:function' returning a "
        "map-style torch Dataset (__len__ and __getitem__) or a (train, test) pair of them, importable on every Ray "
        "worker (docs/data.md, \"A torch Dataset\"). A builtin comes decoded and split: with one, label_column, "
        "feature_columns, decode, feature_shape, id_column, test_source and test_fraction are refused (they apply to "
        "files and in-memory data). With a torch Dataset, feature_columns, decode, feature_shape and id_column are "
        "refused (its items are collated: collate).",
    )
    label_column: Union[str, list[str]] = Field(
        "label", description="The target column (class ids for classification; a fixed-size-list column gives "
        "[n, k] targets), or a list of columns (targets [n, k], e.g. several regression targets); cast to the "
        "task's target dtype by the builtin decoder. A torch Dataset whose items are dicts: the key(s) of the "
        "targets (the other keys are the inputs)."
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
    collate: Optional[str] = Field(
        None, description="A torch Dataset: 'module:function' turning a list of items into (inputs, targets), or a "
        "dict split by label_column, with one row per item (tensors, arrays or dicts of them); called once per "
        "partition read and evaluation piece with all their items, not per batch; default: "
        "torch.utils.data.default_collate."
    )
    loader_workers: int = Field(
        0, ge=0, le=256, description="A torch Dataset: threads calling __getitem__ in parallel in each partition "
        "read (on the replica's node) and evaluation piece; 0 = one at a time. Threads, not processes (see "
        "docs/data.md): they help where __getitem__ releases the GIL (file reads, image decoding, numpy and torch "
        "ops); the dataset must be safe to call from several threads."
    )
    feature_shape: Optional[list[int]] = Field(
        None, description="Reshape each feature vector, e.g. [1, 28, 28] for images; default: flat."
    )
    id_column: Optional[str] = Field(None, description="Column of row ids (reported in traces); default: row number.")
    test_fraction: float = Field(
        0.2, gt=0, lt=1, description="Share of rows held out for testing: file sources hold out each row whose "
        "position hashes (with seed) below it, without reading the data; in-memory data and a torch Dataset a "
        "seeded random share (a random permutation of the rows or indices)."
    )
    test_source: Optional[str] = Field(None, description="A separate test set (same format rules; with a torch "
                                       "Dataset source, a 'module:function' returning one); overrides test_fraction.")
    val_fraction: float = Field(
        0.0, ge=0, lt=1, description="Share of the train rows held out for validation (0 = none). With one, every "
        "evaluation during the run is on it and its metrics are val_* (val_accuracy, val_loss, ...): targets, until, "
        "early stopping, the best checkpoint and sweeps judge on them, and the test split is evaluated once, on the "
        "final model (`final` holds both). File sources hold out each train row whose position hashes (with seed, "
        "independently of the test hash) below it; in-memory data, builtins and torch Datasets a seeded random share."
    )
    val_source: Optional[str] = Field(
        None, description="A separate validation set instead of val_fraction (same format rules as test_source; with "
        "a torch Dataset source, a 'module:function' returning one): the run is judged on it as with val_fraction."
    )
    batch_size: int = Field(64, gt=0, description="Samples per step per replica (per micro-batch with accumulate > "
                            "1); the last batch of each partition is shorter when the partition's rows are not a "
                            "multiple.")
    adaptive_batch: Optional[AdaptiveBatchConfig] = Field(
        None, description="{max, factor}: at each epoch's end the batch (per replica, from data.batch_size) is "
        "multiplied by factor while the gradient noise scale measured across the replicas is at least the grown "
        "global batch, and the learning rate follows it (scaling.lr_scaling, scaling.lr_warmup_steps). allreduce "
        "in one phase, 2 or more replicas, equal shares. Also written data.batch_size: {adaptive: {min, max}}."
    )
    accumulate: int = Field(
        1, ge=1, description="Micro-batches per optimizer step: a step takes accumulate x batch_size rows as this "
        "many forward and backward passes, gradients summed, then one optimizer step (one reduction in allreduce, "
        "one push in downpour): the step on the union of the micro-batches."
    )
    seed: int = Field(0, ge=0, lt=2**32, description="Seed for the split, partition order and shuffling; runs are "
                      "reproducible.")
    partitions: Optional[int] = Field(
        None, gt=0, description="Partitions the train split is cut into; default 4 x replicas (file sources: at "
        "least that, and enough that each holds at most ~64 MB of the source). Any count works in "
        "every mode (lock-step modes give a replica with fewer batches empty steps); a multiple of "
        "scaling.replicas keeps allreduce replicas equally busy."
    )
    prefetch_partitions: int = Field(
        2, ge=0, description="File sources and torch Datasets: partitions a replica reads ahead of the one it trains on (each read "
        "on its node into the object store); bounds a replica's data in memory to 1 + this many partitions."
    )
    shuffle: bool = Field(True, description="Reshuffle partition order and rows within partitions every epoch "
                          "(file sources: partitions are contiguous row ranges, so this is a local shuffle).")

    @model_validator(mode="before")
    @classmethod
    def _adaptive_spelling(cls, raw: Any) -> Any:
        """data.batch_size: {adaptive: {min, max[, factor]}} is data.batch_size min with data.adaptive_batch."""
        size = raw.get("batch_size") if isinstance(raw, dict) else None
        if not isinstance(size, dict):
            return raw
        inner = size.get("adaptive")
        if set(size) != {"adaptive"} or not isinstance(inner, dict) or not {"min", "max"} <= set(inner):
            raise ValueError("batch_size: give a number, or {adaptive: {min: N, max: M}} (optionally factor)")
        if "adaptive_batch" in raw:
            raise ValueError("batch_size: {adaptive: ...} and adaptive_batch are the same setting: give one")
        rest = {k: v for k, v in inner.items() if k != "min"}
        return {**raw, "batch_size": inner["min"], "adaptive_batch": rest}

    @field_validator("source")
    @classmethod
    def _known_source(cls, v: str) -> str:
        from orchestrator.data.in_memory import BUILTIN_SOURCES

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

    @field_validator("decode", "collate")
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
    """What is learned and how it is judged (policies/rules/tasks.py, docs/tasks.md)."""

    name: str = Field(
        "classification", min_length=1, description="classification (cross-entropy; test_loss, test_accuracy), "
        "regression (mean squared error; test_loss, test_mse, test_mae, test_r2), language_model (next-token "
        "cross-entropy; test_loss, test_perplexity), model_loss (the model's own loss from the labels= it is given, "
        "Hugging Face's convention; kwargs causal: true gives test_loss, test_perplexity, false test_loss, "
        "test_accuracy), or 'module:function' returning your own task."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the task's constructor.")

    def build(self) -> Any:
        """The task object (policies.rules.tasks.load_task); ValueError on a task that cannot be loaded."""
        from policies.rules.tasks import load_task

        return load_task(self.name, self.kwargs)


class TargetConfig(Section):
    """stop.target: the metric a run is judged by and the value that counts as reached."""

    metric: str = Field(min_length=1, description="A metric the task produces (e.g. test_r2) or train_loss.")
    goal: Literal["max", "min"] = Field(description="max: reached at value or above; min: at value or below.")
    value: float = Field(description="The target value.")


class EvalConfig(Section):
    every_steps: Optional[int] = Field(
        None, gt=0, description="Also evaluate every this many optimizer steps of each replica's clock (the "
        "schedule's), not only at each epoch's end (none: at each epoch's end only). Each evaluation is on the "
        "evaluated split (val_* with a validation split, else test_*): logged to MLflow at its step, an `evaluation` "
        "event, a point of training.png, and a target reached there counts (time_to_target_s); early stopping, the "
        "best checkpoint, `until` and the stop decision stay at epoch ends."
    )


class EarlyStoppingConfig(Section):
    patience: int = Field(3, ge=1, description="Epochs without a gain on the best before the run stops.")
    min_delta: float = Field(0.0, ge=0, description="A gain is more than this in the metric's direction.")


class WatchConfig(Section):
    """stop.watch: the metric early stopping and checkpoint.keep_best follow."""

    metric: str = Field(min_length=1, description="A metric the task produces on the evaluated split (e.g. "
                        "test_loss, val_accuracy) or train_loss (checked before the run starts).")
    goal: Optional[Literal["max", "min"]] = Field(
        None, description="max: higher is better; min: lower. Default: the metric's own (the task's goals).")


class StopConfig(Section):
    epochs: int = Field(5, ge=1, description="Stop after this many epochs.")
    early_stopping: Optional[EarlyStoppingConfig] = Field(
        None, description="{patience, min_delta}: stop once the watched metric (stop.watch, else the headline: "
        "stop.target's, else the task's primary one, e.g. test_accuracy) has not beaten its best by more than "
        "min_delta for patience epochs."
    )
    watch: Optional[WatchConfig] = Field(
        None, description="{metric: NAME, goal: max|min}: the metric early stopping and checkpoint.keep_best follow "
        "(goal: default the metric's own); none: the headline metric (stop.target's, else the task's primary one)."
    )
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
    max_steps: Optional[int] = Field(
        None, ge=1, description="Stop once the model has taken this many updates (optimizer steps of the global "
        "batch), inside an epoch: every replica stops after that step, the model is evaluated and the run ends "
        "(allreduce, fsdp, local_sgd, gossip and synchronous easgd; stop.epochs still ends it first). "
        "optimizer.schedule plans over the fewer of the two."
    )


class TrackingConfig(Section):
    experiment: str = Field("elastic-orchestrator", min_length=1, description="MLflow experiment name.")
    tracking_uri: Optional[str] = Field(
        None, description="MLflow tracking URI; default: MLflow's own default (MLFLOW_TRACKING_URI or local). A "
        "new experiment in a sqlite store keeps its artifacts in `mlruns/<experiment>/` beside the database file. "
        "Inside a Ray job's temporary working-directory copy, a store that would be a file there (this unset and no "
        "MLFLOW_TRACKING_URI, or a relative sqlite URI or path) goes under `$ORCHESTRATOR_HOME` (docs/clusters.md)."
    )
    run_name: Optional[str] = Field(None, description="MLflow run name; default: MLflow picks one.")
    tensorboard: Optional[str] = Field(
        None, description="Also write every metric logged to MLflow (the same names and steps) as TensorBoard "
        "scalars under DIR/<run.name or the MLflow run id>/ (`tensorboard --logdir DIR`); none: MLflow only."
    )
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
        description="Where checkpoints go: a local path or any pyarrow.fs URI (file://, s3://, gs://, hdfs://). A "
        "relative path inside a Ray job's temporary working-directory copy (`ray job submit --working-dir`) goes under "
        "`$ORCHESTRATOR_HOME` (default `~/elastic-orchestrator`) instead, where the next job finds it "
        "(docs/clusters.md).",
    )
    every_epochs: int = Field(
        1, ge=0, description="Checkpoint at the end of every N-th epoch (by default every epoch, so a killed run can "
        "go on; docs/fault-tolerance.md gives the cost); 0 = off (with every_s 0 too: only the final model)."
    )
    every_s: float = Field(
        0.0, ge=0, description="Also checkpoint once this many seconds have passed since the last checkpoint was "
        "written (or training started), inside an epoch as `every_steps` does (at an epoch end when one comes "
        "first); 0 = off."
    )
    every_steps: int = Field(
        0, ge=0, description="Also checkpoint inside an epoch every this many steps (of the furthest replica) since "
        "the last checkpoint: the replicas pause at their next partition boundary (allreduce: all after the same "
        "step), the checkpoint records which rows of the epoch were trained, and they go on. A run started again "
        "from it (by name or `resume`) goes on inside the epoch: every row of the epoch is trained once across "
        "the restart (docs/fault-tolerance.md). 0 = off."
    )
    background: bool = Field(
        True, description="Write the periodic checkpoints (epoch ends, inside an epoch) on a background thread: the "
        "replicas wait only while the state is taken and train on while it is stored; a newer checkpoint replaces "
        "one still waiting to be written (its `checkpoint_failed` event says superseded), never waits behind it. The "
        "final and the interrupted checkpoint are always written before the run ends. false: every checkpoint is "
        "stored before training goes on."
    )
    in_memory: bool = Field(
        False, description="Also hand every periodic checkpoint to a keeper (before it is stored; one the run waits "
        "on, after): a detached actor holding the newest one in memory on another node than the driver's when the "
        "cluster has one. A run started again (by name or `resume`) goes on from that copy when it is of the same "
        "run as the store's newest good checkpoint and at least as new (a named run also when the store has none; "
        "`resume` needs one stored, which its config comes from): a checkpoint the driver died before storing, or "
        "a node-local storage lost with the driver's node, costs nothing, and nothing is read from storage "
        "(docs/fault-tolerance.md). The run's final checkpoint ends the keeper; one whose driver died ends "
        "`in_memory_keep_s` later. Needs a Ray cluster that outlives the driver (RAY_ADDRESS); not in sweeps."
    )
    in_memory_keep_s: float = Field(
        3600.0, gt=0, description="How long a keeper (checkpoint.in_memory) goes on holding its copy once no driver "
        "touches it (its driver died and the run was not started again), in seconds."
    )
    keep_best: bool = Field(
        False, description="Also keep the best epoch's checkpoint (by the watched metric, stop.watch, else the "
        "headline one; stop.early_stopping's min_delta counts) as `<storage>/<run>/best.pt`, never deleted, and log that model (not the last epoch's) "
        "as the run's MLflow model; model.pt stays the final one."
    )
    export: list[Literal["safetensors", "pretrained"]] = Field(
        default_factory=list, description="Also write the final model (and with keep_best the best epoch's) in "
        "formats loaded without this project, under `<storage>/<run>/export/<final|best>/` and as the MLflow run's "
        "artifacts `export/<final|best>/`: safetensors (`model.safetensors`; weights shared inside the model stay "
        "shared; needs the safetensors package), pretrained (the model's own save_pretrained into `pretrained/`: a "
        "Hugging Face model, which from_pretrained loads). Refused before the run when it cannot be done."
    )
    keep: int = Field(
        3, ge=1, description="Checkpoints kept per run, each `<storage>/<run.name or mlflow run id>/ckpt-<step>-<tag>.pt` with a `.json` "
        "sidecar (its length and sha256): after each save all but the newest `keep` (by step) are deleted. The "
        "extra copies model.pt and interrupted.pt are never deleted."
    )
