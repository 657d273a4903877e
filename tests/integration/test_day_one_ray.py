"""The day-one options end to end, on real Ray actors and a real MLflow store, in one short run:
a callback that asks for a checkpoint after epoch 1 (taken inside epoch 2) and stops the run
after epoch 2; the watched metric (stop.watch) choosing the best checkpoint; decay groups by
parameter name (optimizer.no_decay) in the replicas' optimizer; TensorBoard scalars beside
MLflow (tracking.tensorboard)."""
from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from orchestrator import Action, ElasticTrainer
from tests.conftest import job_config
from tests.unit.test_tensorboard import read_scalars

pytestmark = pytest.mark.ray


class Steer:
    def __init__(self):
        self.seen: list[str] = []

    def on_event(self, event):
        self.seen.append(event["kind"])
        if event["kind"] == "epoch_end":
            return Action.CHECKPOINT if event["epoch"] == 1 else Action.STOP
        return None


def test_a_callback_steers_the_run_the_watched_metric_picks_the_best_and_tensorboard_mirrors_mlflow(
        ray_cluster, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = job_config(optimizer={"name": "adamw", "lr": 0.01, "weight_decay": 0.5, "no_decay": ["bias"]},
                     data={"partitions": 16},  # partition boundaries to pause at, inside an epoch of ~1 s
                     stop={"epochs": 6, "watch": {"metric": "train_loss"}},
                     checkpoint={"storage": str(tmp_path / "ck"), "keep_best": True, "every_epochs": 0},
                     tracking={"tracking_uri": uri, "tensorboard": str(tmp_path / "tb"), "log_every_steps": 1,
                               "progress_interval_s": 0})  # the driver hears each step: the asked pause comes in time
    steer = Steer()
    trainer = ElasticTrainer(cfg, show_progress=False, callbacks=[steer])
    result = trainer.fit()
    assert result.epochs == 2 and result.stop_reason == "callback: Steer after epoch_end asked to stop"
    [inside] = [e for e in result.events if e["kind"] == "checkpoint" and e.get("in_epoch")]
    assert inside["in_epoch"]["epoch"] == 2 and inside["in_epoch"]["for"] == "callback Steer after epoch_end"
    best = [e for e in result.events if e["kind"] == "best_checkpoint"]
    assert best and all(e["metric"] == "train_loss" for e in best)

    from orchestrator.persistence.checkpoint import load_checkpoint

    state = load_checkpoint(str(tmp_path / "ck" / result.mlflow_run_id / "model.pt"))
    groups = state["optimizer"]["param_groups"]  # the replicas' optimizer: the biases apart, without decay
    assert [(g["weight_decay"], len(g["params"])) for g in groups] == [(0.5, 2), (0.0, 2)]

    client = MlflowClient(uri)
    scalars = read_scalars(str(tmp_path / "tb" / result.mlflow_run_id))
    for name in ("train_loss", "test_accuracy", "lr"):
        logged = [(m.step, m.value) for m in client.get_metric_history(result.mlflow_run_id, name)]
        assert [s for s, _ in scalars[name]] == [s for s, _ in logged], name
        assert [v for _, v in scalars[name]] == pytest.approx([v for _, v in logged], rel=1e-6), name
