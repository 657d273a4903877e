"""The trained model as an MLflow model (a real sqlite store, no Ray): `runs:/<id>/model` loads
and predicts like the model that was logged, registered when asked; the caller's own fluent
run, experiment and tracking URI are left as they were; a store that fails loses nothing else."""
from __future__ import annotations

import os
import time

import mlflow
import mlflow.pytorch
import numpy as np
import torch
from mlflow.tracking import MlflowClient

from orchestrator.persistence.final_model import input_example, trained_model
from orchestrator.reporting.tracking import Tracker
from tests.conftest import job_config


def test_the_logged_model_loads_predicts_and_registers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    caller_uri = f"sqlite:///{tmp_path}/caller.db"  # the process default: not the run's store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", caller_uri)
    uri = f"sqlite:///{tmp_path}/runs.db"
    cfg = job_config(tracking={"register_as": "tiny"})
    from orchestrator.data.loading import load_dataset

    dataset = load_dataset(cfg.data)
    state = {k: v + 0.01 for k, v in _fresh(cfg).state_dict().items()}  # not the factory's initial values
    model = trained_model(cfg, state)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items()) and not model.training
    with mlflow.start_run(experiment_id=mlflow.create_experiment("caller")) as caller_run:
        tracker = Tracker(uri, "model-logging", None)
        t = time.perf_counter()
        assert tracker.log_model(model, input_example(dataset), register_as="tiny")
        seconds = time.perf_counter() - t
        assert mlflow.active_run().info.run_id == caller_run.info.run_id  # the caller's run is still its own
        assert mlflow.get_tracking_uri() == caller_uri and os.environ["MLFLOW_TRACKING_URI"] == caller_uri
    assert seconds < 60, seconds
    print(f"log_model took {seconds:.2f}s")
    assert tracker.finish("FINISHED", timeout_s=10)
    assert not [m for m in MlflowClient(caller_uri).search_logged_models([caller_run.info.experiment_id])]

    mlflow.set_tracking_uri(uri)  # where the run is (load_model reads it); unset after, the variable comes back
    try:
        loaded = mlflow.pytorch.load_model(f"runs:/{tracker.run_id}/model", dst_path=str(tmp_path / "dl"))
        x = torch.from_numpy(dataset.test.x)
        with torch.no_grad():
            assert torch.equal(loaded(x).argmax(1), model(x).argmax(1))
        client = MlflowClient(uri)
        [logged] = client.search_logged_models([tracker.experiment_id])
        assert logged.name == "model" and logged.source_run_id == tracker.run_id and str(logged.status).endswith("READY")
        info = mlflow.models.get_model_info(f"runs:/{tracker.run_id}/model")
        assert info.signature.inputs.to_dict()[0]["tensor-spec"]["shape"] == (-1, dataset.test.x.shape[1])
        local = mlflow.artifacts.download_artifacts(f"runs:/{tracker.run_id}/model", dst_path=str(tmp_path / "dl2"))
        example = mlflow.models.Model.load(local).load_input_example(local)
        assert np.array_equal(example, dataset.test.x[:5])
        [version] = client.search_model_versions("name = 'tiny'")
        assert version.run_id == tracker.run_id
    finally:
        mlflow.set_tracking_uri(None)


def _fresh(cfg):
    from orchestrator.models import build_model

    return build_model(cfg.model.factory, cfg.model.kwargs, cfg.data.seed)


class FailingClient:
    def __init__(self, client):
        self._client = client

    def __getattr__(self, name):
        return getattr(self._client, name)

    def create_logged_model(self, *a, **k):
        raise ConnectionError("store went away")


def test_a_store_that_fails_the_model_is_reported_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    warnings = []
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "failing", None, warn=warnings.append)
    tracker.client = FailingClient(tracker.client)
    cfg = job_config()
    from orchestrator.data.loading import load_dataset

    dataset = load_dataset(cfg.data)
    assert tracker.log_model(_fresh(cfg), input_example(dataset)) is False  # not logged; does not raise
    tracker.log_text("{}", "result.json")
    assert tracker.finish("FINISHED", timeout_s=10)
    assert [w for w in warnings if w.startswith("tracking: model: ") and "store went away" in w], warnings
    assert MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(tracker.run_id).info.status == "FINISHED"
