"""allreduce on real Ray actors and a real gloo process group."""
from __future__ import annotations

import time

import numpy as np
import pytest
import ray
import torch
import torch.nn.functional as F

from orchestrator.control.controller import Controller
from orchestrator.control.states import Running
from orchestrator.data.in_memory import load_source
from orchestrator.errors import TrainingError
from orchestrator.models import build_model
from orchestrator.reporting.tracking import Tracker
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


def _epochs(cfg, epochs, trace_ids=True):
    """(the controller, the data set, every replica's flat parameters) after `epochs` epochs;
    the controller is shut down."""
    ctl, dataset = _controller(cfg, trace_ids=trace_ids)
    try:
        ctl.step()
        for _ in range(epochs):
            ctl.run_epoch()
        flats = ray.get([r.flat_parameters.remote() for r in ctl.replicas], timeout=30)
    finally:
        ctl.shutdown()
    return ctl, dataset, flats


@pytest.mark.parametrize("replicas", [2, pytest.param(3, marks=pytest.mark.full)])
def test_parameters_identical_and_equal_to_single_process_reference(ray_cluster, replicas):
    cfg = job_config(scaling={"replicas": replicas, "cpus_per_replica": 0.5}, data={"batch_size": 16},
                     optimizer={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4})
    ctl, dataset = _controller(cfg)
    try:
        assert isinstance(ctl.step(), Running)  # actors up, process group formed, data loaded
        ctl.run_epoch()  # one epoch of synchronous steps
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
    n_steps = len(consumed[0])
    assert all(len(c) == n_steps for c in consumed.values()) and n_steps > 5  # lock-step
    for step in range(n_steps):  # each step: the mean gradient over the union of the replicas' rows
        idx = [row[i] for rank in range(replicas) for i in consumed[rank][step]]
        x, y = torch.from_numpy(dataset.train.x[idx]), torch.from_numpy(dataset.train.y[idx])
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    ref = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    np.testing.assert_allclose(flats[0], ref, rtol=1e-4, atol=1e-5)
    # every row of the train split exactly once in the epoch (short last batches, nothing dropped)
    seen = [i for steps in consumed.values() for step in steps for i in step]
    assert sorted(seen) == sorted(int(i) for i in dataset.train.ids)


