"""downpour and easgd on real Ray actors: shards, stragglers, staleness bounds, sync barrier,
a replica killed under a staleness bound, buffers carried with the reference model."""
from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest
import ray

from orchestrator.persistence.checkpoint import load_checkpoint
from orchestrator.testing.chaos import Fault, FaultInjector
from orchestrator.control.controller import Controller
from orchestrator.data.in_memory import load_source
from orchestrator.reporting.tracking import Tracker
from orchestrator.trainer import ElasticTrainer
from policies.decisions.leases import MAX_GRANT
from tests.conftest import job_config

pytestmark = pytest.mark.ray


def fit(tmp_path, **sections):
    sections.setdefault("checkpoint", {"storage": str(tmp_path / "ck")})
    sections.setdefault("scaling", {"replicas": 2, "cpus_per_replica": 0.5, "shards": 2})
    return ElasticTrainer(job_config(**sections), show_progress=False).fit()


def epoch_events(result):
    return [e for e in result.events if e["kind"] == "epoch_end"]


STRAGGLER = {"slow_replicas": {1: 0.05}}  # replica 1 sleeps 50 ms a step: several times a fast step with its shard calls


@pytest.mark.parametrize("strategy", [
    {"mode": "downpour", "n_fetch": 2, "n_push": 2},
    pytest.param({"mode": "easgd", "tau": 2}, marks=pytest.mark.full),
    pytest.param({"mode": "easgd", "tau": 2, "variant": "sync"}, marks=pytest.mark.full),
])
def test_sharded_modes_learn_and_report_their_metrics_with_a_straggler(ray_cluster, tmp_path, strategy):
    """Replica 1 is a straggler. The asynchronous modes do not wait for it: the fast replica goes
    on leasing the partitions the straggler did not get to (more steps), every row still trained
    once; synchronous EASGD keeps them in lock step."""
    sync = strategy.get("variant") == "sync"  # in lock step whatever the delay: a light one keeps the test short
    result = fit(tmp_path, strategy=strategy, stop={"epochs": 2}, data={"batch_size": 16, "partitions": 16},
                 optimizer={"lr": 0.05, "momentum": 0.0}, faults={"slow_replicas": {1: 0.01}} if sync else STRAGGLER)
    assert result.mode == strategy["mode"] and result.final.test_accuracy > 0.9
    last = epoch_events(result)[-1]
    if strategy["mode"] == "downpour":
        assert last["pushes_per_s"] > 0 and last["staleness_max"] >= 1  # two replicas interleave
    else:
        assert last["exchanges_per_s"] > 0
    assert result.rows_per_epoch[0] == result.samples // 2  # every row, each epoch
    for event in epoch_events(result):
        fast, slow = event["steps_by_rank"]
        assert fast == slow if sync else fast > slow, (fast, slow)


def controller(cfg):
    dataset = load_source(cfg.data.source, cfg.data.seed)
    return Controller(cfg, dataset, Tracker(None, "tests", None), time.perf_counter())


def flat_state(model_state, names):
    return np.concatenate([model_state[n].reshape(-1).numpy() for n in names])


@pytest.mark.full
def test_sync_easgd_reports_the_elastic_distance_it_has(ray_cluster):
    """elastic_distance = mean over replicas of ||x_i - c|| at the end of the epoch, measured
    here from the replicas' parameters and the shards' center."""
    cfg = job_config(strategy={"mode": "easgd", "variant": "sync", "tau": 3}, stop={"epochs": 1},
                     data={"batch_size": 16, "partitions": 5}, optimizer={"momentum": 0.0},
                     scaling={"replicas": 2, "cpus_per_replica": 0.5, "shards": 2})
    ctl = controller(cfg)
    try:
        ctl.run_epoch()
        center = np.concatenate(ray.get([s.values.remote() for s in ctl.shards], timeout=30))
        xs = ray.get([r.flat_parameters.remote() for r in ctl.replicas], timeout=30)
        assert ctl.tracker.flush()  # metrics are written by a background thread
    finally:
        ctl.shutdown()
    from mlflow.tracking import MlflowClient

    reported = MlflowClient().get_metric_history(ctl.tracker.run_id, "elastic_distance")[0].value
    measured = np.mean([np.linalg.norm(x - center) for x in xs])
    assert measured > 0
    assert reported == pytest.approx(measured, rel=1e-4)


