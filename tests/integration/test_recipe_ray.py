"""The modern recipe (AdamW with betas and decoupled weight decay, warm-up then cosine decay,
clipping, accumulation, bf16 autocast), said only in config, on real Ray actors in every mode:
it learns, the rate of every step follows the schedule in MLflow (through a replica SIGKILL and
its replacement in allreduce), and the gradient norm is logged."""
from __future__ import annotations

import time

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.testing.chaos import Fault
from policies.rules.recipe import Schedule, planned_steps
from tests.conftest import job_config
from tests.integration.test_recovery_ray import events, fit_with

pytestmark = pytest.mark.ray

LR = 0.01
RECIPE = {"name": "adamw", "lr": LR, "weight_decay": 0.1, "kwargs": {"betas": [0.9, 0.95], "eps": 1e-8},
          "schedule": {"name": "cosine", "warmup": 0.1, "min_factor": 0.1}, "clip_grad_norm": 1.0}
MODES = {"allreduce": {"mode": "allreduce"}, "downpour": {"mode": "downpour"},
         "easgd": {"mode": "easgd", "momentum": 0.0, "tau": 2}, "local_sgd": {"mode": "local_sgd", "period": 4}}


@pytest.mark.parametrize("mode", ["allreduce"] + [pytest.param(m, marks=pytest.mark.full)
                                                  for m in ("downpour", "easgd", "local_sgd")])
def test_the_modern_recipe_in_config_learns_in_every_mode_on_the_schedule(ray_cluster, tmp_path, mode):
    """allreduce (make test): also a replica SIGKILLed and replaced, and the run resumed from its
    epoch-1 checkpoint going on with the schedule where it was, on the same clock."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    epochs = 2  # the kill at step 30 of ~51 an epoch; the schedule spans both
    cfg = job_config(optimizer=RECIPE, data={"batch_size": 16, "accumulate": 2, "partitions": 8},
                     model={"factory": "examples.models:tiny_mlp", "precision": "bf16"},
                     strategy=MODES[mode], stop={"epochs": epochs},
                     scaling={"replicas": 2, "cpus_per_replica": 0.5, "shards": 2},
                     tracking={"tracking_uri": uri, "progress_interval_s": 0, "log_every_steps": 1},
                     checkpoint={"storage": str(tmp_path / "ck")})
    faults = [Fault("kill_replica", 1, at_step=30)] if mode == "allreduce" else []
    result, inj, _, trainer = fit_with(cfg, faults)
    assert result.epochs == epochs
    assert result.final.test_accuracy >= 0.8, result.final  # synthetic blobs: ~0.95+ with this recipe
    if faults:
        assert inj.fired
        [replaced] = events(result, "replica_replaced")
        assert replaced["ranks"] == [1]
    client = MlflowClient(uri)
    lrs = {m.step: m.value for m in client.get_metric_history(result.mlflow_run_id, "lr")}
    total = planned_steps(trainer.controller.dataset.train_rows, 16, 2, 2, epochs)
    schedule = Schedule(RECIPE["schedule"], total)
    assert lrs, "no lr logged"
    for step, lr in lrs.items():  # the rate the next step takes, at each logged step: the schedule's
        assert lr == pytest.approx(LR * schedule.factor(step), rel=1e-5), (step, lr)
    steps = sorted(lrs)
    assert lrs[steps[0]] < LR * 0.5 and max(lrs.values()) == pytest.approx(LR, rel=0.05)
    assert lrs[steps[-1]] < LR * 0.3  # decayed to near the floor by the end
    norms = client.get_metric_history(result.mlflow_run_id, "grad_norm")
    assert norms and all(n.value > 0 for n in norms)
    if mode != "allreduce":
        return
    from orchestrator.persistence.checkpoint import CheckpointStore
    from orchestrator.trainer import ElasticTrainer

    store = CheckpointStore(str(tmp_path / "ck"), result.mlflow_run_id, keep=10)
    [entry] = [e for e in store.list() if e.tag == "epoch_0001"]
    state, _ = store.verify(entry)
    started_ms = time.time() * 1000
    resumed = ElasticTrainer(cfg, show_progress=False, resume=state).fit()
    assert resumed.mlflow_run_id == result.mlflow_run_id and resumed.epochs == epochs
    again = [m for m in client.get_metric_history(resumed.mlflow_run_id, "lr") if m.timestamp >= started_ms]
    assert again and all(m.step > state["step"] for m in again)  # the resumed run's rates: at its steps, same clock
    assert all(m.value == pytest.approx(LR * schedule.factor(m.step), rel=1e-5) for m in again)


@pytest.mark.full  # ~50 s; make test runs the recipe, a kill and a resume on the schedule in allreduce above
def test_a_transformer_with_the_recipe_switches_survives_a_kill_and_logs_its_best(ray_cluster, tmp_path):
    """A user's causal transformer (examples.models:tiny_lm) with the whole recipe in config:
    easgd's local AdamW moments carried into allreduce and averaged at the switch (replicas then
    step alike), a replica SIGKILLed in allreduce and replaced, and the logged MLflow model the
    best epoch's."""
    from examples.datasets import write_text

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    source = write_text(str(tmp_path / "text"))
    sections = dict(model={"factory": "examples.models:tiny_lm", "kwargs": {"dim": 48, "layers": 1},
                           "precision": "bf16"},
                    task={"name": "language_model"},
                    data={"source": source, "decode": "examples.text:decode", "batch_size": 16, "accumulate": 2},
                    optimizer={**RECIPE, "lr": 0.003},
                    strategy={"phases": [{"mode": "easgd", "momentum": 0.0, "tau": 2, "until": {"steps": 40}},
                                         {"mode": "allreduce"}]},
                    scaling={"replicas": 2, "cpus_per_replica": 0.5, "shards": 2},
                    stop={"epochs": 3, "target": {"metric": "test_perplexity", "goal": "min", "value": 12.0},
                          "at_target": False},
                    tracking={"tracking_uri": uri, "progress_interval_s": 0, "log_every_steps": 1},
                    checkpoint={"storage": str(tmp_path / "ck"), "keep_best": True, "keep": 5}, run={"name": "lm"})
    result, inj, _, _ = fit_with(job_config(**sections), [Fault("kill_replica", 1, at_step=120)])
    assert result.epochs == 3 and inj.fired
    assert result.final.test_perplexity <= 12.0, result.final  # the bytes' unigram perplexity is ~30
    [switch] = events(result, "mode_switch")
    assert switch["local_optimizer"] == ["carried, averaged"]  # AdamW's exp_avg, exp_avg_sq into allreduce
    [replaced] = events(result, "replica_replaced")
    assert replaced["ranks"] == [1]
    [logged] = events(result, "model_logged")
    best = max((e for e in events(result, "epoch_end")), key=lambda e: -e["test_perplexity"])
    assert logged["model"] == f"best (epoch {best['epoch']})"
