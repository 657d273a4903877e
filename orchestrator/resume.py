"""`python -m orchestrator resume RUN`: find a run's newest good checkpoint and go on from it.

RUN is the run's checkpoint directory (`<checkpoint.storage>/<mlflow run id>`, a local path or
any pyarrow filesystem URI) or its MLflow run id (its `checkpoint.storage` param says where the
checkpoints are). The checkpoint holds the job's config, the MLflow run id, the model, the
optimizer state, the step, and the run's position (totals, the switch policy's place, the
phases so far, the training clock): the run goes on at the epoch after the checkpoint's, in the
same MLflow run (metrics continue at the right step). A truncated or corrupt checkpoint is
skipped for the one before it (the `resumed` event and the CLI say which).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from orchestrator.checkpoint import CheckpointStore
from orchestrator.errors import ConfigError


def find_checkpoint(run: str, tracking_uri: Optional[str] = None) -> tuple[str, dict[str, Any], list]:
    """(path, state, skipped) of RUN's newest good checkpoint; ConfigError naming what is
    missing otherwise."""
    if "://" in run or os.path.isdir(run):
        directory = run.rstrip("/")
    else:
        directory = _directory_of_run_id(run, tracking_uri)
    storage, _, run_name = directory.rpartition("/")
    if not run_name:
        raise ConfigError(f"resume: {run} is not a run's checkpoint directory")
    store = CheckpointStore(storage or "/", run_name, keep=1_000_000)
    found = store.latest_good()
    if found is None:
        why = "; ".join(f"{name}: {reason}" for name, reason in store.skipped) or "none written"
        raise ConfigError(f"resume: no usable checkpoint in {directory} ({why})")
    path, state = found
    if "run" not in state or "config" not in state:
        raise ConfigError(f"resume: {path} holds no run position (written by a version that could not resume)")
    return path, state, list(store.skipped)


def _directory_of_run_id(run_id: str, tracking_uri: Optional[str]) -> str:
    from mlflow.tracking import MlflowClient

    try:
        params = MlflowClient(tracking_uri).get_run(run_id).data.params
    except Exception as exc:
        raise ConfigError(f"resume: {run_id} is neither a checkpoint directory nor an MLflow run id the tracking "
                          f"store knows ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    storage = params.get("checkpoint.storage")
    if not storage:
        raise ConfigError(f"resume: MLflow run {run_id} has no checkpoint.storage param")
    if "://" not in storage:
        storage = os.path.abspath(storage)
    return f"{storage.rstrip('/')}/{run_id}"
