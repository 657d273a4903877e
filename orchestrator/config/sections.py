"""The config sections of what is trained, on what, and how it is kept: model, data, task,
optimizer, stop rules, tracking, the run's name and checkpoints (orchestrator/config/job.py puts
them together)."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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
        "path or any pyarrow filesystem URI (file://, s3://, gs://, hdfs://). A builtin comes decoded and split: "
        "with one, label_column, feature_columns, decode, feature_shape, id_column, test_source and test_fraction "
        "are refused (they apply to files and in-memory data).",
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
