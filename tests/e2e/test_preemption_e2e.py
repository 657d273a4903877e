"""A preemption notice acted on before the deadline, in process on a cluster this test starts
(`ray.cluster_utils.Cluster`: a 0-CPU head for the driver, the partition server and the shards;
three 1-CPU worker nodes). 2 replicas train; after the first epoch's checkpoint the node of
a replica (the one beside the checkpoint keeper if there is one, else replica 1) is drained as a spot preemption is (`DRAIN_NODE_REASON_PREEMPTION`, a 20 s deadline,
the GCS call the autoscaler makes) and removed at the deadline; the head, where the driver runs,
is drained too (and left: nothing of the run can move off it). The run moves replica 1 to the
free node before the deadline and takes a checkpoint inside the epoch for the driver's node: no
replica failure is ever seen, no step is lost, every training row is used once in every epoch,
and the run finishes its epochs. Its checkpoints are kept in memory too (`checkpoint.in_memory`):
the keeper is on a worker node, never the driver's, moves off the drained node if it was there,
and the finished run ends it. Before the notice, the autoscaler's own drain of an idle node
(`DRAIN_NODE_REASON_IDLE_TERMINATION`) is sent to every node holding a replica or the keeper:
each refuses it (a node holding any actor, even one of 0 CPU, is not idle) and the run goes on
as if nothing was sent."""
from __future__ import annotations

import dataclasses
import glob
import os
import time

import pytest
import ray

from actors.checkpoints.keeper import NAMESPACE
from orchestrator.config import JobConfig
from orchestrator.fleet.drains import draining_nodes
from orchestrator.persistence.memory_copy import directory_key, keeper_name
from orchestrator.trainer import ElasticTrainer
from tests.conftest import REPO
from tests.e2e.conftest import InThread

pytestmark = pytest.mark.e2e

DEADLINE_S = 20


