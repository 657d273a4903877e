"""A job the cluster cannot hold is bad input: found right after connecting (RAY_ADDRESS) and
waiting scaling.wait_for_room_s for an autoscaler, one line naming the short resource, exit
code 2, no actor started, nothing written."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def replica_actors(ray_head) -> int:
    from ray.util.state import list_actors

    return len(list_actors(address=ray_head.dashboard_url, filters=[("class_name", "=", "ModelReplica")],
                           limit=10000, timeout=30))


@pytest.mark.parametrize("overrides, needle", [
    (["scaling.replicas=3", "scaling.cpus_per_replica=2", "scaling.wait_for_room_s=0"],
     "scaling: 3 replicas x 2 CPU need 6 CPU, the cluster has 4"),
    pytest.param(["scaling.gpus_per_replica=1", "scaling.wait_for_room_s=0"],
                 "scaling: 2 replicas x 1 GPU need 2 GPU, the cluster has 0", marks=pytest.mark.full),
    # a joined cluster is given time to grow (no autoscaler here: the wait runs out)
    pytest.param(["strategy.mode=downpour", "scaling.gpus_per_replica=0.5", "scaling.wait_for_room_s=2"],
                 "scaling: 2 replicas x 0.5 GPU need 1 GPU, the cluster has 0 (waited 2s for the autoscaler: "
                 "scaling.wait_for_room_s)", marks=pytest.mark.full),
])
@pytest.mark.empty_tmp  # it checks that nothing was written to tmp_path
def test_cluster_too_small_for_the_job(ray_head, tmp_path, overrides, needle):
    before = replica_actors(ray_head)
    env = dict(ray_head.env, RAY_ADDRESS=ray_head.address, PYTHONPATH=REPO)
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "orchestrator", "run", os.path.join(REPO, "examples", "mnist_allreduce.yaml"),
           "--set", "model.factory=examples.models:tiny_mlp", "--set", "data.source=builtin:synthetic",
           "--set", f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
           "--set", f"checkpoint.storage={tmp_path}/ck", "--result-json", str(tmp_path / "result.json")]
    cmd += [a for o in overrides for a in ("--set", o)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    err = proc.stderr.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)  # no MLflow store, no checkpoint, no result
    assert replica_actors(ray_head) == before
