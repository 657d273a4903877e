"""downpour and easgd on real Ray actors: shards, stragglers, staleness bounds, sync barrier."""
from __future__ import annotations

import pytest

from orchestrator.trainer import ElasticTrainer
from tests.conftest import job_config

pytestmark = pytest.mark.ray


def fit(tmp_path, **sections):
    sections.setdefault("checkpoint", {"storage": str(tmp_path / "ck")})
    sections.setdefault("scaling", {"replicas": 2, "cpus_per_replica": 0.5, "shards": 2})
    return ElasticTrainer(job_config(**sections), show_progress=False).fit()


def epoch_events(result):
    return [e for e in result.events if e["kind"] == "epoch_end"]


@pytest.mark.parametrize("strategy", [
    {"mode": "downpour", "n_fetch": 2, "n_push": 2},
    {"mode": "easgd", "tau": 2},
    {"mode": "easgd", "tau": 2, "variant": "sync"},
])
def test_sharded_modes_learn_and_report_their_metrics(ray_cluster, tmp_path, strategy):
    result = fit(tmp_path, strategy=strategy, stop={"epochs": 2}, data={"batch_size": 16},
                 optimizer={"lr": 0.05, "momentum": 0.0})
    assert result.mode == strategy["mode"] and result.final.test_accuracy > 0.9
    last = epoch_events(result)[-1]
    if strategy["mode"] == "downpour":
        assert last["pushes_per_s"] > 0 and last["staleness_max"] >= 1  # two replicas interleave
    else:
        assert last["elastic_distance"] > 0 and last["exchanges_per_s"] > 0
    from orchestrator.checkpoint import load_checkpoint

    assert set(load_checkpoint(result.checkpoint)["model"])  # the reference model was saved


SLOW = {"slow_replicas": {1: 0.02}}  # replica 1 sleeps 20 ms per step
SMALL_PARTS = {"batch_size": 16, "partitions": 16}


@pytest.mark.parametrize("strategy", [{"mode": "downpour"}, {"mode": "easgd", "tau": 4}])
def test_a_straggler_does_not_hold_back_the_fast_replica(ray_cluster, tmp_path, strategy):
    result = fit(tmp_path, strategy=strategy, faults=SLOW, stop={"epochs": 1}, data=SMALL_PARTS)
    fast, slow = epoch_events(result)[0]["steps_by_rank"]
    assert fast > 2 * slow, (fast, slow)  # no lock-step: the fast replica leases more partitions


def test_allreduce_is_lock_step_with_a_straggler(ray_cluster, tmp_path):
    result = fit(tmp_path, strategy={"mode": "allreduce"}, faults=SLOW, stop={"epochs": 1}, data=SMALL_PARTS,
                 scaling={"replicas": 2, "cpus_per_replica": 0.5})
    event = epoch_events(result)[0]
    fast, slow = event["train_s_by_rank"]
    assert event["steps_by_rank"][0] == event["steps_by_rank"][1]
    assert fast > 0.8 * slow, (fast, slow)


def test_max_staleness_bounds_how_far_the_fast_replica_runs_ahead(ray_cluster, tmp_path):
    result = fit(tmp_path, strategy={"mode": "downpour", "max_staleness": 3}, faults=SLOW, stop={"epochs": 1},
                 data=SMALL_PARTS)
    event = epoch_events(result)[0]
    fast, slow = event["steps_by_rank"]
    assert event["max_lead"] <= 3
    # held to the straggler's pace while both have work; alone only for the epoch's last partitions
    assert fast < 1.6 * slow, (fast, slow)