def test_fit_uses_the_callers_cluster_and_tracks_everything(ray_cluster, tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = job_config(checkpoint={"storage": str(tmp_path / "ck")}, stop={"epochs": 3, "target_accuracy": 0.99,
                                                                        "at_target": False})
    result = ElasticTrainer(cfg, show_progress=False).fit()
    assert ray.is_initialized()  # the caller's cluster is left running
    assert result.mode == "allreduce" and result.replicas == 2 and result.epochs == 3
    assert result.final.test_accuracy > 0.9
    n_train = len(ElasticTrainer(cfg).check().train)
    assert result.samples == 3 * n_train and result.rows_per_epoch == [n_train] * 3
    kinds = [e["kind"] for e in result.events]
    assert kinds[0] == "started" and kinds.count("epoch_end") == 3 and "checkpoint" in kinds

    client = MlflowClient()
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["optimizer.lr"] == "0.05" and run.data.params["strategy.mode"] == "allreduce"
    assert run.data.tags["mode"] == "allreduce" and run.data.tags["replicas"] == "2"
    assert run.data.tags["ray_version"] == ray.__version__
    assert len(client.get_metric_history(result.mlflow_run_id, "test_accuracy")) == 3
    assert [m.value for m in client.get_metric_history(result.mlflow_run_id, "epoch_rows")] == [n_train] * 3
    # a row every 10 steps, none lost though sent at most once a second (tracking.progress_interval_s)
    steps = [e["steps_by_rank"][0] for e in result.events if e["kind"] == "epoch_end"]
    assert len(client.get_metric_history(result.mlflow_run_id, "train_loss")) == sum(n // 10 for n in steps) >= 3
    artifacts = {a.path for a in client.list_artifacts(result.mlflow_run_id)}
    assert {"config.yaml", "result.json", "events.jsonl", "model.pt"} <= artifacts

    from orchestrator.persistence.checkpoint import load_checkpoint

    state = load_checkpoint(result.checkpoint)
    assert state["epoch"] == 3 and state["mlflow_run_id"] == result.mlflow_run_id


def test_a_non_finite_loss_ends_the_run_naming_the_step_and_the_learning_rate(ray_cluster, tmp_path):
    cfg = job_config(optimizer={"lr": 1e12, "momentum": 0.0}, stop={"epochs": 3},
                     checkpoint={"storage": str(tmp_path / "ck"), "every_epochs": 1})
    with pytest.raises(TrainingError, match=r"diverged: the loss is (nan|inf) at step \d+ .*optimizer.lr 1e\+?12"):
        ElasticTrainer(cfg, show_progress=False).fit()
    assert not list((tmp_path / "ck").rglob("model.pt"))  # no final model written from a diverged run


@pytest.mark.parametrize("compression", [pytest.param("fp16", marks=pytest.mark.full), "powersgd"])
def test_compressed_allreduce_keeps_the_replicas_identical_and_learns(ray_cluster, compression):
    """strategy.compression over a real gloo group: every replica applies the same step (the
    maths against a one-process reference: tests/unit/test_balance.py, test_powersgd.py)."""
    cfg = job_config(scaling={"replicas": 2, "cpus_per_replica": 0.5}, data={"batch_size": 16},
                     strategy={"compression": compression, "powersgd_rank": 1}, stop={"epochs": 2})
    ctl, _, flats = _epochs(cfg, 2, trace_ids=False)
    np.testing.assert_array_equal(flats[0], flats[1])
    ends = [e for e in ctl.tracker.events if e["kind"] == "epoch_end"]
    assert ends[-1]["test_accuracy"] > 0.8


def test_backup_replicas_apply_the_first_gradient_and_drop_the_stragglers(ray_cluster):
    """strategy.backup_replicas 1 over a real gloo group and its TCP store: rank 1 takes 0.5 s
    more a step (faults.slow_replicas), so each step applies rank 0's batch alone while rank 0
    has one (rank 1's then only after rank 0's ran out): the one-process reference on exactly
    those batches, replicas identical, rank 1's other rows dropped and counted in the metric
    and the event, and every row still read once."""
    cfg = job_config(scaling={"replicas": 2, "cpus_per_replica": 0.5}, data={"batch_size": 16},
                     optimizer={"lr": 0.05, "momentum": 0.9}, strategy={"backup_replicas": 1},
                     faults={"slow_replicas": [{"rank": 1, "delay_s": 0.5}]})
    ctl, dataset, flats = _epochs(cfg, 1)
    np.testing.assert_array_equal(flats[0], flats[1])
    consumed = ctl.consumed[0]
    row = {int(i): k for k, i in enumerate(dataset.train.ids)}
    model = build_model(cfg.model.factory, cfg.model.kwargs, cfg.data.seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dropped = 0
    for mine, theirs in zip(consumed[0], consumed[1]):
        applied = mine or theirs  # rank 0's batch is always first; rank 1's counts once rank 0 has none
        dropped += len(theirs) if mine else 0
        idx = [row[i] for i in applied]
        model.zero_grad()
        F.cross_entropy(model(torch.from_numpy(dataset.train.x[idx])), torch.from_numpy(dataset.train.y[idx])).backward()
        opt.step()
    ref = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    np.testing.assert_allclose(flats[0], ref, rtol=1e-4, atol=1e-5)
    assert dropped > 0
    events = ctl.tracker.events
    drops = [e for e in events if e["kind"] == "backup_drops"]
    assert len(drops) == 1 and drops[0]["dropped_rows"] == dropped and set(drops[0]["dropped_rows_by_rank"]) == {1}
    end = next(e for e in events if e["kind"] == "epoch_end")
    assert end["backup_dropped_rows"] == dropped and end["rows"] + dropped == len(dataset.train.ids)
    seen = [i for steps in consumed.values() for step in steps for i in step]
    assert sorted(seen) == sorted(int(i) for i in dataset.train.ids)
