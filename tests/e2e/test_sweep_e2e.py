"""End to end: `orchestrator sweep` on the session's Ray head (4 CPUs) with Ray Tune, tracking to a
real `mlflow server`: one parent run, a child run per trial, the comparison table and the plot on
the parent; trials that do not fit in the cluster together run in turn (two trials of 3 CPUs each
on 4 CPUs: one at a time)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def most_at_once(intervals: list[tuple[int, int]]) -> int:
    """The largest number of [start, end) intervals that hold at one moment."""
    return max(sum(1 for s, e in intervals if s <= t < e) for t, _ in intervals)


def test_sweep_nested_runs_table_plot_and_trials_in_turn(ray_head, mlflow_server, tmp_path):
    # 2 trials x (2 replicas x 1.5 CPU) on 4 CPUs with no concurrency limit: one fits at a time
    sweep = {
        "base": os.path.join(REPO, "examples", "mnist_allreduce.yaml"),
        "set": {"model.factory": "examples.models:tiny_mlp", "data.source": "builtin:synthetic", "stop.epochs": 2, "stop.target_accuracy": 0.9, "stop.at_target": False, "data.partitions": 4, "scaling.cpus_per_replica": 1.5,
                "tracking.tracking_uri": mlflow_server, "checkpoint.storage": str(tmp_path / "ck")},
        "search": {"strategy.mode": {"grid": ["allreduce", "easgd"]}, "optimizer.lr": {"loguniform": [0.02, 0.1]}},
        "num_samples": 1,
        "metric": "test_accuracy",
        "goal": "max",
        "max_concurrent_trials": 4,
        "experiment": "e2e-sweep",
        "storage": str(tmp_path / "tune"),
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    env = dict(ray_head.env, RAY_ADDRESS=ray_head.address, PYTHONPATH=REPO)
    env.pop("MLFLOW_TRACKING_URI", None)
    out = tmp_path / "sweep.json"
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "sweep", str(path), "--json", str(out),
                           "--no-progress"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())

    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("e2e-sweep")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 2
    parent = parents[0]
    assert parent.info.run_id == result["parent_run_id"] and parent.info.status == "FINISHED"
    assert all(c.data.tags["mlflow.parentRunId"] == parent.info.run_id for c in children)

    modes = []
    for child in children:
        assert child.info.status == "FINISHED"
        sampled = json.loads(child.data.tags["sweep.params"])
        assert child.data.params["strategy.mode"] == sampled["strategy.mode"]
        assert float(child.data.params["optimizer.lr"]) == pytest.approx(sampled["optimizer.lr"])
        assert 0.02 <= sampled["optimizer.lr"] <= 0.1
        assert child.data.params["stop.epochs"] == "2"
        history = client.get_metric_history(child.info.run_id, "test_accuracy")
        assert len(history) == 2 and history[-1].value > 0.5
        modes.append(sampled["strategy.mode"])
    assert sorted(modes) == ["allreduce", "easgd"]

    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"comparison.csv", "comparison.md", "metric_vs_time.png", "sweep.yaml"} <= artifacts
    table = client.download_artifacts(parent.info.run_id, "comparison.csv", str(tmp_path))
    lines = open(table).read().strip().splitlines()
    assert lines[0].startswith("trial,status,mode,params,metric,time_to_target_s,final,samples_per_s")
    assert len(lines) == 3 and all(",finished," in line for line in lines[1:])
    png = client.download_artifacts(parent.info.run_id, "metric_vs_time.png", str(tmp_path))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"

    ids = {c.info.run_id for c in children}
    assert result["best_run_id"] in ids and len(result["rows"]) == 2
    assert result["best_value"] == max(r["final"]["test_accuracy"] for r in result["rows"])
    assert all(r["metric"] == r["final"]["test_accuracy"] for r in result["rows"])
    assert f"MLflow run {result['best_run_id']}" in proc.stdout and "best: test_accuracy" in proc.stdout

    # each trial reserves 3 of the 4 CPUs: the second waited for the first to end
    intervals = [(c.info.start_time, c.info.end_time) for c in children]
    assert most_at_once(intervals) == 1, intervals