@pytest.mark.full
def test_sync_easgd_with_uneven_partitions_finishes_in_lock_step(ray_cluster, tmp_path):
    """5 partitions for 2 replicas: one replica holds more batches; it used to wait at a round
    the other never reached until strategy.timeout_s."""
    result = fit(tmp_path, strategy={"mode": "easgd", "variant": "sync", "tau": 4, "timeout_s": 20},
                 data={"batch_size": 16, "partitions": 5}, stop={"epochs": 2}, optimizer={"momentum": 0.0})
    for event in epoch_events(result):
        assert event["steps_by_rank"][0] == event["steps_by_rank"][1]
    n_train = len(ElasticTrainer(job_config()).check().train)
    assert result.rows_per_epoch == [n_train, n_train] and result.final.test_accuracy > 0.9


@pytest.mark.full
def test_easgd_honours_the_local_optimizer(ray_cluster, tmp_path):
    result = fit(tmp_path, strategy={"mode": "easgd", "tau": 2, "momentum": 0.0}, stop={"epochs": 1},
                 optimizer={"name": "adam", "lr": 0.01})
    state = load_checkpoint(result.checkpoint)["optimizer"]
    assert "exp_avg" in next(iter(state["state"].values()))  # Adam's moments, not SGD's
    assert result.final.test_accuracy > 0.9


SLOW = {"slow_replicas": {1: 0.02}}  # replica 1 sleeps 20 ms per step
SMALL_PARTS = {"batch_size": 16, "partitions": 16}


