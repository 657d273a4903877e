"""Local SGD and gossip on real Ray actors and gloo groups: a SIGKILLed replica replaced with the
replicas identical at the epoch's end; gossip trains the main example to its target through a
kill. (Both switched into and out of mid-epoch: tests/integration/test_switching_ray.py.)"""
from __future__ import annotations

import numpy as np
import pytest
import ray

from orchestrator.testing.chaos import Fault, FaultInjector
from tests.integration.test_recovery_ray import actor_ids
from tests.integration.test_switching_ray import controller, replica_flats

pytestmark = pytest.mark.ray


def test_balanced_a_slow_replica_takes_fewer_steps_and_a_killed_one_is_replaced(ray_cluster):
    """Balanced periods (replica 2 at 3x), replica 1 SIGKILLed mid-epoch: replaced, the
    survivors keep their own steps (their step counts differ by design), every replica ends the
    epoch at the global model, and the next epoch trains every row once."""
    ctl = controller([{"mode": "local_sgd", "period": 4, "balance": True}], trace_ids=True,
                     scaling={"replicas": 3, "cpus_per_replica": 0.5},
                     faults={"slow_replicas": [{"rank": 2, "factor": 3}]})
    try:
        ctl.step()
        before = actor_ids(ctl)
        with FaultInjector(ctl, [Fault("kill_replica", 1, at_step=22)]) as inj:
            ctl.run_epoch()
        after = actor_ids(ctl)
        flats = replica_flats(ctl)
        status = ray.get(ctl.server.handle.status.remote(), timeout=30)
        ctl.run_epoch()  # and the next epoch runs in the new group
        again = replica_flats(ctl)
    finally:
        ctl.shutdown()
    assert inj.fired
    assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]
    for f in flats[1:]:
        np.testing.assert_array_equal(f, flats[0])  # the epoch ended at a round: every replica at the global model
    for f in again[1:]:
        np.testing.assert_array_equal(f, again[0])
    assert not np.array_equal(again[0], flats[0])
    assert status.complete  # every partition served in the epoch of the kill
    [replaced] = [e for e in ctl.tracker.events if e["kind"] == "replica_replaced"]
    assert replaced["ranks"] == [1] and replaced["survivors_kept"] == [0, 2]
    last = [e for e in ctl.tracker.events if e["kind"] == "epoch_end"][-1]
    assert last["local_drift"] > 0 and last["rounds_per_s"] > 0  # the mode's own figures
    # the balancer gave the slow replica the shorter period: fewer steps a round by the split it
    # decided, not by how many steps the host's timing let each take over the epoch
    rebalanced = [e for e in ctl.tracker.events if e["kind"] == "batch_rebalanced"]
    history = [(e["epoch"], e["step"], e["unit"], e["shares"]) for e in rebalanced]
    assert any(e["unit"] == "steps" and e["shares"].get("2", 4) < e["shares"].get("0", 4) for e in rebalanced), history
    assert sum(last[f"replica{r}/period"] for r in range(3)) == 12
    rows = [i for steps in ctl.consumed[-1].values() for batch in steps for i in batch]
    assert sorted(rows) == sorted(set(rows)) and len(rows) == len(ctl.dataset.train)


def test_gossip_trains_the_main_example_to_its_target_through_a_kill(ray_cluster, tmp_path):
    """examples/mnist_allreduce.yaml with strategy.mode=gossip on 3 replicas (a ring: two
    neighbours each), every step a gossip round; replica 1 SIGKILLed in the second epoch: it is
    replaced (the survivors keep their actors), the ring closes over the new group, and the run
    reaches the example's target with the mode's own figures in every epoch."""
    from orchestrator.config import JobConfig
    from orchestrator.trainer import ElasticTrainer
    from tests.conftest import REPO

    cfg = JobConfig.from_yaml(f"{REPO}/examples/mnist_allreduce.yaml", [
        "strategy.mode=gossip", "strategy.period=1", "scaling.replicas=3", "scaling.cpus_per_replica=0.5",
        "stop.epochs=12", f"checkpoint.storage={tmp_path}/ck", "tracking.progress_interval_s=0",
        f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db"])
    trainer = ElasticTrainer(cfg, show_progress=False)
    with FaultInjector(lambda: trainer.controller, [Fault("kill_replica", 1, at_step=30)]) as inj:
        result = trainer.fit()
    assert [f["kind"] for f in inj.fired] == ["kill_replica"] and "error" not in inj.fired[0]
    assert result.mode == "gossip" and result.time_to_target_s is not None, result.final
    [replaced] = [e for e in result.events if e["kind"] == "replica_replaced"]
    assert replaced["ranks"] == [1] and replaced["survivors_kept"] == [0, 2]
    ends = [e for e in result.events if e["kind"] == "epoch_end"]
    assert all(e["consensus_distance"] > 0 and e["rounds_per_s"] > 0 for e in ends), ends
