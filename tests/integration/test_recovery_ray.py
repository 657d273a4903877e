"""Per-replica recovery on real Ray actors and real gloo groups: a killed, hung or raising
replica is replaced and the survivors keep their processes (small synthetic jobs; the mnist5k
chaos runs per mode are in tests/e2e/test_chaos_e2e.py)."""
from __future__ import annotations

import signal

import numpy as np
import pytest
import ray

from orchestrator.testing.chaos import Fault, FaultInjector
from orchestrator.errors import TrainingError
from orchestrator.trainer import ElasticTrainer
from tests.conftest import assert_carried, job_config

pytestmark = pytest.mark.ray


def events(result, kind):
    return [e for e in result.events if e["kind"] == kind]


def actor_ids(ctl):
    """rank -> Ray actor id of each member: which actors a recovery kept and which it replaced."""
    return {r: a._actor_id.hex() for r, a in ctl.group.members.items()}


def fit_with(cfg, faults):
    trainer = ElasticTrainer(cfg, show_progress=False)
    ids = {}

    def controller():
        ctl = trainer.controller
        if ctl is not None and ctl.group.pids and not ids:
            ids.update(actor_ids(ctl))
        return ctl

    with FaultInjector(controller, faults) as inj:
        result = trainer.fit()
    return result, inj, ids, trainer


def test_a_middle_rank_killed_in_allreduce_is_replaced_from_a_spare_the_survivors_kept_and_identical(ray_cluster):
    """3 replicas, rank 1 (a peer on either side of the ring) SIGKILLed, one spare. The dead rank's
    ring neighbours fail at once; the others leave through the generation's abort flag, not the
    collective timeout (fault_tolerance.hang_timeout_s, 60 s here): the one failure is the
    killed rank's death. The spare takes its place, copying a survivor; the survivors keep their
    actors, every replica is identical after, and the epoch of the kill serves every partition.
    The spare started in its place reports itself ready once, with what its start cost."""
    from orchestrator.control.controller import Controller
    import time

    from orchestrator.data.in_memory import load_source
    from orchestrator.reporting.tracking import Tracker

    cfg = job_config(scaling={"replicas": 3, "cpus_per_replica": 0.5}, stop={"epochs": 2}, data={"batch_size": 8},
                     tracking={"progress_interval_s": 0, "log_every_steps": 1}, fault_tolerance={"spares": 1})
    ctl = Controller(cfg, load_source(cfg.data.source, cfg.data.seed), Tracker(None, "tests", None), time.perf_counter())
    try:
        ctl.step()
        before = actor_ids(ctl)
        with FaultInjector(ctl, [Fault("kill_replica", 1, at_step=20)]) as inj:
            ctl.run_epoch()
        after = actor_ids(ctl)
        flats = ray.get([r.flat_parameters.remote() for r in ctl.replicas], timeout=30)
        status = ray.get(ctl.server.handle.status.remote(), timeout=30)
        pool, ready = ctl.group.spare_pool, [e for e in ctl.tracker.events if e["kind"] == "spare_ready"]
        deadline = time.monotonic() + 60
        while pool.warming and time.monotonic() < deadline:  # the new spare may still be starting
            ready += pool.ready()
            time.sleep(0.2)
        warming_left = pool.warming
    finally:
        ctl.shutdown()
    assert inj.fired
    assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]
    for f in flats[1:]:
        np.testing.assert_array_equal(f, flats[0])  # the replacement copied a survivor; all stepped alike since
    assert status.complete  # every partition served in the epoch of the kill
    # nobody waited out the collective timeout: the only failure is the killed rank's death
    assert [(e["rank"], e["cause"]) for e in ctl.tracker.events if e["kind"] == "replica_failed"] == [(1, "died")]
    [replaced] = [e for e in ctl.tracker.events if e["kind"] == "replica_replaced"]
    assert replaced["ranks"] == [1] and replaced["survivors_kept"] == [0, 2] and replaced["how"] == {"1": "spare"}
    # lock-step: the failed step, plus at most the one step a survivor whose all-reduce completed
    # before the death applied and the donor did not (docs/fault-tolerance.md); one regroup
    assert replaced["steps_lost"] in (1, 2) and replaced["generation"] == 2
    assert_carried(replaced, "membership", "passes", "ledger", "state", "regroup", "data", "lr", "reopen")
    # the replacement spare became ready (the first may have been taken before it was); its start's
    # CPU seconds cover its process's imports (torch's alone take more than 0.5 s)
    assert warming_left == 0 and 1 <= len(ready) <= 2
    assert all(r["cpu_s"] > 0.5 and r["ready_s"] >= r["rehearsal_s"] > 0 for r in ready)


