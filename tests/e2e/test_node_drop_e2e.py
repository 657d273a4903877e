"""A node dropped during a grow, in process on a cluster this test starts
(`ray.cluster_utils.Cluster`: a 0-CPU head for the driver, the partition server and the shards,
one 1-CPU worker node). The run starts with 1 replica and scaling.max_replicas 2; after its
second epoch's checkpoint a second worker node is added, the run grows into it, and while the
newcomer joins, the node of the run's only member is removed (`drop_node` during `resize`):
the state holder is gone mid-grow. The run goes on (allreduce from its last checkpoint, the
sharded modes from their shards) and learns on (0.93 test accuracy or more). allreduce runs in `make test-all`;
every mode with `-m soak` (docs/reliability.md)."""
from __future__ import annotations


import pytest

from orchestrator.testing.chaos import Fault, FaultInjector
from orchestrator.config import JobConfig
from orchestrator.trainer import ElasticTrainer
from tests.conftest import REPO
from tests.e2e.conftest import InThread

pytestmark = pytest.mark.e2e


def drop_during_grow(cluster, tmp_path, mode: str):
    ck = tmp_path / "ck"
    cfg = JobConfig.from_yaml(f"{REPO}/examples/mnist_{mode}.yaml", [
        "scaling.replicas=1", "scaling.min_replicas=1", "scaling.max_replicas=2", "scaling.poll_s=0.5",
        "scaling.grow_after=1", "checkpoint.every_epochs=1", f"checkpoint.storage={ck}",
        "tracking.progress_interval_s=0", f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db"])
    trainer = ElasticTrainer(cfg, show_progress=False)

    def fit():
        with FaultInjector(lambda: trainer.controller, [Fault("drop_node", 0, during="resize")],
                           cluster=cluster) as inj:
            result = trainer.fit()
        return result, inj.fired
    run = InThread(fit)  # this thread adds the node
    run.wait_for_file(f"{ck}/*/ckpt-*-epoch_0002.pt.json")
    cluster.add_node(num_cpus=1)
    result, fired = run.result()
    assert [f["kind"] for f in fired] == ["drop_node"] and "error" not in fired[0], fired
    assert result.final.test_accuracy >= 0.93  # far below every mode's plateau: learned through the drop
    failed = [e for e in result.events if e["kind"] == "replica_failed"]
    assert failed and failed[0]["rank"] == 0, failed
    return result


@pytest.mark.full
def test_a_node_dropped_during_a_grow_allreduce(own_cluster, tmp_path, capfd):
    result = drop_during_grow(own_cluster, tmp_path, "allreduce")
    assert any(e.get("state_from") == "checkpoint" for e in result.events), \
        [e for e in result.events if e["kind"] in ("replica_replaced", "replica_dropped", "resize")]
    # checkpoints and the sqlite store are paths on the driver's node of a 2-node cluster: said at the start
    err = capfd.readouterr().err
    assert f"warning: {tmp_path}/ck is a path on this node (" in err and "one of 2 nodes" in err, err[-2000:]


@pytest.mark.soak
@pytest.mark.parametrize("mode", ["downpour", "easgd"])
def test_a_node_dropped_during_a_grow_sharded(own_cluster, tmp_path, mode):
    drop_during_grow(own_cluster, tmp_path, mode)
