"""The modern recipe (AdamW with betas and decoupled weight decay, warm-up then cosine decay,
clipping, accumulation, bf16 autocast), said only in config, on real Ray actors in every mode:
it learns, the rate of every step follows the schedule in MLflow (through a replica SIGKILL and
its replacement in allreduce), and the gradient norm is logged."""
from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.chaos import Fault
from policies.recipe import Schedule, planned_steps
from tests.conftest import job_config
from tests.integration.test_recovery_ray import events, fit_with

pytestmark = pytest.mark.ray

LR = 0.01
RECIPE = {"name": "adamw", "lr": LR, "weight_decay": 0.1, "kwargs": {"betas": [0.9, 0.95], "eps": 1e-8},
          "schedule": {"name": "cosine", "warmup": 0.1, "min_factor": 0.1}, "clip_grad_norm": 1.0}
MODES = {"allreduce": {"mode": "allreduce"}, "downpour": {"mode": "downpour"},
         "easgd": {"mode": "easgd", "momentum": 0.0, "tau": 2}, "local_sgd": {"mode": "local_sgd", "period": 4}}


@pytest.mark.parametrize("mode", ["allreduce", pytest.param("downpour", marks=pytest.mark.full), "easgd",
                                  pytest.param("local_sgd", marks=pytest.mark.full)])
def test_the_modern_recipe_in_config_learns_in_every_mode_on_the_schedule(ray_cluster, tmp_path, mode):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    epochs = 3
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
