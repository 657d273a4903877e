"""`ray job stop` of a running job (SIGTERM, then SIGKILL ~3 s later): the MLflow run keeps its
record: status KILLED and events.jsonl with every event so far, written within seconds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import REPO

pytestmark = pytest.mark.e2e
TERMINAL = {"STOPPED", "SUCCEEDED", "FAILED"}


def ray_cli(ray_head, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    env = dict(ray_head.env)
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "job", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)


def job_api(ray_head, job_id: str, action: str = "") -> dict:
    req = urllib.request.Request(f"{ray_head.dashboard_url}/api/jobs/{job_id}{action}", method="POST" if action else "GET",
                                 headers={"Authorization": f"Bearer {ray_head.env['RAY_AUTH_TOKEN']}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read() or b"{}")


def events_of(client: MlflowClient, run_id: str, tmp_path) -> list[dict]:
    try:
        path = client.download_artifacts(run_id, "events.jsonl", str(tmp_path / f"dl{time.monotonic_ns()}"))
    except Exception:  # not written yet
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def wait_for(what: str, check, timeout_s: float, every_s: float = 0.5, ray_head=None, job_id=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if ray_head is not None:
            status = job_api(ray_head, job_id)["status"]
            if status in TERMINAL:
                logs = ray_cli(ray_head, "logs", "--address", ray_head.dashboard_url, job_id).stdout
                pytest.fail(f"job {job_id} ended ({status}) while waiting for {what}:\n{logs[-3000:]}")
        time.sleep(every_s)
    pytest.fail(f"no {what} within {timeout_s:.0f}s")


@pytest.mark.full
def test_ray_job_stop_marks_the_run_killed_and_keeps_its_events(ray_head, mlflow_server, tmp_path):
    job_id = f"stop-{uuid.uuid4().hex[:8]}"
    experiment = f"e2e-{job_id}"
    entrypoint = [sys.executable, "-m", "orchestrator", "run", os.path.join(REPO, "examples", "mnist_allreduce.yaml"),
                  "--set", "stop.epochs=50", "--set", "stop.target_accuracy=null", "--set", "data.batch_size=16",
                  "--set", "faults.slow_replicas={0: 0.08}",  # epochs of 10 s or more: the stop lands mid-epoch
                  "--set", f"tracking.tracking_uri={mlflow_server}", "--set", f"tracking.experiment={experiment}",
                  "--set", f"checkpoint.storage={tmp_path}/ck", "--no-progress"]
    deadline = time.monotonic() + 60
    while True:  # retried while the head's job agent is still starting
        proc = ray_cli(ray_head, "submit", "--address", ray_head.dashboard_url, "--submission-id", job_id,
                       "--no-wait", "--", *entrypoint)
        if "No available agent" not in proc.stdout + proc.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    client = MlflowClient(mlflow_server)
    try:
        def first_epoch_logged():
            exp = client.get_experiment_by_name(experiment)
            runs = client.search_runs([exp.experiment_id]) if exp else []
            return runs[0].info.run_id if runs and "test_accuracy" in runs[0].data.metrics else None

        run_id = wait_for("test_accuracy metric", first_epoch_logged, 420, ray_head=ray_head, job_id=job_id)
        running = wait_for("epoch_end event in the running job's events.jsonl",
                           lambda: [e for e in events_of(client, run_id, tmp_path) if e["kind"] == "epoch_end"],
                           30, ray_head=ray_head, job_id=job_id)
        assert running and client.get_run(run_id).info.status == "RUNNING"

        stop = ray_cli(ray_head, "stop", "--address", ray_head.dashboard_url, job_id)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        # `ray job stop` SIGKILLs the driver a few seconds after its SIGTERM: what is not recorded
        # by then never is, so the deadlines below only guard against a hang
        wait_for("KILLED status", lambda: client.get_run(run_id).info.status == "KILLED", 60)
        events = wait_for("ended event", lambda: (lambda ev: ev if any(e["kind"] == "ended" for e in ev) else None)(
            events_of(client, run_id, tmp_path)), 60)
        kinds = [e["kind"] for e in events]
        assert kinds[0] == "started" and "epoch_end" in kinds, kinds
        ended = [e for e in events if e["kind"] == "ended"]
        assert ended == [ended[0]] and ended[0]["status"] == "KILLED"
        assert job_api(ray_head, job_id)["status"] == "STOPPED"
    finally:
        try:
            if job_api(ray_head, job_id)["status"] not in TERMINAL:
                job_api(ray_head, job_id, "/stop")
                deadline = time.monotonic() + 30
                while job_api(ray_head, job_id)["status"] not in TERMINAL and time.monotonic() < deadline:
                    time.sleep(1)
        except Exception:
            pass