def ask_drain(cluster, node_hex: str, seconds: int, reason: str = "PREEMPTION") -> tuple[bool, str]:
    """The GCS call the autoscaler makes: DRAIN_NODE_REASON_<reason> with a deadline `seconds`
    away (0: none); whether the node took it, and why not."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=cluster.address)
    deadline_ms = int(time.time() * 1000) + seconds * 1000 if seconds else 0
    return gcs.drain_node(node_hex, autoscaler_pb2.DrainNodeReason.Value(f"DRAIN_NODE_REASON_{reason}"),
                          f"{reason.lower()} (test)", deadline_ms)


def drain(cluster, node_hex: str, seconds: int) -> None:
    accepted, why = ask_drain(cluster, node_hex, seconds)
    assert accepted, why


@pytest.mark.full  # ~1.2 min on its own cluster
@pytest.mark.parametrize("own_cluster", [3], indirect=True)
def test_a_replica_on_a_drained_node_moves_before_the_deadline_without_a_failure(own_cluster, tmp_path):
    ck = tmp_path / "ck"
    cfg = JobConfig.from_yaml(f"{REPO}/examples/mnist_allreduce.yaml", [
        "stop.epochs=60", "stop.target_accuracy=null",  # the test ends it 2 epochs after the node goes
        "checkpoint.every_epochs=1", f"checkpoint.storage={ck}", "checkpoint.in_memory=true",
        'faults.slow_replicas={0: 0.04, 1: 0.04}', "tracking.progress_interval_s=0",
        f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db"])
    trainer = ElasticTrainer(cfg, show_progress=False)
    trainer._trace_ids = True  # every row the replicas train on, by epoch and rank
    run = InThread(trainer.fit)  # this thread drains and removes the node
    run.wait_for_file(f"{ck}/*/ckpt-*-epoch_0001.pt.json")
    [directory] = {os.path.dirname(p) for p in glob.glob(f"{ck}/*/ckpt-*-epoch_0001.pt.json")}
    keeper = keeper_name(directory_key(directory))
    held_by = ray.get_actor(keeper, namespace=NAMESPACE)  # the run's keeper, holding its checkpoints (ValueError if not)
    keeper_node = ray.get(held_by.fetch.remote(), timeout=60)[0]["node_id"]
    ctl = trainer.controller
    # the node of the replica beside the keeper when there is one (the keeper moves too), else replica 1's
    rank = min((r for r, n in ctl.group.nodes.items() if n == keeper_node), default=1)
    node = ctl.group.nodes[rank]
    # the autoscaler's own drain of an idle node (IDLE_TERMINATION, what it sends once a node has
    # been idle for idle_timeout_minutes) is refused by every node holding an actor of the run,
    # the 0-CPU keeper's too: it never takes a node from under the run, and the run sees no drain
    for held in {*ctl.group.nodes.values(), keeper_node}:
        accepted, why = ask_drain(own_cluster, held, 0, "IDLE_TERMINATION")
        assert not accepted and held not in draining_nodes(), (held, why)
    drain(own_cluster, node, DEADLINE_S)
    head = own_cluster.head_node.node_id
    drain(own_cluster, head, DEADLINE_S)
    t_drain = time.monotonic()
    while time.monotonic() < t_drain + DEADLINE_S and run.alive():
        time.sleep(0.2)
    assert run.alive(), run.out  # the node goes while the run still trains: a replica left there would fail
    [victim] = [n for n in own_cluster.worker_nodes if n.node_id == node]
    own_cluster.remove_node(victim)  # the node goes at its deadline, as a preempted instance does
    t_removed = time.time()
    last = ctl.totals.epochs + 2  # the run ends 2 epochs after the node went, however fast this host is
    ctl.stop_policy = dataclasses.replace(ctl.stop_policy, epochs=last)
    result = run.result(timeout_s=300)
    kinds = [e["kind"] for e in result.events]
    assert "replica_failed" not in kinds and "failure_decision" not in kinds, \
        [e for e in result.events if e["kind"] in ("replica_failed", "failure_decision")]
    [moved] = [e for e in result.events if e["kind"] == "replica_evacuated"]
    r = str(rank)
    assert moved["ranks"] == [rank] and moved["steps_lost"] == 0 and moved["causes"] == {r: "preempted"}, moved
    assert moved["nodes"] == {r: node} and 0 < moved["deadline_left_s"][r] <= DEADLINE_S, moved
    assert moved["evacuate_s"] < DEADLINE_S, moved  # stepping again elsewhere before the node went
    assert ctl.group.nodes[rank] != node and result.epochs == last and ctl.totals.replica_restarts == 0
    [seen] = [e for e in result.events if e["kind"] == "driver_node_draining"]
    assert seen["node"] == head and 0 < seen["deadline_left_s"] <= DEADLINE_S, seen
    for_drain = [e for e in result.events if e["kind"] == "checkpoint" and (e.get("in_epoch") or {}).get("for")]
    assert 1 <= len(for_drain) <= 2 and all(e["in_epoch"]["for"] == "driver_node_draining" for e in for_drain), \
        [(e["kind"], e.get("epoch"), e.get("in_epoch")) for e in result.events if "checkpoint" in e["kind"]
         or e["kind"] in ("driver_node_draining", "replica_evacuated", "epoch_end")]
    workers = {n.node_id for n in own_cluster.worker_nodes} | {node}
    held = [e["in_memory"] for e in result.events if e["kind"] == "checkpoint" and e["t_wall"] < t_removed]
    assert held and set(held) <= workers, (held, head)  # on another node than the driver's
    moved_keeper = [e for e in result.events if e["kind"] in ("keeper_evacuated", "keeper_evacuation_failed")]
    if keeper_node == node:  # the keeper was on the drained node too: it moved off before the node went
        assert [(e["kind"], e["node"]) for e in moved_keeper] == [("keeper_evacuated", node)], moved_keeper
        assert moved_keeper[0]["done_wall"] < t_removed and moved_keeper[0]["to"] in workers - {node}, moved_keeper
    else:
        assert not moved_keeper, moved_keeper
    with pytest.raises(ValueError):  # the finished run ended its keeper
        ray.get_actor(keeper, namespace=NAMESPACE)
    ids = sorted(int(i) for i in trainer._dataset.train.ids)
    for epoch, consumed in enumerate(ctl.consumed, 1):
        seen = sorted(i for steps in consumed.values() for step in steps for i in step)
        assert seen == ids, f"epoch {epoch}: {len(seen)} rows for {len(ids)}, {len(seen) - len(set(seen))} twice"



@pytest.mark.full  # ~30 s on its own cluster
@pytest.mark.parametrize("own_cluster", [2], indirect=True)
def test_the_keeper_is_off_the_drivers_node_and_moves_off_a_drained_one(own_cluster, tmp_path):
    """A keeper is placed off the driver's node whenever there is another node (a 0-CPU head for
    the driver, two workers): each of 8 keepers, started one after another, is on a worker (Ray
    puts a 0-CPU actor with a soft affinity on a random node: a third of them on the head). The
    first one's node is then drained as a preemption is: its copy moves to the other worker
    before the node is removed (a checkpoint handed while it moves goes with it), and is found
    there, whole, afterwards."""
    from orchestrator.persistence.checkpoint import CheckpointStore
    from orchestrator.persistence.memory_copy import MemoryCopy, look

    workers = {n.node_id for n in own_cluster.worker_nodes}
    data, meta = CheckpointStore.serialized({"step": 1}, step=1, epoch=1, tag="epoch_0001")
    copies = [MemoryCopy(f"{tmp_path}/run{i}", keep_s=3600.0) for i in range(8)]
    try:
        held = [copy.hold(meta, data) for copy in copies]
        assert all(h.get("in_memory") in workers for h in held), (held, workers)
        copy, first = copies[0], held[0]["in_memory"]
        drain(own_cluster, first, DEADLINE_S)
        t = time.monotonic()
        while first not in (draining := draining_nodes()) and time.monotonic() < t + DEADLINE_S:
            time.sleep(0.2)
        copy.move_off(draining)  # what the run's loop does on each tick
        data2, meta2 = CheckpointStore.serialized({"step": 2}, step=2, epoch=2, tag="epoch_0002")
        during = copy.hold(meta2, data2)  # a checkpoint while the keeper moves: held before, or after, never lost
        assert during.get("in_memory") in workers or "moving" in during.get("in_memory_failed", ""), during
        moves = []
        while not moves and time.monotonic() < t + DEADLINE_S:
            moves = copy.moves()
            time.sleep(0.2)
        [other] = workers - {first}
        assert moves and moves[0].node == first and moves[0].to == other and moves[0].bytes == len(data2), moves
        [gone] = [n for n in own_cluster.worker_nodes if n.node_id == first]
        own_cluster.remove_node(gone)  # at the deadline
        back_meta, back, why = look(f"{tmp_path}/run0")
        assert why == "" and back_meta["node_id"] == other and back == {"step": 2}, why
        data3, meta3 = CheckpointStore.serialized({"step": 3}, step=3, epoch=3, tag="epoch_0003")
        assert copy.hold(meta3, data3) == {"in_memory": other}  # the next checkpoint goes to the moved keeper
    finally:
        for copy in copies:
            copy.release()
