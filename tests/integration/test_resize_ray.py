"""Growing with the cluster on the shared local Ray head (4 logical CPUs): a run started with
fewer replicas than scaling.max_replicas sees the room, starts the new replica, and it joins at
an epoch boundary with the others' state; the learning rate ramps up by the linear rule, step
by step. (Losing a node and `lr_scaling: none`: tests/e2e/test_elastic_cluster_e2e.py, on a
cluster of its own; EASGD's alpha on a resize: tests/unit/test_ps_rules.py.)"""
from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.trainer import ElasticTrainer
from tests.conftest import StopAfter, assert_carried, job_config

pytestmark = pytest.mark.ray

LR = 0.05


def grow_run(tmp_path, mode, lr_scaling):
    """1 replica, room for a second on the head; ~1 s epochs (a new replica boots in ~4 s, more
    on a loaded host): the run ends 2 epochs after the grow's, or after 40 with none."""
    cfg = job_config(strategy={"mode": mode, "timeout_s": 30},
                     scaling={"replicas": 1, "max_replicas": 2, "cpus_per_replica": 0.5, "poll_s": 0.3,
                              "grow_after": 1, "lr_scaling": lr_scaling, "lr_warmup_steps": 10},
                     optimizer={"lr": LR}, stop={"epochs": 40}, data={"batch_size": 16},
                     faults={"slow_replicas": [{"rank": 0, "delay_s": 0.005}]},
                     tracking={"progress_interval_s": 0, "log_every_steps": 1},
                     checkpoint={"storage": str(tmp_path / "ck")})
    trainer = ElasticTrainer(cfg, show_progress=False)
    trainer.callbacks.append(StopAfter(trainer, "resize", 2))
    return trainer.fit(), trainer


@pytest.mark.parametrize("mode", ["allreduce", pytest.param("fsdp", marks=pytest.mark.full)])
def test_allreduce_grows_to_max_replicas_and_the_rate_follows_the_rule(ray_cluster, tmp_path, mode):
    """(fsdp too: the member's state joined by the driver, every replica re-sharding it over the
    new group, each then holding half of the state it held alone.)"""
    result, trainer = grow_run(tmp_path, mode, "linear")
    [grow] = [e for e in result.events if e["kind"] == "resize"]
    assert grow["direction"] == "grow" and grow["old_size"] == 1 and grow["new_size"] == 2, grow
    assert grow["ranks"] == [1] and grow["resize_s"] > 0 and grow["lr_rule"] == "linear"
    assert_carried(grow, "membership", "state", "regroup", "data", "lr")
    ends = [e for e in result.events if e["kind"] == "epoch_end"]
    assert ends[-1]["replicas"] == 2 and ends[0]["replicas"] == 1
    assert not [e for e in result.events if e["kind"] == "autoscaler_request"]  # the room was there: nothing asked
    # the rate the replicas stepped at (the lowest rank's progress rows), before and after the grow
    history = MlflowClient().get_metric_history(result.mlflow_run_id, "lr")
    at = grow["at_step"]
    before = {m.value for m in history if m.step <= at}
    after_warmup = {round(m.value, 9) for m in history if m.step > at + 10}
    assert before == {LR}
    assert grow["lr_target"] == pytest.approx(2 * LR) and grow["lr_warmup_steps"] == 10
    assert after_warmup == {round(2 * LR, 9)}  # the linear rule: twice the batch, twice the rate
    ramp = sorted((m.step, m.value) for m in history if at < m.step <= at + 10)  # the warmup, step by step
    assert len(ramp) == 10 and all(LR < v < 2 * LR for _, v in ramp[:-1])
    assert [v for _, v in ramp] == sorted(v for _, v in ramp)
    assert result.final.test_accuracy > 0.9
    if mode == "fsdp":
        held = [e["replica_state_mb"] for e in ends]
        assert held[-1] == pytest.approx(held[0] / 2, rel=0.02), held



@pytest.mark.full
def test_the_room_a_hung_replica_leaves_is_its_replacements_not_a_grows(ray_cluster, tmp_path):
    """A hung replica is taken out of the group at once (its process stopped); until the failure
    policy has replaced it, the run is one replica short with room on the cluster. A grow
    started in that window took the same rank, and the replacement made next was overwritten
    by the grow's replica and orphaned. Now no grow starts while failures wait: one replacement,
    no resize, the original rank set at the end."""
    from orchestrator.testing.chaos import Fault
    from tests.integration.test_recovery_ray import events, fit_with

    cfg = job_config(strategy={"mode": "allreduce", "timeout_s": 30},
                     scaling={"replicas": 2, "max_replicas": 2, "cpus_per_replica": 0.5, "poll_s": 0.1,
                              "grow_after": 1},
                     fault_tolerance={"hang_timeout_s": 10}, stop={"epochs": 3}, data={"batch_size": 8},
                     faults={"slow_replicas": [{"rank": 0, "delay_s": 0.005}]},
                     tracking={"progress_interval_s": 0, "log_every_steps": 1},
                     checkpoint={"storage": str(tmp_path / "ck")})
    result, inj, _, _ = fit_with(cfg, [Fault("hang_replica", 1, at_step=20)])
    assert [f["kind"] for f in inj.fired] == ["hang_replica"]
    assert [e["cause"] for e in events(result, "replica_failed")] == ["hung"]
    assert [e["ranks"] for e in events(result, "replica_replaced")] == [[1]]
    assert not events(result, "resize"), events(result, "resize")
