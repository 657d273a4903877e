"""End to end on Ray's own autoscaler (orchestrator/testing/local_autoscaler.py: the fake multi-node
provider, whose nodes are raylets on this machine that the autoscaler launches and terminates).
A 0-CPU head and no worker node at the start; worker type `cpu_node` has 1 CPU, 0 to 2 of them.
A driver process joins it through the Python API with 1 replica and room for up to 2: it finds
no room, asks the autoscaler and waits (scaling.wait_for_room_s) instead of failing; the
autoscaler launches a node, the run starts, asks for room for a second replica, the autoscaler
launches another node and the run grows to 2; a callback asks the run to stop once it has grown
(the epoch ends at 2 replicas: no fixed number of epochs has to outlast a slow node start); at
the end the request is withdrawn and the idle nodes are terminated (idle_timeout_minutes 0.2). The times measured are printed (`pytest -s` shows them):

    flock /tmp/ray.lock python -m pytest -q -s tests/e2e/test_autoscaler_e2e.py
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e

CPU_NODE = {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 0, "max_workers": 2}
IDLE_TIMEOUT_MIN = 0.2  # 12 s: idle nodes go soon after the run
RELEASE_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def autoscaling_cluster():
    from orchestrator.testing.local_autoscaler import LocalAutoscalingCluster

    cluster = LocalAutoscalingCluster({"CPU": 0}, {"cpu_node": dict(CPU_NODE)},
                                      idle_timeout_minutes=IDLE_TIMEOUT_MIN, max_workers=2)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.shutdown()
        assert not cluster.leftovers(), "processes of the autoscaling cluster were left"


def watch_nodes(cluster, stop: threading.Event, seen: list) -> None:
    """The alive worker-node count, once a second, while the run goes (the most is what counts)."""
    while not stop.is_set():
        try:
            seen.append((time.time(), cluster.worker_nodes()))
        except Exception:
            pass
        stop.wait(1.0)


DRIVER = """
import json, sys
from orchestrator import Action, ElasticTrainer, JobConfig

class StopOnceGrown:
    def on_event(self, event):
        if event["kind"] == "resize" and event.get("direction") == "grow":
            return Action.STOP

config = JobConfig.from_yaml(sys.argv[1], sys.argv[3:])
result = ElasticTrainer(config, show_progress=False, callbacks=[StopOnceGrown()]).fit()
with open(sys.argv[2], "w") as f:
    json.dump(result.to_dict(), f)
"""


def test_the_autoscaler_starts_the_run_from_zero_nodes_grows_it_and_releases_the_nodes(autoscaling_cluster, tmp_path):
    cluster = autoscaling_cluster
    assert cluster.worker_nodes() == 0
    env = dict(cluster.env, RAY_ADDRESS=cluster.address, PYTHONPATH=REPO)
    env.pop("MLFLOW_TRACKING_URI", None)
    out = tmp_path / "result.json"
    sets = ["model.factory=examples.models:tiny_mlp", "data.source=builtin:synthetic", "data.batch_size=16",
            "scaling.replicas=1", "scaling.max_replicas=2", "scaling.cpus_per_replica=1", "scaling.poll_s=1",
            "scaling.wait_for_room_s=240", "stop.epochs=60", "stop.target_accuracy=null",
            "faults.slow_replicas={0: 0.006}",  # 208 steps of ~6 ms: epochs of ~1.3 s, the grow lands mid-run
            f"checkpoint.storage={tmp_path / 'ck'}", f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db"]
    (tmp_path / "driver.py").write_text(DRIVER)
    cmd = [sys.executable, str(tmp_path / "driver.py"), os.path.join(REPO, "examples", "mnist_allreduce.yaml"),
           str(out)] + sets
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=watch_nodes, args=(cluster, stop, seen), daemon=True)
    watcher.start()
    t_start = time.time()
    driver = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
    try:
        stdout, _ = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, 9)
        stop.set()
        watcher.join(5)
    run_s = time.time() - t_start
    (tmp_path / "driver.log").write_text(stdout)
    assert driver.returncode == 0, stdout[-3000:]

    # it started with no room and waited for the autoscaler instead of failing
    assert "waiting up to 240s (scaling.wait_for_room_s)" in stdout, stdout[-3000:]
    room = re.search(r"room for 1 replicas after ([0-9.]+)s", stdout)
    assert room, stdout[-3000:]
    wait_s = float(room.group(1))

    result = json.loads(out.read_text())
    events = result["events"]
    asks = [e for e in events if e["kind"] == "autoscaler_request"]
    grows = [e for e in events if e["kind"] == "resize" and e["direction"] == "grow"]
    assert asks and asks[0]["bundles"] == 2, asks
    assert [(g["old_size"], g["new_size"]) for g in grows] == [(1, 2)], grows
    grow = grows[0]
    assert asks[0]["t_wall"] < grow["t_wall"]
    assert asks[-1]["withdrawn"] and asks[-1]["bundles"] == 0, asks  # taken back at the end
    assert result["epochs"] < 60 and "StopOnceGrown after resize" in result["stop_reason"], \
        (result["epochs"], result["stop_reason"])
    sizes = [e["replicas"] for e in events if e["kind"] == "epoch_end"]
    assert sizes[0] == 1 and sizes[-1] == 2, sizes
    # the autoscaler launched the nodes: none at the start, two while the run grew
    assert max(n for _, n in seen) == 2, seen

    # after the run its request is gone and the idle nodes are terminated
    t_end, nodes = time.time(), None
    while time.time() - t_end < RELEASE_TIMEOUT_S:
        nodes = cluster.worker_nodes()
        if nodes == 0:
            break
        time.sleep(1)
    release_s = time.time() - t_end
    assert nodes == 0, f"{nodes} worker nodes still alive {RELEASE_TIMEOUT_S}s after the run"

    log = cluster.autoscaler_log()
    assert sum(": Launching 1 nodes, type cpu_node" in ln for ln in log) == 2, log
    assert sum("StandardAutoscaler: Terminating" in ln and "(idle)" in ln for ln in log) == 2, log
    launches = cluster.launch_times()

    request_to_grown = grow["stepping_at"] - asks[0]["t_wall"]
    request_to_launch = launches[1] - asks[0]["t_wall"]
    print(f"\nautoscaler e2e: waited {wait_s:.1f}s for room for the first replica (no node at the start); "
          f"request for 2 -> every replica stepping at 2: {request_to_grown:.1f}s "
          f"(request -> second node launched {request_to_launch:.1f}s, room seen -> joined {grow['since_room_seen_s']:.1f}s, join {grow['reconfigure_s']:.2f}s, "
          f"resize decided -> stepping {grow['resize_s']:.2f}s); run {run_s:.1f}s, "
          f"nodes released {release_s:.1f}s after it; final accuracy {result['final']['test_accuracy']:.3f}")
    for line in log:
        print("  " + line.split(" -- ", 1)[-1])
