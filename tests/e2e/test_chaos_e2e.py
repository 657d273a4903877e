"""Chaos through the public API on mnist5k, one run in allreduce and one in downpour (easgd's shard
rebuild: tests/integration/test_shard_recovery_ray.py; its chaos soak: tests/chaos): a replica's process SIGKILLed
twice mid-epoch and another's during the first repair, the partition server's process SIGKILLed
(allreduce: SIGSTOPped) once (and, in the sharded modes, a parameter shard's SIGKILLed); the run trains on, the survivors keep their
actors, and the events time each recovery.

Each run trains a fixed number of epochs and must end well past LEARNED, a level far below every
mode's plateau (downpour's test accuracy wanders at 0.96-0.975 on this 1,000-row test split once
it gets there): whether a run first crosses 97% in its 5th or its 7th epoch is not what these
tests are about."""
from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.control.decide import read_jsonl, replay
from orchestrator.testing.chaos import Fault, FaultInjector
from orchestrator.config import JobConfig
from orchestrator.trainer import ElasticTrainer

pytestmark = pytest.mark.ray
LEARNED = 0.93


@pytest.mark.parametrize("mode", [pytest.param("allreduce", marks=pytest.mark.full), "downpour"])
def test_replica_shard_and_server_kills_and_a_kill_during_a_repair_do_not_stop_the_run(ray_cluster, tmp_path, mode):
    """Replica 1's process SIGKILLed, then replica 0's while that repair is carried out (allreduce:
    3 replicas, so a holder of the model survives; both ranks are replaced), the partition server's
    process (allreduce: SIGSTOPped and never resumed instead; the driver sees its pings go
    unanswered for hang_timeout_s / 2, kills it and starts the next incarnation from its journal,
    and no replica waiting on it is taken for hung), a shard's (the sharded modes), and replica
    1's again."""
    # the shards snapshotted only at the start and at each replica's death (no periodic one), so
    # the shard killed at step 70 has updates to take back: ~35 steps of exchanges since the
    # last snapshot (on a busy host a periodic one could land just before the kill: nothing to replay)
    stopped = mode == "allreduce"  # the replicas wait on a stopped server ~6 s: hang_timeout_s 12
    cfg = compound_config(tmp_path, mode, f"scaling.replicas={3 if mode == 'allreduce' else 2}",
                          "fault_tolerance.shard_snapshot_every_s=600",
                          *(["fault_tolerance.hang_timeout_s=12"] if stopped else []))
    faults = [Fault("kill_replica", 1, at_step=30), Fault("kill_replica", 0, during="repair"),
              Fault("hang_server" if stopped else "kill_server", 0, at_step=55), Fault("kill_replica", 1, at_step=90)]
    if mode != "allreduce":
        faults.insert(3, Fault("kill_shard", 0, at_step=70))
    trainer = ElasticTrainer(cfg, show_progress=False)
    with FaultInjector(lambda: trainer.controller, faults) as inj:
        result = trainer.fit()
    assert [(f["kind"], f.get("during")) for f in inj.fired] == [(f.kind, f.during) for f in faults], inj.fired
    assert all("error" not in f for f in inj.fired)
    assert result.final.test_accuracy >= LEARNED
    failed = [e["rank"] for e in result.events if e["kind"] == "replica_failed"]
    replaced = [e for e in result.events if e["kind"] == "replica_replaced"]
    assert failed == [1, 0, 1] if stopped else (failed[:2] == [1, 0] and failed[-1] == 1), failed
    assert {0, 1} <= {r for e in replaced[:-1] for r in e["ranks"]} and replaced[-1]["ranks"] == [1], replaced
    assert all(e["recovery_s"] > 0 for e in replaced)
    assert replaced[-1]["survivors_kept"] == ([0, 2] if mode == "allreduce" else [0])  # survivors keep their actors
    [server] = [e for e in result.events if e["kind"] == "server_rebuilt"]
    assert server["generation"] == 1 and server["partitions_done"] >= 0
    assert ("no answer" in server["detected_by"]) == stopped, server
    assert server.get("lost_updates", 0) == 0, server
    if mode != "allreduce":
        [rebuilt] = [e for e in result.events if e["kind"] == "shard_rebuilt"]
        assert rebuilt["shard"] == 0 and rebuilt["replayed_updates"] + rebuilt["resent_updates"] > 0
        assert rebuilt["lost_updates"] == 0, (rebuilt, [(e["kind"], e.get("rank", e.get("ranks"))) for e in result.events])  # every acknowledged update replayed or re-sent
    # the mode's own figures reach MLflow
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    metrics = client.get_run(result.mlflow_run_id).data.metrics
    assert {"allreduce": "test_accuracy", "downpour": "staleness_mean", "easgd": "elastic_distance"}[mode] in metrics, sorted(metrics)
    # the control loop's decisions are in the run, and today's `decide` makes each of them again
    with open(client.download_artifacts(result.mlflow_run_id, "decisions.jsonl", str(tmp_path))) as f:
        decisions = read_jsonl(f.read())
    assert [r["exit"]["kind"] for r in decisions].count("Judge") >= 2 and replay(decisions) == []


