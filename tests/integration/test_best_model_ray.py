"""checkpoint.keep_best, stop.early_stopping and data.val_fraction on real Ray actors and a real
MLflow store: when later epochs are worse than an earlier one (the rate jumps x30 half-way), the
run stops early, judged on the validation split; best.pt holds the best epoch, and
`mlflow.pytorch.load_model` gives the model with the best validation metric, not the last
epoch's; the test split is evaluated once, on the final model; eval.every_steps evaluates
between epoch ends too, and a target reached there counts."""
from __future__ import annotations

import os

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

from orchestrator.trainer import ElasticTrainer
from tests.conftest import job_config

pytestmark = pytest.mark.ray
EVERY = 7  # eval.every_steps


def test_the_logged_model_is_the_best_epochs_and_the_run_stops_early(ray_cluster, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = job_config(data={"val_fraction": 0.2}, optimizer={"lr": 0.05, "schedule": {"name": "tests.factories:lr_spike"}},
                     stop={"epochs": 8, "early_stopping": {"patience": 2}, "at_target": False,
                           "target": {"metric": "val_accuracy", "goal": "max", "value": 0.0}},
                     eval={"every_steps": EVERY},
                     checkpoint={"storage": str(tmp_path / "ck"), "keep_best": True},
                     tracking={"tracking_uri": uri}, run={"name": "best"})
    trainer = ElasticTrainer(cfg, show_progress=False)
    result = trainer.fit()
    client = MlflowClient(uri)
    epochs = [e for e in result.events if e["kind"] == "epoch_end"]
    history = [e["val_accuracy"] for e in epochs]
    assert all("val_accuracy" in e and "test_accuracy" not in e for e in epochs)  # judged on validation only
    # eval.every_steps: evaluations between epoch ends, at multiples of EVERY, in MLflow at their steps
    evals = [e for e in result.events if e["kind"] == "evaluation"]
    assert [e["step"] for e in evals] == list(range(EVERY, EVERY * len(evals) + 1, EVERY)) and len(evals) > len(epochs)
    logged = {m.step: m.value for m in client.get_metric_history(result.mlflow_run_id, "val_accuracy")}
    assert all(logged[e["step"]] == pytest.approx(e["val_accuracy"]) for e in evals)
    [reached] = [e for e in result.events if e["kind"] == "target_reached"]  # the first evaluation counts
    assert reached["step"] == EVERY and reached["epoch"] == 1
    [tested] = [e for e in result.events if e["kind"] == "test_evaluated"]  # the test split: once, at the end
    assert tested["epoch"] == len(epochs) and result.final["test_accuracy"] == pytest.approx(tested["test_accuracy"], abs=1e-6)
    assert result.final["val_accuracy"] == pytest.approx(history[-1])
    best_epoch = max(range(len(history)), key=lambda i: history[i]) + 1
    assert best_epoch < len(history), history  # the scenario: a later epoch is worse than the best
    assert result.stop_reason.startswith("early stopping"), result.stop_reason
    assert len(history) == best_epoch + 2 < 8  # patience 2 after the best
    [best] = [e for e in result.events if e["kind"] == "best_checkpoint" and e["epoch"] == best_epoch]
    assert best["value"] == pytest.approx(history[best_epoch - 1])
    [logged] = [e for e in result.events if e["kind"] == "model_logged"]
    assert logged["model"] == f"best (epoch {best_epoch})"
    assert os.path.exists(tmp_path / "ck" / "best" / "best.pt")

    mlflow.set_tracking_uri(uri)  # where the run is; unset after
    try:
        model = mlflow.pytorch.load_model(f"runs:/{result.mlflow_run_id}/model", dst_path=str(tmp_path / "dl"))
    finally:
        mlflow.set_tracking_uri(None)
    data = trainer.controller.dataset
    rows = len(data.val) + len(data.train)  # the validation split: a fifth of the train rows, apart from the rest
    assert len(data.val) == round(0.2 * rows) and not set(data.val.ids) & set(data.train.ids)

    def accuracy(net, split):
        with torch.no_grad():
            return float((net(torch.as_tensor(split.x)).argmax(1) == torch.as_tensor(split.y)).float().mean())

    assert accuracy(model, data.val) == pytest.approx(history[best_epoch - 1], abs=1e-6)
    from orchestrator.persistence.checkpoint import load_checkpoint

    best_state = load_checkpoint(str(tmp_path / "ck" / "best" / "best.pt"))["model"]
    final_state = load_checkpoint(str(tmp_path / "ck" / "best" / "model.pt"))["model"]
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], best_state[k]) for k in best_state)
    assert not all(torch.equal(final_state[k], best_state[k]) for k in best_state)  # not the last epoch's
    model.load_state_dict(final_state)  # the test figure is the final model's
    assert accuracy(model, data.test) == pytest.approx(result.final["test_accuracy"], abs=1e-6)
