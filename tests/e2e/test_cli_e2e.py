"""End to end: the CLI against the session's Ray head, `ray job submit` of the main example,
tracking to a real `mlflow server`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import REPO

pytestmark = pytest.mark.e2e
REQUIRED = {"mlflow_run_id", "mode", "replicas", "epochs", "steps", "samples", "wall_s", "samples_per_s",
            "time_to_target_s", "final", "events"}


def test_cli_run_joins_ray_address_and_tracks_to_server(ray_head, mlflow_server, tmp_path):
    out = tmp_path / "result.json"
    env = dict(ray_head.env, RAY_ADDRESS=ray_head.address, PYTHONPATH=REPO)
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "orchestrator", "run", os.path.join(REPO, "examples", "mnist_allreduce.yaml"),
           "--set", "model.factory=examples.models:tiny_mlp", "--set", "data.source=builtin:synthetic",
           "--set", "stop.epochs=2", "--set", "stop.target_accuracy=null",
           "--set", f"tracking.tracking_uri={mlflow_server}", "--set", "tracking.experiment=e2e-cli",
           "--set", f"checkpoint.storage=file://{tmp_path}/ck", "--result-json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert REQUIRED <= set(result) and result["time_to_target_s"] is None
    assert result["epochs"] == 2 and result["final"]["test_accuracy"] > 0.9
    assert "epoch 1: test_accuracy" in proc.stdout  # plain progress lines when not on a terminal
    assert os.path.exists(f"{tmp_path}/ck/{result['mlflow_run_id']}/model.pt")
    run = MlflowClient(mlflow_server).get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.metrics["test_accuracy"] > 0.9
    assert not os.path.exists(tmp_path / "mlflow.db")  # tracked to the server, not a local store


def submit(ray_head, entrypoint: list[str], timeout_s: float = 600) -> subprocess.CompletedProcess:
    """`ray job submit` (waits for the job); retried while the head's job agent is still starting."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [ray_bin, "job", "submit", "--address", ray_head.dashboard_url, "--"] + entrypoint
    env = dict(ray_head.env)
    env.pop("MLFLOW_TRACKING_URI", None)
    deadline = time.monotonic() + 60
    while True:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if "No available agent" not in proc.stdout + proc.stderr or time.monotonic() > deadline:
            return proc
        time.sleep(2)


def test_ray_job_submit_main_example_reaches_97(ray_head, mlflow_server, tmp_path):
    out = tmp_path / "result.json"
    proc = submit(ray_head, [sys.executable, "-m", "orchestrator", "run",
                             os.path.join(REPO, "examples", "mnist_allreduce.yaml"),
                             "--set", f"tracking.tracking_uri={mlflow_server}",
                             "--set", f"checkpoint.storage={tmp_path}/ck", "--result-json", str(out)])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "succeeded" in proc.stdout
    result = json.loads(out.read_text())
    assert result["final"]["test_accuracy"] >= 0.97
    assert result["time_to_target_s"] is not None and result["replicas"] == 2
    client = MlflowClient(mlflow_server)
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.tags["mode"] == "allreduce"
    history = client.get_metric_history(result["mlflow_run_id"], "test_accuracy")
    assert max(m.value for m in history) >= 0.97
