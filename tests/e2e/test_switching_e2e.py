"""End to end: examples/mnist_phases.yaml through the CLI against the session's Ray head, tracked
to a real `mlflow server`: downpour (2 epochs) -> allreduce (until 96%) -> easgd reaches 97%,
switching where configured and losing no accuracy at a switch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import REPO

pytestmark = pytest.mark.e2e

# The consolidation is exact: the reference model right after a switch holds the parameters it
# held right before, evaluated on the same test rows, so the two accuracies are equal (they were
# in every run measured: 3 runs of examples/mnist_phases.yaml, 2 switches each). The accuracy at
# the first epoch end after a switch may fall below the one right before it by at most the
# run-to-run spread of the accuracy at one epoch: measured over those 3 runs, at most 0.015 at
# every epoch from the 4th on (0.036 at epoch 3, 0.156 at epoch 2, inside the downpour phase).
AT_SWITCH = 0.0
NEXT_EPOCH = 0.015


@pytest.mark.full  # make test switches modes in tests/integration/test_switching_ray.py and test_tasks_ray.py
def test_phases_example_switches_where_configured_and_reaches_97(ray_head, mlflow_server, tmp_path):
    out = tmp_path / "result.json"
    env = dict(ray_head.env, RAY_ADDRESS=ray_head.address, PYTHONPATH=REPO)
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "orchestrator", "run", os.path.join(REPO, "examples", "mnist_phases.yaml"),
           "--set", f"tracking.tracking_uri={mlflow_server}", "--set", "tracking.experiment=e2e-phases",
           "--set", f"checkpoint.storage={tmp_path}/ck", "--result-json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "phases" and result["time_to_target_s"] is not None  # 97% reached

    switches = [e for e in result["events"] if e["kind"] == "mode_switch"]
    assert [(s["from"], s["to"], s["rule"]) for s in switches] == [
        ("downpour", "allreduce", "until epochs"), ("allreduce", "easgd", "until test_accuracy")]
    phases = result["phases"]
    assert [p["mode"] for p in phases] == ["downpour", "allreduce", "easgd"]
    assert phases[1]["start_epoch"] == 3  # after exactly 2 epochs of downpour
    assert phases[1]["test_accuracy_at_end"] >= 0.96  # allreduce ran until 96%
    ends = {e["epoch"]: e["test_accuracy"] for e in result["events"] if e["kind"] == "epoch_end"}
    for s, p in zip(switches, phases[1:]):
        assert s["test_accuracy_after"] >= s["test_accuracy_before"] - AT_SWITCH
        assert ends[p["start_epoch"]] >= s["test_accuracy_before"] - NEXT_EPOCH
        assert s["switch_s"] > 0  # how long is the switching benchmark's to say

    run = MlflowClient(mlflow_server).get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["modes"] == "downpour -> allreduce -> easgd"
    history = MlflowClient(mlflow_server).get_metric_history(run.info.run_id, "mode")
    codes = [m.value for m in sorted(history, key=lambda m: (m.step, m.timestamp))]
    assert codes[0] == 1 and 0 in codes and codes[-1] == 2  # downpour, then allreduce, then easgd
