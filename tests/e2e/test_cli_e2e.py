"""End to end: the CLI against the session's Ray head, `ray job submit` of the main example,
tracking to a real `mlflow server`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
import uuid

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import REPO
from tests.e2e.conftest import MAIN_EXAMPLE, submit

pytestmark = pytest.mark.e2e
REQUIRED = {"mlflow_run_id", "mode", "replicas", "epochs", "steps", "samples", "wall_s", "samples_per_s",
            "time_to_target_s", "final", "events"}


@pytest.mark.full  # make test: the job below runs the same command through `ray job submit` and checks the same
@pytest.mark.empty_tmp  # it checks that nothing was written to tmp_path
def test_cli_run_joins_ray_address_and_tracks_to_server(ray_head, mlflow_server, tmp_path):
    """Also: the run's model loads with mlflow.pytorch.load_model and scores the run's final test
    accuracy on the test split; it is registered as tracking.register_as; training.png is in
    the run and next to the result JSON."""
    out = tmp_path / "result.json"
    env = dict(ray_head.env, RAY_ADDRESS=ray_head.address, PYTHONPATH=REPO)
    env.pop("MLFLOW_TRACKING_URI", None)
    overrides = ["model.factory=examples.models:tiny_mlp", "data.source=builtin:synthetic", "stop.epochs=2",
                 "stop.target_accuracy=null", f"tracking.tracking_uri={mlflow_server}", "tracking.experiment=e2e-cli",
                 "tracking.register_as=e2e-cli-model", f"checkpoint.storage=file://{tmp_path}/ck"]
    example = os.path.join(REPO, "examples", "mnist_allreduce.yaml")
    cmd = [sys.executable, "-m", "orchestrator", "run", example, "--result-json", str(out)]
    cmd += [a for o in overrides for a in ("--set", o)]
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

    from orchestrator.config import JobConfig
    from orchestrator.data.loading import load_dataset

    cfg = JobConfig.from_yaml(example, overrides)
    accuracy = accuracy_of_logged_model(mlflow_server, result["mlflow_run_id"], load_dataset(cfg.data),
                                        cfg.data.batch_size, tmp_path)
    assert abs(accuracy - result["final"]["test_accuracy"]) <= 1e-6, (accuracy, result["final"])
    client = MlflowClient(mlflow_server)
    [version] = client.search_model_versions("name = 'e2e-cli-model'")
    assert version.run_id == result["mlflow_run_id"]
    [logged] = [e for e in result["events"] if e["kind"] == "model_logged"]
    print(f"log_model took {logged['seconds']}s")
    assert "training.png" in [a.path for a in client.list_artifacts(result["mlflow_run_id"])]
    png = client.download_artifacts(result["mlflow_run_id"], "training.png", str(tmp_path / "dl"))
    assert open(png, "rb").read(8) == PNG_MAGIC
    assert (tmp_path / "training.png").read_bytes()[:8] == PNG_MAGIC  # next to result.json

    simulates_from_run(example, result["mlflow_run_id"], mlflow_server, tmp_path, env, overrides)


@pytest.mark.full
def test_simulate_calibrates_here_and_refuses_bad_input(tmp_path):
    """No Ray: the model and a loopback link are timed here; a table for every mode, a plot."""
    example = os.path.join(REPO, "examples", "mnist_allreduce.yaml")
    cmd = [sys.executable, "-m", "orchestrator", "simulate", example, "--replicas", "1,2,4,64,1024",
           "--straggler-p", "0.01", "--straggler-factor", "3", "--cores", "here", "--json", str(tmp_path / "sim.json")]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "simulate.png").read_bytes()[:8] == PNG_MAGIC
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln.split()[:1] in (["allreduce"], ["easgd"])]
    assert [r[1] for r in rows if r[0] == "allreduce"] == ["1", "2", "4", "64", "1024"]
    cal = json.loads((tmp_path / "sim.json").read_text())["calibration"]
    assert cal["params"] > 10_000 and cal["compute_s"] > 0 and cal["beta_s_per_byte"] > 0
    assert "loopback" in cal["source"] and "processes at once" in cal["source"]
    assert 1 <= cal["cores"] <= (os.cpu_count() or 1)  # this host's effective cores, measured
    for flag, value in (("--replicas", "0,2"), ("--cores", "many")):
        bad = subprocess.run(cmd[:4] + [flag, value], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONPATH=REPO))
        assert bad.returncode == 2 and flag in bad.stderr


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def simulates_from_run(example: str, run_id: str, tracking_uri: str, tmp_path, env: dict, overrides: list[str]) -> None:
    """`simulate --from-run`: the cost model calibrated from the run's own figures gives a table
    for every mode, a JSON naming the run and a plot."""
    sim = [sys.executable, "-m", "orchestrator", "simulate", example, "--from-run", run_id,
           "--tracking-uri", tracking_uri, "--replicas", "1,2,4,64,1024", "--plot", str(tmp_path / "sim.png"),
           "--json", str(tmp_path / "sim.json")] + [a for o in overrides for a in ("--set", o)]
    proc = subprocess.run(sim, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    predicted = json.loads((tmp_path / "sim.json").read_text())
    assert f"run {run_id}" in predicted["calibration"]["source"]
    at = {(p["mode"], p["replicas"]): p for p in predicted["predictions"]}
    assert {("allreduce", 1024), ("downpour", 64), ("easgd", 2), ("local_sgd", 4), ("single", 1)} <= set(at)
    assert (tmp_path / "sim.png").read_bytes()[:8] == PNG_MAGIC and "allreduce" in proc.stdout


def accuracy_of_logged_model(tracking_uri: str, run_id: str, dataset, batch_size: int, tmp_path) -> float:
    """`runs:/<run_id>/model` loaded with mlflow.pytorch.load_model, scored on the whole test
    split in batches of batch_size (as the replicas evaluate)."""
    import mlflow
    import mlflow.pytorch
    import torch

    mlflow.set_tracking_uri(tracking_uri)
    try:
        model = mlflow.pytorch.load_model(f"runs:/{run_id}/model", dst_path=str(tmp_path / "model"))
    finally:
        mlflow.set_tracking_uri(None)  # back to the test's MLFLOW_TRACKING_URI
    model.eval()
    x, y = torch.from_numpy(dataset.test.x), torch.from_numpy(dataset.test.y)
    correct = 0
    with torch.inference_mode():
        for lo in range(0, len(y), batch_size):
            correct += int((model(x[lo : lo + batch_size]).argmax(1) == y[lo : lo + batch_size]).sum())
    return correct / len(y)


def test_ray_job_submit_main_example_reaches_97(main_example_job, mlflow_server, tmp_path):
    """The CLI inside a job joins the job's cluster and tracks to the server. Also: the run's
    model loads with mlflow.pytorch.load_model and scores the run's final test accuracy on the
    test split; it is registered as tracking.register_as; training.png is in the run and next
    to the result JSON; the progress lines are plain (the job's output is no terminal); the
    cost model calibrates from the run's own figures."""
    proc, result, folder = main_example_job
    assert "succeeded" in proc.stdout
    assert REQUIRED <= set(result) and result["final"]["test_accuracy"] >= 0.97
    assert result["time_to_target_s"] is not None and result["replicas"] == 2
    ours = [ln for ln in proc.stdout.splitlines() if ln.startswith("epoch ")]  # Ray's own lines are coloured
    assert ours and ours[0].startswith("epoch 1: test_accuracy") and not any("\x1b[" in ln for ln in ours), ours
    run_id = result["mlflow_run_id"]
    assert os.path.exists(f"{folder}/ck/{run_id}/model.pt")
    client = MlflowClient(mlflow_server)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mode"] == "allreduce"
    history = client.get_metric_history(run_id, "test_accuracy")
    assert max(m.value for m in history) >= 0.97
    assert {"starting", "running", "finishing"} <= set(result["state_s"]) and sum(result["state_s"].values()) <= result["wall_s"]
    assert run.data.metrics["state_s.running"] == pytest.approx(result["state_s"]["running"])

    from orchestrator.config import JobConfig
    from orchestrator.data.loading import load_dataset

    cfg = JobConfig.from_yaml(MAIN_EXAMPLE, [])
    accuracy = accuracy_of_logged_model(mlflow_server, run_id, load_dataset(cfg.data), cfg.data.batch_size, tmp_path)
    assert abs(accuracy - result["final"]["test_accuracy"]) <= 1e-6, (accuracy, result["final"])
    [version] = client.search_model_versions("name = 'e2e-main'")
    assert version.run_id == run_id
    assert "training.png" in [a.path for a in client.list_artifacts(run_id)]
    png = client.download_artifacts(run_id, "training.png", str(tmp_path / "dl"))
    assert open(png, "rb").read(8) == PNG_MAGIC
    assert (folder / "training.png").read_bytes()[:8] == PNG_MAGIC  # next to result.json

    sim_env = dict(os.environ, PYTHONPATH=REPO)
    sim_env.pop("MLFLOW_TRACKING_URI", None)
    simulates_from_run(MAIN_EXAMPLE, run_id, mlflow_server, tmp_path, sim_env, [])


def job_get(ray_head, path: str) -> dict:
    req = urllib.request.Request(f"{ray_head.dashboard_url}/api/jobs/{path}",
                                 headers={"Authorization": f"Bearer {ray_head.env['RAY_AUTH_TOKEN']}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_ray_job_submit_of_bad_input_fails_with_exit_code_2(ray_head, tmp_path):
    """The job (its code shipped through a runtime_env) ends FAILED with the driver's exit code
    2; its log is the one plain line naming the field."""
    job_id = f"eo-bad-input-{uuid.uuid4().hex[:8]}"
    runtime_env = json.dumps({"env_vars": {"PYTHONPATH": REPO}})
    proc = submit(ray_head, [sys.executable, "-m", "orchestrator", "run",
                             os.path.join(REPO, "examples", "mnist_allreduce.yaml"), "--set", "optimizer.lr=0",
                             "--set", f"checkpoint.storage={tmp_path}/ck"],
                  timeout_s=180, options=("--submission-id", job_id, "--runtime-env-json", runtime_env))
    line = "orchestrator: config error: optimizer.lr: Input should be greater than 0 (got 0)"
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]  # ray job submit: 1 when the job failed
    assert f"Job '{job_id}' failed" in proc.stdout and "failed with exit code 2" in proc.stdout, proc.stdout[-3000:]
    info = job_get(ray_head, job_id)
    assert info["status"] == "FAILED" and info["driver_exit_code"] == 2, info
    logs = job_get(ray_head, f"{job_id}/logs")["logs"]
    driver = logs.split(f"Running entrypoint for job {job_id}", 1)[1].splitlines()[1:]  # Ray's own lines before
    assert [x for x in driver if x.strip()] == [line] and "\x1b[" not in logs, logs
    assert not (tmp_path / "ck").exists()


def test_sigterm_marks_the_run_killed_and_keeps_a_checkpoint(ray_head, tmp_path):
    """`ray job stop` and schedulers send SIGTERM: the run ends, KILLED in MLflow, state saved."""
    import signal

    store = f"sqlite:///{tmp_path}/mlflow.db"
    env = dict(ray_head.env, RAY_ADDRESS=ray_head.address, PYTHONPATH=REPO)
    cmd = [sys.executable, "-m", "orchestrator", "run", os.path.join(REPO, "examples", "mnist_allreduce.yaml"),
           "--set", "model.factory=examples.models:tiny_mlp", "--set", "data.source=builtin:synthetic",
           "--set", "stop.epochs=1000", "--set", "stop.target_accuracy=null", "--set", "data.batch_size=8",
           "--set", f"tracking.tracking_uri={store}", "--set", f"checkpoint.storage={tmp_path}/ck",
           "--set", "checkpoint.every_epochs=2", "--set", "checkpoint.keep=100"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("epoch 3:"):
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "KILLED" in err
    client = MlflowClient(store)
    run = client.search_runs([client.get_experiment_by_name("mnist-allreduce").experiment_id])[0]
    assert run.info.status == "KILLED"
    ck = tmp_path / "ck" / run.info.run_id
    assert (ck / "interrupted.pt").exists()
    [epoch2] = ck.glob("ckpt-*-epoch_0002.pt")
    assert (ck / f"{epoch2.name}.json").exists()  # its sidecar: length and sha256
    from orchestrator.persistence.checkpoint import CheckpointStore

    path, state = CheckpointStore(str(tmp_path / "ck"), run.info.run_id, keep=100).latest_good()
    assert path.endswith("-interrupted.pt") and state["mlflow_run_id"] == run.info.run_id
    events = client.download_artifacts(run.info.run_id, "events.jsonl", str(tmp_path))
    assert '"status": "KILLED"' in open(events).read()