def compound_config(tmp_path, mode, *overrides):
    """The example, for 5 epochs whatever the accuracy (every fault here fires by step 80, in the
    third epoch at the latest)."""
    return JobConfig.from_yaml(f"examples/mnist_{mode}.yaml", [
        "scaling.cpus_per_replica=0.5", "tracking.progress_interval_s=0", "tracking.log_every_steps=2",
        "stop.epochs=5", "stop.at_target=false",
        f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db", f"checkpoint.storage={tmp_path}/ck", *overrides])


@pytest.mark.full
def test_a_kill_during_a_grow_is_repaired(ray_cluster, tmp_path):
    """2 -> 3 replicas; replica 1's process SIGKILLed while the newcomer joins."""
    cfg = compound_config(tmp_path, "allreduce", "scaling.replicas=2", "scaling.max_replicas=3",
                          "scaling.poll_s=0.5", "scaling.grow_after=1")
    trainer = ElasticTrainer(cfg, show_progress=False)
    with FaultInjector(lambda: trainer.controller, [Fault("kill_replica", 1, during="resize")]) as inj:
        result = trainer.fit()
    assert [f.get("during") for f in inj.fired] == ["resize"] and "error" not in inj.fired[0]
    assert result.final.test_accuracy >= LEARNED
    assert any(e["kind"] == "replica_replaced" and 1 in e["ranks"] for e in result.events)


@pytest.mark.full
def test_a_kill_during_a_switch_is_repaired_and_the_switch_carried_out(ray_cluster, tmp_path):
    """examples/mnist_phases.yaml (downpour -> allreduce -> easgd) with the first switch mid-epoch
    (its `until` in steps): replica 1's process SIGKILLed while the first switch is carried out.
    (A kill in the middle of a switch at an epoch's end: tests/integration/test_switching_ray.py.)"""
    extra = [("strategy.phases=[{mode: downpour, n_push: 4, optimizer: {lr: 0.0125, momentum: 0.5}, "
              "until: {steps: 100}}, {mode: allreduce, until: {epochs: 2}}, {mode: easgd, tau: 8, "
              "momentum: 0.9}]")]
    # 8 epochs, the example's; the allreduce phase ends after 2 epochs (not at a test accuracy: a
    # fresh-clone run once stayed under the example's 0.96 for 6 epochs after the repair, so the
    # second switch never came; what is tested is the first switch's repair)
    cfg = compound_config(tmp_path, "phases", "stop.epochs=8", *extra)
    trainer = ElasticTrainer(cfg, show_progress=False)
    with FaultInjector(lambda: trainer.controller, [Fault("kill_replica", 1, during="switch")]) as inj:
        result = trainer.fit()
    assert [f.get("during") for f in inj.fired] == ["switch"] and "error" not in inj.fired[0]
    assert result.final.test_accuracy >= LEARNED
    assert [e["to"] for e in result.events if e["kind"] == "mode_switch"] == ["allreduce", "easgd"]
    assert any(e["kind"] == "replica_replaced" and 1 in e["ranks"] for e in result.events)
