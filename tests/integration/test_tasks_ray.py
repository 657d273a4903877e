"""A task of the user's own on real Ray actors: it trains, switches mode mid-run, survives a
replica SIGKILL, and its own metric drives the target, the phase records, the switch event, the
result and MLflow."""
from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.testing.chaos import Fault
from tests.conftest import job_config
from tests.integration.test_recovery_ray import events, fit_with

pytestmark = pytest.mark.ray


def test_custom_task_switches_survives_a_kill_and_reaches_its_own_target(ray_cluster, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = job_config(task={"name": "examples.tasks:margin_task", "kwargs": {"margin": 1.0}},
                     data={"source": "builtin:synthetic", "batch_size": 16, "partitions": 16},
                     strategy={"phases": [{"mode": "allreduce", "until": {"steps": 30}}, {"mode": "easgd", "tau": 2}]},
                     stop={"epochs": 4, "target": {"metric": "test_top2_accuracy", "goal": "max", "value": 0.9},
                           "at_target": False},
                     tracking={"tracking_uri": uri, "progress_interval_s": 0, "log_every_steps": 5},
                     checkpoint={"storage": str(tmp_path / "ck")})
    result, inj, _, _ = fit_with(cfg, [Fault("kill_replica", 1, at_step=80)])
    assert inj.fired and result.epochs == 4
    assert set(result.final) == {"test_loss", "test_top2_accuracy", "test_accuracy", "train_loss"}
    assert result.final.test_top2_accuracy >= 0.9 and result.time_to_target_s is not None
    [reached] = events(result, "target_reached")
    assert reached["metric"] == "test_top2_accuracy" and reached["value"] >= 0.9
    [switch] = events(result, "mode_switch")
    assert switch["metric"] == "test_top2_accuracy" and "test_top2_accuracy_before" in switch
    assert [p["mode"] for p in result.phases] == ["allreduce", "easgd"]
    assert "test_top2_accuracy_at_end" in result.phases[0] and "test_top2_accuracy_at_start" in result.phases[1]
    [replaced] = events(result, "replica_replaced")
    assert replaced["ranks"] == [1]
    client = MlflowClient(uri)
    history = client.get_metric_history(result.mlflow_run_id, "test_top2_accuracy")
    assert len(history) == 4 and history[-1].value == result.final.test_top2_accuracy


@pytest.mark.full  # make test trains a language model end to end in tests/integration/test_huggingface_ray.py
def test_language_model_from_byte_rows_streams_decodes_and_learns(ray_cluster, tmp_path):
    """examples/tiny_lm.yaml in short: byte rows in Parquet, decoded on the replicas' nodes by
    data.decode into token ids and next-token targets, a small causal transformer, easgd."""
    import math

    from examples.datasets import write_text

    source = write_text(str(tmp_path / "text"))
    cfg = job_config(model={"factory": "examples.models:tiny_lm", "kwargs": {"dim": 48, "layers": 1}},
                     task={"name": "language_model"},
                     data={"source": source, "decode": "examples.text:decode", "batch_size": 32},
                     optimizer={"name": "adam", "lr": 0.003},
                     strategy={"mode": "easgd", "momentum": 0, "tau": 4}, stop={"epochs": 2},
                     checkpoint={"storage": str(tmp_path / "ck")})
    from orchestrator.trainer import ElasticTrainer

    result = ElasticTrainer(cfg, show_progress=False).fit()
    assert set(result.final) == {"test_loss", "test_perplexity", "train_loss"}
    assert result.final.test_perplexity == pytest.approx(math.exp(result.final.test_loss))
    assert result.final.test_perplexity < 12  # a uniform guess over the 128 byte values scores 128
