"""allreduce on real Ray actors and a real gloo process group."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import ray
import torch
import torch.nn.functional as F

from orchestrator.controller import Controller, State
from orchestrator.data import load_source
from orchestrator.errors import TrainingError
from orchestrator.factory import build_model
from orchestrator.tracking import Tracker
from orchestrator.trainer import ElasticTrainer
from tests.conftest import job_config

pytestmark = pytest.mark.ray


class StepWatch:
    """Stands in for the progress display: records the steps the controller hears about."""

    def __init__(self):
        self.step = 0

    def steps(self, epoch, step_in_epoch, loss, total):
        self.step = max(self.step, step_in_epoch)

    def line(self, text):
        pass


def _controller(cfg, trace_ids=True, display=None):
    dataset = load_source(cfg.data.source, cfg.data.seed)
    tracker = Tracker(None, "tests", None)
    return Controller(cfg, dataset, tracker, time.perf_counter(), display=display, trace_ids=trace_ids), dataset


@pytest.mark.parametrize("replicas", [2, 3])
def test_parameters_identical_and_equal_to_single_process_reference(ray_cluster, replicas):
    cfg = job_config(scaling={"replicas": replicas, "cpus_per_replica": 0.5}, data={"batch_size": 16},
                     optimizer={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4})
    ctl, dataset = _controller(cfg)
    try:
        assert ctl.step() is State.RUNNING  # actors up, process group formed, data loaded
        ctl.step()  # one epoch of synchronous steps
        flats = ray.get([r.flat_parameters.remote() for r in ctl.replicas], timeout=30)
    finally:
        ctl.shutdown()
    for f in flats[1:]:
        assert np.array_equal(f, flats[0]), "replicas diverged"

    # Reference: one process, same init, applies the mean gradient of the same batches.
    row = {int(i): k for k, i in enumerate(dataset.train.ids)}
    model = build_model(cfg.model.factory, cfg.model.kwargs, cfg.data.seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    consumed = ctl.consumed[0]  # {rank: [step] -> ids}
    assert all(len(c) == ctl.steps_per_epoch for c in consumed.values()) and ctl.steps_per_epoch > 5
    for step in range(ctl.steps_per_epoch):
        grads = []
        for rank in range(replicas):
            idx = [row[i] for i in consumed[rank][step]]
            x, y = torch.from_numpy(dataset.train.x[idx]), torch.from_numpy(dataset.train.y[idx])
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / replicas
        opt.step()
    ref = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    np.testing.assert_allclose(flats[0], ref, rtol=1e-4, atol=1e-5)
    # every replica read only its own rows, and no row twice in the epoch
    seen = [i for steps in consumed.values() for step in steps for i in step]
    assert len(seen) == len(set(seen))


def test_fit_uses_the_callers_cluster_and_tracks_everything(ray_cluster, tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = job_config(checkpoint={"storage": str(tmp_path / "ck")}, stop={"epochs": 3, "target_accuracy": 0.99,
                                                                        "at_target": False})
    result = ElasticTrainer(cfg, show_progress=False).fit()
    assert ray.is_initialized()  # the caller's cluster is left running
    assert result.mode == "allreduce" and result.replicas == 2 and result.epochs == 3
    assert result.final.test_accuracy > 0.9
    assert result.samples == result.steps * 32 * 2
    kinds = [e["kind"] for e in result.events]
    assert kinds[0] == "started" and kinds.count("epoch_end") == 3 and "checkpoint" in kinds

    client = MlflowClient()
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["optimizer.lr"] == "0.05" and run.data.params["strategy.mode"] == "allreduce"
    assert run.data.tags["mode"] == "allreduce" and run.data.tags["replicas"] == "2"
    assert run.data.tags["ray_version"] == ray.__version__
    assert len(client.get_metric_history(result.mlflow_run_id, "test_accuracy")) == 3
    assert len(client.get_metric_history(result.mlflow_run_id, "train_loss")) >= 3
    artifacts = {a.path for a in client.list_artifacts(result.mlflow_run_id)}
    assert {"config.yaml", "result.json", "events.jsonl", "model.pt"} <= artifacts

    from orchestrator.checkpoint import load_checkpoint

    state = load_checkpoint(result.checkpoint)
    assert state["epoch"] == 3 and state["mlflow_run_id"] == result.mlflow_run_id


def test_a_killed_replica_surfaces_in_seconds(ray_cluster):
    cfg = job_config(data={"batch_size": 1}, stop={"epochs": 50}, strategy={"timeout_s": 60},
                     tracking={"log_every_steps": 5},
                     scaling={"replicas": 2, "cpus_per_replica": 0.5})
    watch = StepWatch()
    ctl, _ = _controller(cfg, trace_ids=False, display=watch)
    killed_at = []

    def kill_when_training():
        while watch.step < 20:
            time.sleep(0.05)
        killed_at.append(time.perf_counter())
        ray.kill(ctl.replicas[1], no_restart=True)

    try:
        ctl.step()
        killer = threading.Thread(target=kill_when_training)
        killer.start()
        with pytest.raises(TrainingError, match="died|closed|replica"):
            while ctl.step() is State.RUNNING:
                pass
        killer.join(timeout=30)
        noticed = time.perf_counter() - killed_at[0]
    finally:
        ctl.shutdown()
    assert ctl.state is State.ERRORED
    assert noticed < cfg.strategy.timeout_s  # found by the death, not by the stall timeout
