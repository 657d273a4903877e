"""Pauses inside an epoch on real Ray actors and shards: a replica SIGKILLed while the others pause
for a checkpoint (it is given up: the gate opens, the replicas that paused go on), another while
they pause for a switch (the switch goes on after the repair, the paused replicas with it); each
dead replica is replaced, and every epoch still trains each row exactly once."""
from __future__ import annotations

import pytest

from orchestrator.testing.chaos import Fault, FaultInjector
from orchestrator.trainer import ElasticTrainer
from tests.conftest import job_config
from tests.integration.test_recovery_ray import events

pytestmark = pytest.mark.ray


@pytest.mark.full  # ~30 s
def test_a_replica_killed_while_the_others_pause_for_a_checkpoint_is_replaced_and_no_row_is_lost(ray_cluster, tmp_path):
    # replica 0 is slow, so when the pause is asked it is still part way through a partition
    # (~1 s each): the kill lands before every replica has paused
    cfg = job_config(strategy={"mode": "downpour"}, scaling={"replicas": 2, "cpus_per_replica": 0.5},
                     stop={"epochs": 2}, data={"batch_size": 8, "partitions": 8},
                     tracking={"progress_interval_s": 0, "log_every_steps": 1},
                     checkpoint={"storage": str(tmp_path / "ck"), "every_steps": 12},
                     faults={"slow_replicas": {0: 0.05}})
    trainer = ElasticTrainer(cfg, show_progress=False)
    trainer._trace_ids = True  # every row the replicas train on, by epoch and rank
    with FaultInjector(lambda: trainer.controller, [Fault("kill_replica", 0, during="checkpoint")]) as inj:
        result = trainer.fit()
    [fired] = inj.fired
    assert fired.get("during") == "checkpoint", fired
    given_up = [e for e in events(result, "checkpoint_failed") if "failed while the replicas paused" in e["reason"]]
    assert given_up and events(result, "replica_replaced"), [e["kind"] for e in result.events]
    assert result.epochs == 2 and [e for e in events(result, "checkpoint") if e.get("in_epoch")]  # later ones taken
    assert_every_row_once(trainer, 2)


@pytest.mark.full  # ~25 s
def test_a_replica_killed_once_another_paused_for_a_switch_is_replaced_and_the_switch_goes_on(ray_cluster, tmp_path):
    # Downpour -> asynchronous EASGD inside epoch 1; replica 0 is slow, so it is still part way
    # through a partition when another has paused: the kill lands then. The replicas that paused
    # stay paused through the repair and go on after the switch (forgotten before: their last
    # partitions were "never served")
    cfg = job_config(strategy={"phases": [{"mode": "downpour", "until": {"steps": 10}},
                                          {"mode": "easgd", "variant": "async", "tau": 4}]},
                     scaling={"replicas": 3, "cpus_per_replica": 0.5}, stop={"epochs": 2},
                     data={"batch_size": 8, "partitions": 12}, tracking={"progress_interval_s": 0, "log_every_steps": 1},
                     faults={"slow_replicas": {0: 0.05}})
    trainer = ElasticTrainer(cfg, show_progress=False)
    trainer._trace_ids = True
    with FaultInjector(lambda: trainer.controller, [Fault("kill_replica", 0, during="switch_pause")]) as inj:
        result = trainer.fit()
    [fired] = inj.fired
    assert fired.get("during") == "switch_pause", fired
    assert events(result, "replica_replaced") and [e["mid_epoch"] for e in events(result, "mode_switch")] == [True]
    assert result.epochs == 2
    assert_every_row_once(trainer, 2)


def assert_every_row_once(trainer, epochs: int) -> None:
    ids = sorted(int(i) for i in trainer._dataset.train.ids)
    assert len(trainer.controller.consumed) == epochs
    for epoch, consumed in enumerate(trainer.controller.consumed, 1):
        seen = sorted(i for steps in consumed.values() for step in steps for i in step)
        assert seen == ids, f"epoch {epoch}: {len(seen)} rows for {len(ids)}, {len(seen) - len(set(seen))} twice"