@pytest.mark.full  # ~45 s: the backoff itself is 8 s
def test_one_kill_with_a_long_backoff_is_one_failure_not_a_cascade_of_hangs(ray_cluster, tmp_path):
    """downpour, 3 replicas, no spares, hang_timeout_s 5 and restart_backoff_s 8 (the replacement
    waits 8 s, longer than the hang timeout, while the survivors go on training): the one SIGKILL
    is the one failure. The survivors' progress waiting unread while the driver repaired is no
    hang, and neither is a stream the driver read later than another."""
    cfg = job_config(strategy={"mode": "downpour", "timeout_s": 30}, scaling={"replicas": 3, "cpus_per_replica": 0.5},
                     stop={"epochs": 3}, data={"batch_size": 8}, tracking={"progress_interval_s": 0, "log_every_steps": 1},
                     fault_tolerance={"hang_timeout_s": 5, "restart_backoff_s": 8},
                     checkpoint={"storage": str(tmp_path / "ck")})
    result, inj, ids, _ = fit_with(cfg, [Fault("kill_replica", 1, at_step=30)])
    assert inj.fired and result.epochs == 3
    assert [(f["rank"], f["cause"]) for f in events(result, "replica_failed")] == [(1, "died")]
    [replaced] = events(result, "replica_replaced")
    assert replaced["ranks"] == [1] and replaced["survivors_kept"] == [0, 2]


def test_a_hung_replica_is_killed_and_replaced(ray_cluster, tmp_path):
    cfg = job_config(scaling={"replicas": 2, "cpus_per_replica": 0.5}, stop={"epochs": 2}, data={"batch_size": 8},
                     tracking={"progress_interval_s": 0, "log_every_steps": 1}, fault_tolerance={"hang_timeout_s": 3},
                     checkpoint={"storage": str(tmp_path / "ck")})
    result, inj, ids, _ = fit_with(cfg, [Fault("hang_replica", 1, at_step=30)])
    assert inj.fired and result.epochs == 2
    failed = events(result, "replica_failed")  # a loaded machine may see another pause past 3 s too
    assert failed[0]["cause"] == "hung" and failed[0]["rank"] == 1
    assert events(result, "replica_replaced")[0]["ranks"] == [1]


