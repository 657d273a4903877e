"""End to end: a named run (`run CONFIG --name NAME`) whose driver is SIGKILLed after epoch 2 is
started again with the same command: it goes on from its newest checkpoint in the same MLflow run
(on a real `mlflow server`), its step counter continues, it reaches the target, and its trajectory
is the one an uncrashed run of the same config takes. Starting it a third time, or `resume RUN_ID`,
is refused: the run finished. The uncrashed reference is the session's `ray job submit` of the same
example (tests/e2e/conftest.py).

The run keeps its checkpoints in memory too (`checkpoint.in_memory`), and the epoch-2 checkpoint
is taken out of storage after the kill (as if the driver had died before storing it): the run
started again goes on from the keeper's copy of it, and once the run finished the keeper is gone.
(Going on from storage: tests/e2e/test_mid_epoch_resume_e2e.py, tests/integration/test_hogwild_ray.py.)"""
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

from orchestrator.persistence.memory_copy import directory_key, keeper_name
from tests.conftest import REPO

pytestmark = pytest.mark.e2e
EXAMPLE = os.path.join(REPO, "examples", "mnist_allreduce.yaml")


KEEPER = """
import sys, ray
from actors.checkpoints.keeper import NAMESPACE
ray.init()
try:
    ray.get_actor(sys.argv[1], namespace=NAMESPACE)
    print("still there")
except ValueError:
    print("gone")
"""


def by_step(client, run_id, metric):
    return {m.step: m.value for m in client.get_metric_history(run_id, metric)}


