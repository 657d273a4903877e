"""A sweep through the Python API on the session's Ray cluster with the ASHA scheduler, over a task
of the user's own (examples/tasks.py) ranked by its own metric on a validation split
(val_top2_accuracy, data.val_fraction): a trial that trails at the first rung is stopped, its
child run marked KILLED with tag sweep.stopped_early, and its actors and placement group are
gone; the trial that ends by its own stop condition finishes its run, and its row holds the test
split's figures too."""
from __future__ import annotations

import threading
import time

import pytest
import yaml
from mlflow.tracking import MlflowClient

from orchestrator.sweep import SweepConfig, run_sweep

pytestmark = pytest.mark.ray


@pytest.mark.full
def test_asha_stops_the_trailing_trial_and_marks_its_run(ray_cluster, tmp_path, monkeypatch):
    import ray

    monkeypatch.chdir(tmp_path)  # the sqlite store's artifacts go to ./mlruns of the process that creates the experiment

    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({
        "model": {"factory": "examples.models:tiny_mlp"},
        "data": {"source": "builtin:synthetic", "batch_size": 32, "val_fraction": 0.2},
        "task": {"name": "examples.tasks:margin_task"},  # a task of the user's own, ranked by its own metric
        "scaling": {"replicas": 1, "cpus_per_replica": 1}, "stop": {"epochs": 3}, "fault_tolerance": {"spares": 1},
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"},
        "checkpoint": {"storage": str(tmp_path / "ck")}}))
    # one trial at a time, in grid order: the good rate sets the bar at epoch 1, the tiny one trails it
    sweep = SweepConfig(base=str(base), search={"optimizer.lr": {"grid": [0.1, 1e-6]}}, max_concurrent_trials=1,
                        metric="val_top2_accuracy",
                        scheduler="asha", asha={"grace_period": 1, "reduction_factor": 2}, experiment="asha")
    seen: dict[str, set] = {}  # actor class -> the placement groups its live actors were in
    done = threading.Event()

    def watch() -> None:
        from ray.util.state import list_actors

        while not done.is_set():
            try:
                for actor in list_actors(filters=[("state", "=", "ALIVE")], detail=True, timeout=5):
                    seen.setdefault(actor.class_name, set()).add(actor.placement_group_id)
            except Exception:  # the state API can time out on a busy machine; look again
                pass
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = run_sweep(sweep, show_progress=False)
    finally:
        done.set()
        watcher.join(10)

    rows = {r["params"]["optimizer.lr"]: r for r in result.rows}
    assert rows[0.1]["status"] == "finished" and rows[0.1]["epochs"] == 3
    assert rows[1e-6]["status"] == "stopped_early" and rows[1e-6]["epochs"] == 1
    assert result.best_params == {"optimizer.lr": 0.1} and result.best_run_id == rows[0.1]["run_id"]
    assert result.goal == "max" and result.best_value == rows[0.1]["metric"] == rows[0.1]["final"]["val_top2_accuracy"]
    assert 0 <= rows[0.1]["final"]["test_top2_accuracy"] <= 1  # the test split, evaluated once at the end

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    good, stopped = client.get_run(rows[0.1]["run_id"]), client.get_run(rows[1e-6]["run_id"])
    assert good.info.status == "FINISHED" and "sweep.stopped_early" not in good.data.tags
    assert stopped.info.status == "KILLED" and stopped.data.tags["sweep.stopped_early"] == "true"
    assert len(client.get_metric_history(stopped.info.run_id, "val_top2_accuracy")) == 1
    assert not client.get_metric_history(stopped.info.run_id, "test_top2_accuracy")  # stopped: never tested
    for run in (good, stopped):
        assert run.data.tags["mlflow.parentRunId"] == result.parent_run_id
    assert client.get_run(result.parent_run_id).info.status == "FINISHED"

    # every replica a trial started (and its spare, which reserves no CPU) was in that trial's placement
    # group, the one Tune started the trial in (the partition server goes beside the trial's driver)
    ours = ("ModelReplica", "PartitionServer", "ParameterShard")
    trial_groups = set().union(*(g for name, g in seen.items() if name not in ours)) - {None}  # Tune's trial actors
    assert "ModelReplica" in seen and "PartitionServer" in seen, seen
    assert None not in seen["ModelReplica"] and seen["ModelReplica"] <= trial_groups and len(trial_groups) == 2, seen

    # the stopped trial's replica, partition server and placement group are gone: every CPU is free again
    total = ray.cluster_resources()["CPU"]
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < total and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) == total


@pytest.mark.empty_tmp  # it checks that nothing was written to tmp_path
def test_a_trial_bigger_than_the_cluster_is_bad_input(ray_cluster, tmp_path, monkeypatch):
    """Tune would wait forever for a placement group the cluster cannot hold: exit 2 before any run."""
    from orchestrator.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({
        "model": {"factory": "examples.models:tiny_mlp"}, "data": {"source": "builtin:synthetic"},
        "scaling": {"replicas": 5, "cpus_per_replica": 1},
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"}, "checkpoint": {"storage": str(tmp_path / "ck")}}))
    sweep = SweepConfig(base=str(base), search={"optimizer.lr": {"grid": [0.1, 0.01]}})
    with pytest.raises(ConfigError, match="one trial needs 5 CPU .* the cluster has 4"):
        run_sweep(sweep, show_progress=False)
    assert not (tmp_path / "mlflow.db").exists()  # no parent run was opened
