"""A trained model logged into a run as an MLflow model (mlflow.pytorch), from the tracker's
writer thread (orchestrator/reporting/tracking.py: Tracker.log_model)."""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Optional

import mlflow


def log_pytorch_model(tracker: Any, model: Any, input_example: Any, register_as: Optional[str]) -> None:
    """mlflow.pytorch.log_model into the tracker's run (in the writer thread). MLflow 3 records
    a model as a LoggedModel of the run's experiment: it is created here with the tracker's own
    client, so neither the caller's active fluent run nor its experiment is used or changed;
    MLflow's model logging reads the process-wide tracking URI, so that points at the
    tracker's store for the call and is put back after it. The pip requirements are given
    (torch's version), not inferred: inference loads the model in a subprocess (seconds).
    Pickled, not torch.export'ed (MLflow's default): load_model gives back the factory's own
    module, which takes any batch size."""
    import mlflow.pytorch
    import torch
    from mlflow.models import infer_signature

    from policies.rules.batches import as_tensors, forward
    from policies.rules.outputs import predictions

    with torch.no_grad():  # the signature's output: the predictions (a ModelOutput's logits, a tuple's first)
        output = predictions(forward(model, as_tensors(input_example))).detach().cpu().numpy()
    signature = infer_signature(input_example, output)
    logged = tracker.client.create_logged_model(tracker.experiment_id, name="model", source_run_id=tracker.run_id)
    with _process_tracking_uri(tracker.tracking_uri), _without_pickle_warning():
        mlflow.pytorch.log_model(model, name="model", model_id=logged.model_id, run_id=tracker.run_id,
                                 serialization_format="pickle",
                                 # a dict of inputs is kept in the signature only: the flavor's predict
                                 # takes one array, so MLflow could not validate it as an example
                                 input_example=None if isinstance(input_example, dict) else input_example,
                                 signature=signature,
                                 pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
                                 registered_model_name=register_as)


class _PickleWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "by Pickle or CloudPickle" not in record.getMessage()


@contextlib.contextmanager
def _without_pickle_warning():
    """MLflow warns on every pickled model that unpickling runs code; the format is chosen on
    purpose here (the README says so), so the warning would only be noise in every job's log."""
    logger, quiet = logging.getLogger("mlflow.pytorch"), _PickleWarning()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


@contextlib.contextmanager
def _process_tracking_uri(uri: str):
    """MLflow's process-wide tracking URI set to `uri` inside the block, then put back as it
    was (the setting and the MLFLOW_TRACKING_URI variable, which set_tracking_uri also writes)."""
    from mlflow.tracking._tracking_service import utils

    if mlflow.get_tracking_uri() == uri:
        yield
        return
    before, env_before = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)
        if env_before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = env_before