@pytest.mark.full
def test_a_replica_stopped_at_an_epochs_end_is_hung_after_the_hang_timeout_not_the_calls(ray_cluster, tmp_path,
                                                                                         monkeypatch):
    """easgd evaluates the center on every replica at each epoch's end, one call to all: a replica
    SIGSTOPped just before that call is found hung fault_tolerance.hang_timeout_s after its peer
    answered (3 s here), not after strategy.timeout_s (120 s), and replaced; the run goes on."""
    from orchestrator.testing.chaos import kill_process
    from orchestrator.fleet.replica_group import ReplicaGroup

    original, stopped = ReplicaGroup.call, {}

    def call(self, ranks, method, *args, **kwargs):
        if method == "evaluate_reference" and len(ranks) > 1 and not stopped:
            stopped["rank"] = ranks[-1]
            stopped["pid"] = kill_process(self.members[ranks[-1]], signal.SIGSTOP)
        return original(self, ranks, method, *args, **kwargs)

    monkeypatch.setattr(ReplicaGroup, "call", call)
    cfg = job_config(strategy={"mode": "easgd", "tau": 4, "timeout_s": 120},
                     scaling={"replicas": 2, "cpus_per_replica": 0.5, "shards": 1}, stop={"epochs": 2},
                     data={"batch_size": 8}, tracking={"progress_interval_s": 0, "log_every_steps": 1},
                     fault_tolerance={"hang_timeout_s": 3}, checkpoint={"storage": str(tmp_path / "ck")})
    result = ElasticTrainer(cfg, show_progress=False).fit()
    failed = events(result, "replica_failed")
    assert stopped and failed[0]["rank"] == stopped["rank"] and failed[0]["cause"] == "hung", failed
    # found by the hang_timeout_s rule after its peer answered, not by the call's own timeout
    # (strategy.timeout_s, whose detail says "no answer within 120s")
    assert "after the others answered" in failed[0]["detail"], failed
    assert "no answer within" not in failed[0]["detail"], failed
    assert events(result, "replica_replaced")[0]["ranks"] == [stopped["rank"]]
    assert result.epochs == 2 and np.isfinite(result.final.test_loss)


@pytest.mark.full
def test_a_second_loss_inside_a_repair_keeps_the_replacement_the_first_try_made(ray_cluster, tmp_path, monkeypatch):
    """allreduce, 3 replicas: replica 2 is SIGKILLed; as the repair re-forms the process group
    with its replacement, replica 0 (the group's head) is SIGKILLed too. The repair is carried out
    again with both: the replacement for replica 2, alive and a member, is kept (the same actor
    to the end) and only replica 0 gets a new one (before, the retry killed the replacement it
    had made and started another)."""
    import time

    from orchestrator.fleet.replica_group import ReplicaGroup
    from orchestrator.testing.chaos import kill_process

    original, seen = ReplicaGroup.form, {"ids_of_2": []}

    def form(self):
        if self.generation >= 1 and "killed" not in seen:  # the first re-forming: the repair's
            seen["killed"] = kill_process(self.members[0])
            time.sleep(1.0)  # gone before the rendezvous asks it
        if "killed" in seen:
            seen["ids_of_2"].append(self.members[2]._actor_id.hex())
        return original(self)

    monkeypatch.setattr(ReplicaGroup, "form", form)
    cfg = job_config(scaling={"replicas": 3, "cpus_per_replica": 0.5}, stop={"epochs": 2}, data={"batch_size": 8},
                     tracking={"progress_interval_s": 0, "log_every_steps": 1},
                     checkpoint={"storage": str(tmp_path / "ck")})
    result, _, _, _ = fit_with(cfg, [Fault("kill_replica", 2, at_step=20)])
    failed = events(result, "replica_failed")
    assert "killed" in seen and [(e["rank"], e.get("during")) for e in failed] == [(2, None), (0, "repair")], failed
    assert len(seen["ids_of_2"]) >= 2 and len(set(seen["ids_of_2"])) == 1, seen  # one replacement, kept
    [replaced] = events(result, "replica_replaced")
    assert sorted(replaced["ranks"]) == [0, 2], replaced
    assert result.epochs == 2 and np.isfinite(result.final.test_loss)


