"""End to end on a cluster of three nodes started by the test (`ray.cluster_utils.Cluster`: a
0-CPU head for the driver, the partition server and the shards, and two 1-CPU worker nodes, one
replica each): a worker node is removed mid-run and training goes on with the survivor within
seconds (no replacement: there is no room for one), the run asks the autoscaler for the missing
room; a node is added back and the run grows to scaling.max_replicas again, withdraws its
request, and still reaches 97% on mnist5k. With `scaling.lr_scaling: none` the rate stays
optimizer.lr through both resizes (the linear rule's ramp: tests/integration/test_resize_ray.py)."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import REPO, assert_carried

pytestmark = pytest.mark.e2e


@pytest.fixture
def three_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
        cluster.wait_for_nodes()
        yield cluster, workers
    finally:
        cluster.shutdown()


def wait_for(path_glob: str, driver: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not glob.glob(path_glob):
        assert driver.poll() is None, driver.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"nothing matched {path_glob} in {timeout_s}s"
        time.sleep(0.2)


@pytest.mark.full
def test_a_lost_node_shrinks_the_run_and_a_new_one_grows_it_back(three_nodes, tmp_path):
    cluster, workers = three_nodes
    env = dict(os.environ, RAY_ADDRESS=cluster.address, PYTHONPATH=REPO)
    env.pop("MLFLOW_TRACKING_URI", None)
    ck, out = tmp_path / "ck", tmp_path / "result.json"
    sets = ["scaling.min_replicas=1", "scaling.max_replicas=2", "scaling.poll_s=0.5", "scaling.grow_after=1",
            "scaling.lr_scaling=none", "stop.epochs=11", "stop.at_target=false", "checkpoint.every_epochs=1", f"checkpoint.storage={ck}",
            f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db", "faults.slow_replicas={0: 0.01}"]
    cmd = [sys.executable, "-m", "orchestrator", "run", os.path.join(REPO, "examples", "mnist_allreduce.yaml"),
           "--result-json", str(out), "--no-progress"] + [a for s in sets for a in ("--set", s)]
    driver = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
    try:
        wait_for(f"{ck}/*/ckpt-*-epoch_0002.pt.json", driver)
        t_removed = time.time()
        cluster.remove_node(workers[1])  # its replica dies with it; Ray has not declared the node dead yet
        wait_for(f"{ck}/*/ckpt-*-epoch_0004.pt.json", driver)
        t_added = time.time()
        cluster.add_node(num_cpus=1)
        assert driver.wait(timeout=300) == 0, driver.stdout.read()[-3000:]
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, 9)
    result = json.loads(out.read_text())
    events = result["events"]
    resizes = [e for e in events if e["kind"] == "resize"]
    assert [(e["direction"], e["old_size"], e["new_size"]) for e in resizes] == [("shrink", 2, 1), ("grow", 1, 2)]
    shrink, grow = resizes
    assert "no room for a replacement" in shrink["reason"] and shrink["dropped"] == shrink["ranks"]
    assert shrink["t_wall"] > t_removed and shrink["resize_s"] > 0
    assert grow["t_wall"] > t_added and grow["ranks"] == shrink["ranks"]
    assert_carried(shrink, "membership", "ledger", "regroup", "data", "lr")  # both through the one carrier
    assert_carried(grow, "membership", "state", "regroup", "data", "lr")
    assert not [e for e in events if e["kind"] == "replica_replaced"]  # the run shrank and grew, nothing replaced
    sizes = [e["replicas"] for e in events if e["kind"] == "epoch_end"]
    assert sizes[:2] == [2, 2] and 1 in sizes and sizes[-1] == 2, sizes
    # the autoscaler was asked for room for 2 replicas while the run had 1, and the request withdrawn after
    asks = [e for e in events if e["kind"] == "autoscaler_request"]
    assert [(a["bundles"], a["read_back"]) for a in asks] == [(2, 2), (0, 0)], asks
    assert t_removed < asks[0]["t_wall"] < t_added < asks[1]["t_wall"] < grow["t_wall"]
    # lr_scaling none: the rate stays optimizer.lr whatever the size (the linear rule would halve it)
    assert shrink["lr_before"] == shrink["lr_target"] == grow["lr_target"] == pytest.approx(0.05)
    lrs = {round(m.value, 9) for m in MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_metric_history(
        result["mlflow_run_id"], "lr")}
    assert lrs == {0.05}, lrs
    assert result["final"]["test_accuracy"] >= 0.97