def test_a_killed_named_run_goes_on_when_the_same_command_runs_again(ray_head, mlflow_server, main_example_job, tmp_path):
    # the tracking store comes from the environment and checkpoints go to the example's
    # runs/checkpoints under the working directory: the command is the example and --name only
    env = dict(ray_head.env, RAY_ADDRESS=ray_head.address, PYTHONPATH=REPO, MLFLOW_TRACKING_URI=mlflow_server)
    client = MlflowClient(mlflow_server)

    def command(name, *extra):
        return [sys.executable, "-m", "orchestrator", "run", EXAMPLE, "--name", name, "--no-progress",
                "--set", "checkpoint.in_memory=true", *extra]

    driver = subprocess.Popen(command("nightly"), cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    second = f"{tmp_path}/runs/checkpoints/nightly/ckpt-*-epoch_0002.pt.json"
    try:
        deadline = time.monotonic() + 300
        while not glob.glob(second) and time.monotonic() < deadline:
            assert driver.poll() is None, driver.stdout.read()[-3000:]
            time.sleep(0.05)
        assert glob.glob(second), "no epoch-2 checkpoint in time"
        os.kill(driver.pid, signal.SIGKILL)  # the driver dies at once: no handler, no final record
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    [held] = glob.glob(second)  # the epoch-2 checkpoint: held in memory, and now no longer in storage
    for path in (held, held.removesuffix(".json")):
        os.remove(path)
    keeper = keeper_name(directory_key(f"{tmp_path}/runs/checkpoints/nightly"))

    def keeper_is():
        look = subprocess.run([sys.executable, "-c", KEEPER, keeper], env=env, capture_output=True, text=True,
                              timeout=120)
        assert look.returncode == 0, look.stdout + look.stderr[-2000:]
        return look.stdout.strip().splitlines()[-1]

    assert keeper_is() == "still there"  # the killed driver's keeper outlives it
    experiment = client.get_experiment_by_name("mnist-allreduce").experiment_id  # shared with other e2e tests

    def runs_named(name):
        return client.search_runs([experiment], filter_string=f"tags.`mlflow.runName` = '{name}'")

    [killed] = runs_named("nightly")
    run_id = killed.info.run_id
    assert killed.info.status == "RUNNING" and killed.info.run_name == "nightly"  # killed: nobody ended it
    before = client.get_metric_history(run_id, "test_accuracy")

    out = tmp_path / "result.json"
    proc = subprocess.run(command("nightly", "--result-json", str(out)), cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [said] = [line for line in proc.stdout.splitlines() if line.startswith("run nightly: resuming")]
    assert f"MLflow run {run_id} from memory:ckpt-" in said, said  # the epoch-2 checkpoint (or a newer one)
    result = json.loads(out.read_text())
    assert result["mlflow_run_id"] == run_id  # the same run, not a second one
    assert result["final"]["test_accuracy"] >= 0.97 and result["stop_reason"].startswith("target")
    [resumed] = [e for e in result["events"] if e["kind"] == "resumed"]
    ends = [e for e in result["events"] if e["kind"] == "epoch_end" and e["t_wall"] > resumed["t_wall"]]
    assert resumed["epoch"] >= 2 and ends[0]["epoch"] == resumed["epoch"] + 1  # not epoch 1, storage's newest
    assert resumed["from_memory"] in said
    assert f"after epoch {resumed['epoch']})" in said
    assert resumed["step"] in {m.step for m in before}  # the step of the checkpoint's epoch end, as logged
    assert ends[0]["step"] > resumed["step"]  # the step counter continues
    assert client.get_run(run_id).info.status == "FINISHED"
    assert len(runs_named("nightly")) == 1  # no second run was opened

    # the finished run's keeper is gone; a finished run is not trained again, by name or by run id
    assert keeper_is() == "gone"
    again = subprocess.run(command("nightly"), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "run nightly already finished" in again.stderr, again.stderr[-2000:]
    by_id = subprocess.run([sys.executable, "-m", "orchestrator", "resume", run_id], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert by_id.returncode == 2 and "already finished" in by_id.stderr, by_id.stderr[-2000:]

    # the uncrashed run of the same config (the session's `ray job submit` of it) takes the same
    # path, epoch by epoch
    _, uncrashed, _ = main_example_job
    for metric in ("test_accuracy", "train_loss"):
        assert by_step(client, run_id, metric) == pytest.approx(by_step(client, uncrashed["mlflow_run_id"], metric),
                                                                rel=1e-4), metric


@pytest.mark.full  # ~1.5 min: two jobs on the session's head
def test_a_stopped_job_resubmitted_from_an_edited_directory_goes_on_in_the_same_run(ray_head, tmp_path):
    """`ray job submit --working-dir DIR -- ... run job.yaml --name N`, `ray job stop` after its
    first epoch, one file of DIR edited (Ray's package for it gets another hash), the same submit
    again: the second job goes on from the first one's checkpoint in the same MLflow run, because
    the default relative `checkpoint.storage` and MLflow's default store were put under
    $ORCHESTRATOR_HOME instead of the first job's temporary package directory. (Before, the
    second job said "no checkpoint yet, starting it".) The stopped job left its record: the MLflow
    run KILLED with every event so far in events.jsonl, the job STOPPED."""
    from tests.e2e.conftest import submit

    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    (work / "job.yaml").write_text(
        "model: {factory: examples.models:mnist_cnn}\n"
        "data: {source: 'builtin:mnist5k', batch_size: 64}\n"
        "optimizer: {lr: 0.05, momentum: 0.9}\n"
        "scaling: {replicas: 2, cpus_per_replica: 1}\n"
        "stop: {epochs: 4}\n"
        "faults: {slow_replicas: {0: 0.05, 1: 0.05}}\n"  # ~3 s an epoch: time to stop it after the first
        "tracking: {experiment: job-storage}\n")
    (work / "notes.txt").write_text("first\n")
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    env = dict(ray_head.env)
    env.pop("MLFLOW_TRACKING_URI", None)
    options = ("--working-dir", str(work), "--runtime-env-json", json.dumps({"env_vars": {"ORCHESTRATOR_HOME": str(home)}}))
    entry = [sys.executable, "-m", "orchestrator", "run", "job.yaml", "--name", "nightly", "--no-progress"]

    def job(*args, timeout_s=60):
        return subprocess.run([ray_bin, "job", *args, "--address", ray_head.dashboard_url], env=env,
                              capture_output=True, text=True, timeout=timeout_s)

    first = submit(ray_head, entry, options=("--no-wait", "--submission-id", "storage-1", *options))
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    written = f"{home}/runs/checkpoints/nightly/ckpt-*-epoch_0001.pt.json"  # the first epoch's checkpoint
    deadline = time.monotonic() + 300
    while not glob.glob(written) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert glob.glob(written), job("logs", "storage-1").stdout[-3000:]
    stop = job("stop", "storage-1", timeout_s=120)  # waits until the job has exited
    assert "was stopped" in stop.stdout + stop.stderr, (stop.stdout + stop.stderr)[-2000:]
    logs = job("logs", "storage-1").stdout
    assert f"checkpoints go to {home}/runs/checkpoints" in logs and f"sqlite:///{home}/mlflow.db" in logs, logs[-3000:]
    assert "done:" not in logs, logs[-3000:]  # stopped before its end
    from mlflow.tracking import MlflowClient

    # `ray job stop` (SIGTERM, SIGKILL ~3 s later): the MLflow run keeps its record, KILLED, and
    # events.jsonl with every event so far and one `ended`
    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    [experiment] = [e for e in client.search_experiments() if e.name == "job-storage"]
    [stopped] = client.search_runs([experiment.experiment_id])
    assert stopped.info.status == "KILLED", stopped.info
    with open(client.download_artifacts(stopped.info.run_id, "events.jsonl", str(tmp_path / "dl"))) as f:
        kinds = [json.loads(line) for line in f if line.strip()]
    assert kinds[0]["kind"] == "started" and "epoch_end" in [e["kind"] for e in kinds], kinds
    assert [e["status"] for e in kinds if e["kind"] == "ended"] == ["KILLED"], kinds  # (the interrupt's checkpoint may follow it)
    status = job("status", "storage-1")
    assert "storage-1' was stopped" in status.stdout + status.stderr, (status.stdout + status.stderr)[-2000:]

    (work / "notes.txt").write_text("edited\n")  # another package hash: another temporary directory
    second = submit(ray_head, entry, options=("--submission-id", "storage-2", *options))
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert "run nightly: resuming MLflow run" in out and "no checkpoint yet" not in out, out[-3000:]
    assert "done: epochs: 4 >= stop.epochs (4)" in out, out[-3000:]
    [run] = client.search_runs([experiment.experiment_id])  # one MLflow run across the two jobs
    assert run.info.status == "FINISHED" and run.info.run_id in out, out[-2000:]