def test_a_user_error_is_replaced_once_and_reported_with_its_traceback(ray_cluster, tmp_path):
    marker = tmp_path / "raised-once"
    model = {"factory": "examples.models:failing_mlp", "kwargs": {"fail_after_calls": 25, "once_marker": str(marker)}}
    cfg = job_config(model=model, stop={"epochs": 2}, scaling={"replicas": 2, "cpus_per_replica": 0.5},
                     data={"batch_size": 8}, checkpoint={"storage": str(tmp_path / "ck")})
    result, _, _, _ = fit_with(cfg, [])
    [failed] = events(result, "replica_failed")
    assert failed["cause"] == "error" and "injected failure in forward" in failed["detail"]
    assert "line" in failed["traceback"] and "in forward" in failed["traceback"]  # the replica's traceback
    assert events(result, "replica_replaced") and result.epochs == 2
    # the driver's seconds by state: the repair is a state of its own, and the states add up to
    # no more than the run's wall time
    assert set(result.state_s) == {"starting", "running", "repair", "finishing"}, result.state_s
    assert all(s > 0 for s in result.state_s.values()) and sum(result.state_s.values()) <= result.wall_s


@pytest.mark.full  # make test: a user error replaced (above); its judging, tests/unit/test_settle.py
@pytest.mark.parametrize("mode", ["downpour", "allreduce", "easgd"])
def test_a_user_error_in_the_epoch_s_evaluation_is_judged_by_the_failure_policy(ray_cluster, tmp_path, mode):
    """A replica's evaluation raising once (an out-of-memory there) is a failure of that replica
    like one in its training step: replaced, the run goes on, and no epoch logs a nan loss. (In
    the sharded modes the evaluation is a call to every member, not a stream item.)"""
    marker = tmp_path / "raised-once"
    model = {"factory": "examples.models:failing_mlp",
             "kwargs": {"fail_after_calls": 40, "once_marker": str(marker), "in_eval": True}}
    cfg = job_config(model=model, stop={"epochs": 2}, scaling={"replicas": 2, "cpus_per_replica": 0.5},
                     data={"batch_size": 8}, strategy={"mode": mode}, checkpoint={"storage": str(tmp_path / "ck")})
    result = ElasticTrainer(cfg, show_progress=False).fit()
    assert marker.exists()  # a replica's evaluation raised
    [failed] = events(result, "replica_failed")
    assert failed["cause"] == "error" and "injected failure in forward" in failed["detail"], failed
    assert events(result, "replica_replaced") and result.epochs == 2
    assert all(np.isfinite(e["train_loss"]) and np.isfinite(e["test_loss"]) for e in events(result, "epoch_end")), \
        [(e["kind"], e.get("epoch"), e.get("train_loss"), e.get("test_loss"), e.get("rank")) for e in result.events]


@pytest.mark.full
def test_the_same_user_error_twice_on_a_fresh_replica_ends_the_run(ray_cluster, tmp_path):
    model = {"factory": "examples.models:failing_mlp", "kwargs": {"fail_after_calls": 25}}
    cfg = job_config(model=model, stop={"epochs": 3}, scaling={"replicas": 2, "cpus_per_replica": 0.5},
                     data={"batch_size": 8}, strategy={"mode": "downpour"}, checkpoint={"storage": str(tmp_path / "ck")})
    with pytest.raises(TrainingError, match=r"(?s)same error twice in a row on a fresh replica.*injected failure"):
        ElasticTrainer(cfg, show_progress=False).fit()


@pytest.mark.full
def test_past_the_restart_budget_a_dead_replica_is_dropped_down_to_min_replicas(ray_cluster, tmp_path):
    cfg = job_config(scaling={"replicas": 3, "cpus_per_replica": 0.5, "min_replicas": 2}, stop={"epochs": 3},
                     data={"batch_size": 8}, tracking={"progress_interval_s": 0, "log_every_steps": 1},
                     fault_tolerance={"max_replica_restarts": 0}, checkpoint={"storage": str(tmp_path / "ck")})
    result, inj, _, _ = fit_with(cfg, [Fault("kill_replica", 2, at_step=30)])
    [dropped] = events(result, "replica_dropped")
    assert dropped["dropped"] == [2] and result.epochs == 3
    assert_carried(dropped, "membership", "ledger", "state", "regroup", "data", "lr", "reopen")
    assert events(result, "epoch_end")[-1]["replicas"] == 2