def test_max_staleness_bounds_how_far_the_fast_replica_runs_ahead(ray_cluster, tmp_path):
    result = fit(tmp_path, strategy={"mode": "downpour", "max_staleness": 3}, faults=SLOW, stop={"epochs": 1},
                 data=SMALL_PARTS)
    event = epoch_events(result)[0]
    fast, slow = event["steps_by_rank"]
    # seen by the shard at each push: a replica starts a step only while <= 3 steps ahead, so it
    # completes at most 4 ahead (unbounded, the fast replica leads by tens of steps)
    assert 1 <= event["max_lead"] <= 4
    # held to the straggler's pace while both have work (at most 4 steps ahead when the straggler
    # finds the queue empty); alone only for the partitions it holds then: the one it trains and
    # the grant (at most MAX_GRANT) it asked for on starting it
    [started] = [e for e in result.events if e["kind"] == "started"]
    alone = (1 + MAX_GRANT) * -(-started["rows_per_partition"][1] // SMALL_PARTS["batch_size"])
    assert fast - slow <= 4 + alone, (fast, slow, alone)


@pytest.mark.full
def test_max_staleness_survives_a_killed_replica(ray_cluster, tmp_path):
    """The survivors stop waiting for a dead replica's clock as soon as its death is seen."""
    cfg = job_config(strategy={"mode": "downpour", "max_staleness": 3, "timeout_s": 20}, stop={"epochs": 2},
                     data={"batch_size": 8}, faults={"slow_replicas": {0: 0.002, 1: 0.002, 2: 0.002}},
                     tracking={"log_every_steps": 5, "progress_interval_s": 0}, optimizer={"momentum": 0.0},
                     scaling={"replicas": 3, "cpus_per_replica": 0.5, "shards": 2},
                     checkpoint={"storage": str(tmp_path / "ck")})
    trainer = ElasticTrainer(cfg, show_progress=False)
    with FaultInjector(lambda: trainer.controller, [Fault("kill_replica", 2, at_step=40)]) as kill:
        result = trainer.fit()
    assert kill.fired and result.epochs == 2
    assert any(e["kind"] == "replica_replaced" and e["ranks"] == [2] for e in result.events)
    assert result.final.test_accuracy > 0.9
    # no survivor sat out strategy.timeout_s: only the killed replica failed, and not as hung
    assert [(e["rank"], e["cause"]) for e in result.events if e["kind"] == "replica_failed"] == [(2, "died")]


BN = {"factory": "examples.models:mlp_bn", "kwargs": {"in_features": 32, "num_classes": 4}}


@pytest.mark.parametrize("strategy", [pytest.param({"mode": "allreduce"}, marks=pytest.mark.full),
                                      pytest.param({"mode": "downpour"}, marks=pytest.mark.full),
                                      pytest.param({"mode": "easgd", "tau": 2}, marks=pytest.mark.full)])
def test_batchnorm_buffers_are_consistent_in_every_mode(ray_cluster, tmp_path, strategy):
    """allreduce (with a straggler, in lock step): every replica holds (and the checkpoint saves) rank 0's running statistics.
    downpour / easgd: the reference model carries the replicas' statistics averaged, and the
    checkpoint's parameters are the shards' (the server copy / the center, across both shards),
    not a replica's own (easgd: they stay apart from the center)."""
    sharded = strategy["mode"] != "allreduce"
    cfg = job_config(model=BN, strategy=strategy, stop={"epochs": 2}, optimizer={"momentum": 0.0},
                     scaling={"replicas": 2, "cpus_per_replica": 0.5, "shards": 2},
                     faults={} if sharded else STRAGGLER,  # allreduce: lock step with a straggler
                     checkpoint={"storage": str(tmp_path / "ck")})
    ctl = controller(cfg)
    try:
        ctl.run_epoch()
        ctl.run_epoch()
        local = ray.get([r.local_buffers.remote() for r in ctl.replicas], timeout=30)
        saved = load_checkpoint(ctl.checkpoint("bn", 30).path)["model"]
        if sharded:
            shards = np.concatenate(ray.get([s.values.remote() for s in ctl.shards], timeout=30))
            own = ray.get(ctl.replicas[0].flat_parameters.remote(), timeout=30)
    finally:
        ctl.shutdown()
    if sharded:
        np.testing.assert_array_equal(flat_state(saved, [n for n in saved if n.endswith(("weight", "bias"))]), shards)
        if strategy["mode"] == "easgd":  # a replica's own parameters stay apart from the center
            assert not np.array_equal(own, shards)
    names = [n for n in local[0] if "running" in n]
    assert names
    for n in names:
        if sharded:
            assert not np.allclose(local[0][n], local[1][n])  # each replica saw its own batches
            np.testing.assert_allclose(saved[n].numpy(), (local[0][n] + local[1][n]) / 2, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(local[0][n], local[1][n])
            np.testing.assert_array_equal(saved[n].numpy(), local[0][n])
    assert ctl.totals.metrics["test_accuracy"] > 0.9  # evaluated with consistent statistics
    if not sharded:  # every step taken together, the straggler's too
        ends = [e for e in ctl.tracker.events if e["kind"] == "epoch_end"]
        assert len(ends) == 2 and all(e["steps_by_rank"][0] == e["steps_by_rank"][1] for e in ends), ends


@pytest.mark.full  # make test resumes runs in allreduce (the recipe's) and from a killed driver (tests/e2e)
def test_a_resumed_downpour_run_gives_the_shards_back_their_server_optimizer_state(ray_cluster, tmp_path):
    """The shards' momentum is part of the checkpoint: a run resumed from epoch 1's checkpoint
    has, before it trains again, the server-optimizer state the shards had then."""
    import torch

    from orchestrator.persistence.checkpoint import CheckpointStore

    sections = dict(strategy={"mode": "downpour", "n_fetch": 2, "n_push": 2}, data={"batch_size": 16},
                    optimizer={"lr": 0.05, "momentum": 0.9}, checkpoint={"storage": str(tmp_path / "ck")},
                    scaling={"replicas": 2, "cpus_per_replica": 0.5, "shards": 2}, run={"name": "ps"})
    first = ElasticTrainer(job_config(**sections, stop={"epochs": 2}), show_progress=False).fit()
    store = CheckpointStore(str(tmp_path / "ck"), "ps", keep=10)
    [entry] = [e for e in store.list() if e.tag == "epoch_0001"]
    state, _ = store.verify(entry)
    kept = state["run"]["shards"]
    assert len(kept) == 2 and all(s["state"] for s in kept)  # momentum buffers, one per shard

    seen = {}

    class AtResume:
        def on_event(self, event):
            if event["kind"] == "resumed":
                seen["event"] = event
                seen["shards"] = trainer.controller.shard_group.optimizer_states()

    sections.pop("run")
    trainer = ElasticTrainer(job_config(**sections, stop={"epochs": 2}), show_progress=False, resume=state,
                             callbacks=[AtResume()])
    result = trainer.fit()
    assert "parts_missing" not in seen["event"] and seen["event"]["epoch"] == 1
    for got, want in zip(seen["shards"], kept):
        for key, buf in want["state"].items():
            assert torch.equal(got["state"][key]["momentum_buffer"], buf["momentum_buffer"])
    assert result.mlflow_run_id == first.mlflow_run_id and result.epochs == 2


@pytest.mark.full
def test_simulate_times_the_shards_exchanges_on_real_shards_and_removes_them(ray_cluster):
    """`simulate --shard-path here`: the mode's exchanges with scaling.shards real shards give the
    shards' path (an exchange costs more than the latency alone); the shards are gone after. In
    easgd, whose elastic exchange is the one that differs from a plain push and pull."""
    mode = "easgd"
    from orchestrator.cli.calibration import calibrate_shard_path, calibration
    from tests.integration.test_shutdown_ray import alive_run_actors, wait_gone

    cfg = job_config(strategy={"mode": mode, "timeout_s": 30}, scaling={"replicas": 2, "shards": 2})
    before = alive_run_actors()
    measured, exchange_s = calibrate_shard_path(cfg, 250_000, rounds=5)
    assert measured == mode and math.isfinite(exchange_s) and exchange_s > 0  # measured; its size is a benchmark's
    cal = calibration(cfg, latency_us=10, shard_path="here")
    assert cal.shard_beta_s_per_byte > 0 and f"{mode}'s exchanges with 2 real shards here" in cal.source
    assert ray.is_initialized()  # the session's Ray was used, not stopped
    wait_gone(lambda: alive_run_actors() - before, "calibration shards")


@pytest.mark.full  # ~25 s: the stopped shard is waited for 10 s
def test_a_checkpoint_written_while_a_shard_is_stopped_says_what_it_lacks(ray_cluster, tmp_path, monkeypatch):
    """A shard SIGSTOPped while the epoch-1 checkpoint asks the shards for their optimizer states:
    the checkpoint is written without that part and says why (its event and its run position),
    instead of a part silently empty that a resume would take as "nothing to restore"; the shard
    is let go on and the run finishes with a whole final checkpoint."""
    import signal

    from orchestrator.testing.chaos import kill_process
    from orchestrator.fleet.shard_group import ShardGroup

    original, stopped = ShardGroup.optimizer_states, {}

    def optimizer_states(self, timeout_s=30.0):
        if stopped:
            return original(self, timeout_s)
        stopped["pid"] = kill_process(self._slots[0].handle, signal.SIGSTOP)
        try:
            return original(self, timeout_s)
        finally:
            os.kill(stopped["pid"], signal.SIGCONT)

    monkeypatch.setattr(ShardGroup, "optimizer_states", optimizer_states)
    result = fit(tmp_path, strategy={"mode": "downpour"}, scaling={"replicas": 2, "cpus_per_replica": 0.5, "shards": 1},
                 stop={"epochs": 2})
    checkpoints = [e for e in result.events if e["kind"] == "checkpoint"]
    first, last = checkpoints[0], checkpoints[-1]
    assert stopped and first["epoch"] == 1 and "shard 0 hung" in first["unsaved_parts"]["shards"], first
    run = load_checkpoint(first["path"])["run"]
    assert "shards" not in run and "shard 0 hung" in run["unsaved_parts"]["shards"]
    assert "unsaved_parts" not in last and len(load_checkpoint(last["path"])["run"]["shards"]) == 1
    assert result.epochs == 2


@pytest.mark.full  # ~40 s
def test_a_replica_killed_while_a_shard_is_stopped_is_repaired_and_the_shard_rebuilt(ray_cluster, tmp_path):
    """Two faults at once in downpour: shard 0 SIGSTOPped, then replica 1 SIGKILLed. Telling the
    shards to forget the dead replica meets the stopped shard's silence: that is a value (the
    shard is left to the health check, which rebuilds it), not an error that ends the run. The
    stopped shard is found by its unanswered pings and rebuilt from its snapshot, the replicas
    replaying into it; no replica is taken for hung, and an update lost has a cause (the dead
    replica's pushes in flight)."""
    cfg = job_config(strategy={"mode": "downpour", "timeout_s": 30}, stop={"epochs": 2}, data={"batch_size": 8},
                     scaling={"replicas": 2, "cpus_per_replica": 0.5, "shards": 2},
                     tracking={"progress_interval_s": 0, "log_every_steps": 1},
                     fault_tolerance={"hang_timeout_s": 6}, checkpoint={"storage": str(tmp_path / "ck")})
    trainer = ElasticTrainer(cfg, show_progress=False)
    faults = [Fault("hang_shard", 0, at_step=20), Fault("kill_replica", 1, at_step=20)]
    with FaultInjector(lambda: trainer.controller, faults) as inj:
        result = trainer.fit()
    assert [f["kind"] for f in inj.fired] == ["hang_shard", "kill_replica"]
    kinds = [e["kind"] for e in result.events]
    assert "replica_replaced" in kinds and "shard_rebuilt" in kinds, kinds
    failed = [e for e in result.events if e["kind"] == "replica_failed"]
    assert [(e["rank"], e["cause"]) for e in failed] == [(1, "died")], failed  # the events, when another was failed
    rebuilt = [e for e in result.events if e["kind"] == "shard_rebuilt"]
    assert rebuilt[0]["shard"] == 0 and "no answer" in rebuilt[0]["detected_by"], rebuilt
    assert all(e.get("lost_updates", 0) == 0 or e.get("lost_causes") for e in rebuilt), rebuilt
    assert result.epochs == 2 and math.isfinite(result.final.test_loss)
