"""End to end: SIGKILL the driver of a CLI run mid-training, then `python -m orchestrator resume
RUN_ID`: the run goes on from its newest good checkpoint in the same MLflow run (on a real
`mlflow server`), its step counter continues, and it reaches the target."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def test_a_killed_driver_resumes_in_the_same_mlflow_run(ray_head, mlflow_server, tmp_path):
    env = dict(ray_head.env, RAY_ADDRESS=ray_head.address, PYTHONPATH=REPO)
    env.pop("MLFLOW_TRACKING_URI", None)
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-m", "orchestrator", "run", os.path.join(REPO, "examples", "mnist_allreduce.yaml"),
           "--set", f"tracking.tracking_uri={mlflow_server}", "--set", "tracking.experiment=e2e-resume",
           "--set", f"checkpoint.storage={ck}", "--set", "checkpoint.every_epochs=1",
           "--set", "faults.slow_replicas={0: 0.02}", "--no-progress"]  # epochs of a few seconds
    driver = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not glob.glob(f"{ck}/*/ckpt-*-epoch_0002.pt.json") and time.monotonic() < deadline:
            assert driver.poll() is None, driver.stdout.read()[-3000:]
            time.sleep(0.2)
        assert glob.glob(f"{ck}/*/ckpt-*-epoch_0002.pt.json"), "no epoch-2 checkpoint in time"
        os.kill(driver.pid, signal.SIGKILL)  # the driver dies at once: no handler, no final record
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    [run_dir] = glob.glob(f"{ck}/*")
    run_id = os.path.basename(run_dir)
    client = MlflowClient(mlflow_server)
    before = client.get_metric_history(run_id, "test_accuracy")
    assert client.get_run(run_id).info.status == "RUNNING"  # killed: nobody ended it

    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "resume", run_id, "--tracking-uri", mlflow_server,
                           "--result-json", str(out), "--no-progress"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["mlflow_run_id"] == run_id  # the same run, not a second one
    assert result["final"]["test_accuracy"] >= 0.97
    [resumed] = [e for e in result["events"] if e["kind"] == "resumed"]
    ends = [e for e in result["events"] if e["kind"] == "epoch_end"]
    after = [e for e in ends if e["t_wall"] > resumed["t_wall"]]
    assert resumed["epoch"] >= 2 and after[0]["epoch"] == resumed["epoch"] + 1
    assert resumed["step"] in {m.step for m in before}  # the step of the checkpoint's epoch end, as logged
    assert after[0]["step"] > resumed["step"]  # the step counter continues
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run_id, "test_accuracy")
    assert len(history) > len(before) and max(m.step for m in history) == result["steps"]
    assert len(client.search_runs([run.info.experiment_id])) == 1  # no second run was opened
