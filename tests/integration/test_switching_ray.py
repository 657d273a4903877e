"""Phase switches on real Ray actors, shards and gloo groups: the consolidation is exact, a
mid-epoch switch keeps the data epoch whole, and recovery works in the mode switched to."""
from __future__ import annotations

import glob
import math
import os
import time

import numpy as np
import pytest
import ray

from orchestrator.testing.chaos import Fault
from orchestrator.control.controller import Controller
from orchestrator.data.in_memory import load_source
from orchestrator.control.states import Reconfiguring, Running, SwitchPlan
from orchestrator.reporting.tracking import Tracker
from tests.conftest import assert_carried, job_config
from tests.integration.test_recovery_ray import events, fit_with

pytestmark = pytest.mark.ray

SMALL = {"scaling": {"replicas": 2, "cpus_per_replica": 0.5}, "data": {"batch_size": 8},
         "tracking": {"progress_interval_s": 0, "log_every_steps": 1}}


def controller(phases, trace_ids=False, **sections):
    cfg = job_config(strategy={"phases": phases}, stop={"epochs": 3}, **{**SMALL, **sections})
    return Controller(cfg, load_source(cfg.data.source, cfg.data.seed), Tracker(None, "tests", None),
                      time.perf_counter(), trace_ids=trace_ids)


def carry_out_switch(ctl):
    """Carry out the switch decided at the epoch's end that was just run (the replicas do not
    step again until the next epoch opens, so what the switch left can be read)."""
    assert isinstance(ctl.pending_switch, SwitchPlan)
    assert isinstance(ctl.step(), Reconfiguring)
    state = ctl.step()
    assert isinstance(state, Running) and not state.segment.begun and ctl.pending_switch is None


def momenta(ctl):
    return [m["momentum_buffer"] for m in ray.get([r.momentum.remote() for r in ctl.replicas], timeout=30)]


def replica_flats(ctl):
    return ray.get([r.flat_parameters.remote() for r in ctl.replicas], timeout=30)


def test_allreduce_to_easgd_and_back_carries_the_parameters_and_the_local_momentum(ray_cluster):
    """allreduce -> easgd: the center is seeded with the replicas' (identical) parameters, and
    each replica's momentum goes into easgd's local optimizer as it was; after an epoch of
    elastic averaging, easgd -> allreduce: every replica holds exactly the center, with the
    replicas' momenta averaged, and allreduce trains on from there."""
    ctl = controller([{"mode": "allreduce", "until": {"epochs": 1}},
                      {"mode": "easgd", "tau": 2, "momentum": 0.9, "until": {"epochs": 1}}, {"mode": "allreduce"}],
                     optimizer={"lr": 0.05, "momentum": 0.9})
    try:
        ctl.step()
        ctl.run_epoch()
        before = momenta(ctl)
        np.testing.assert_array_equal(before[0], before[1])  # allreduce: the same momentum everywhere
        assert np.abs(before[0]).sum() > 0
        carry_out_switch(ctl)
        assert ctl.spec.name == "easgd"
        flats = replica_flats(ctl)
        np.testing.assert_array_equal(flats[0], flats[1])  # allreduce replicas are identical
        np.testing.assert_array_equal(ctl.shard_group.values(), flats[0])  # the center = those parameters
        for m in momenta(ctl):
            np.testing.assert_array_equal(m, before[0])  # into easgd's local optimizer as it was

        ctl.run_epoch()  # one epoch of elastic averaging: each replica's momentum its own
        apart = momenta(ctl)
        assert not np.array_equal(apart[0], apart[1])
        carry_out_switch(ctl)  # easgd -> allreduce
        assert ctl.spec.name == "allreduce"
        center = ctl.shard_group.values()
        for flat in replica_flats(ctl):
            np.testing.assert_array_equal(flat, center)  # every replica holds exactly the center
        for m in momenta(ctl):
            np.testing.assert_allclose(m, (apart[0] + apart[1]) / 2, rtol=1e-6, atol=1e-7)
        ctl.run_epoch()  # and allreduce trains on from there, in a newly formed process group
        flats = replica_flats(ctl)
        np.testing.assert_array_equal(flats[0], flats[1])
        assert not np.array_equal(flats[0], center)
        switches = [e for e in ctl.tracker.events if e["kind"] == "mode_switch"]
        assert [(e["from"], e["to"]) for e in switches] == [("allreduce", "easgd"), ("easgd", "allreduce")]
        assert all(e["test_accuracy_after"] == e["test_accuracy_before"] for e in switches)
        assert all(e["switch_s"] > 0 for e in switches)
        assert [e["local_optimizer"] for e in switches] == [["carried"], ["carried, averaged"]]
    finally:
        ctl.shutdown()


@pytest.mark.full
def test_a_frozen_parameter_stays_out_of_the_center_a_switch_seeds(ray_cluster):
    """A model whose first layer is frozen: the center seeded from a replica holds exactly the
    trainable parameters, in the shards' layout, and the replicas train on from them."""
    ctl = controller([{"mode": "allreduce", "until": {"epochs": 1}}, {"mode": "easgd", "tau": 2}],
                     model={"factory": "tests.factories:partly_frozen_mlp"})
    try:
        ctl.step()
        ctl.run_epoch()
        [before] = ray.get([ctl.replicas[0].state.remote()], timeout=30)
        ctl.step()
        ctl.step()
        assert ctl.spec.name == "easgd"
        trainable = np.concatenate([v.reshape(-1).numpy() for k, v in before["model"].items()
                                    if not k.startswith("1.")])
        np.testing.assert_array_equal(ctl.shard_group.values(), trainable)
        for flat in replica_flats(ctl):
            np.testing.assert_array_equal(flat, trainable)
        [after] = ray.get([ctl.replicas[1].state.remote()], timeout=30)
        for k in ("1.weight", "1.bias"):  # frozen: as built, on every replica
            np.testing.assert_array_equal(after["model"][k].numpy(), before["model"][k].numpy())
    finally:
        ctl.shutdown()


@pytest.mark.full
def test_downpour_to_easgd_carries_the_shards_contents_over(ray_cluster):
    ctl = controller([{"mode": "downpour", "n_push": 2, "until": {"epochs": 1}}, {"mode": "easgd"}],
                     optimizer={"momentum": 0.5})
    try:
        ctl.step()
        ctl.run_epoch()
        before = ctl.shard_group.values()
        ctl.step()
        ctl.step()
        np.testing.assert_array_equal(ctl.shard_group.values(), before)  # Downpour's server copy is the center
        for flat in replica_flats(ctl):
            np.testing.assert_array_equal(flat, before)
        ctl.run_epoch()  # the event is logged once every replica stepped in the new mode
        [switch] = [e for e in ctl.tracker.events if e["kind"] == "mode_switch"]
        assert "carried over" in switch["shards"] and "reset" in switch["shards"]
    finally:
        ctl.shutdown()


@pytest.mark.full
def test_mid_epoch_switches_pause_at_partition_boundaries_and_serve_every_row_once(ray_cluster, tmp_path):
    """allreduce for 1 s, local SGD (period 3) for 15 steps, gossip (period 3) for 15, downpour for
    20, hogwild for 20, then allreduce: the switches land inside the first epoch (replicas slowed
    20 ms per step, ~205 steps an epoch, ~100-row partitions: a pause within ~7 steps); the epoch
    goes on where it was and still uses each row once. The replicas are identical at every pause
    (evaluated alike before and after), local SGD and gossip carry each replica's own momentum in
    and out; entering hogwild, the shared vector holds the shards' values and the replicas'
    momentum is lowered by what the asynchrony adds; leaving it, each
    replica's parameters become its own copy, equal across replicas. A checkpoint inside the epoch is due
    after every step (every_steps 1): the switches are still made inside the epoch (before, the
    checkpoint due at every tick closed the gate first and a switch waited for the epoch's end),
    and the rows stay once."""
    ctl = controller([{"mode": "allreduce", "until": {"seconds": 1.0}},
                      {"mode": "local_sgd", "period": 3, "until": {"steps": 15}},
                      {"mode": "gossip", "period": 3, "until": {"steps": 15}}, {"mode": "downpour", "until": {"steps": 20}},
                      {"mode": "hogwild", "until": {"steps": 20}}, {"mode": "allreduce"}], trace_ids=True,
                     faults={"slow_replicas": {0: 0.02, 1: 0.02}}, data={"batch_size": 8, "partitions": 32},
                     optimizer={"momentum": 0.5}, checkpoint={"every_steps": 1, "storage": str(tmp_path / "ck")})

    class States:
        seen: list = []

        def on_state(self, change):
            self.seen.append((change["from"], change["to"], change.get("plan")))

    ctl.report.callbacks.append(States())
    try:
        ctl.step()
        ctl.run_epoch()
        ctl.run_epoch()
        status = ctl.finish_epochs()  # the last epoch's final completions reported: the ledger's verdict
        flats = replica_flats(ctl)
    finally:
        ctl.shutdown()
    switches = [e for e in ctl.tracker.events if e["kind"] == "mode_switch"]
    modes = ["allreduce", "local_sgd", "gossip", "downpour", "hogwild", "allreduce"]
    assert [(e["from"], e["to"]) for e in switches] == list(zip(modes, modes[1:])), switches
    assert all(e["mid_epoch"] for e in switches) and switches[0]["epoch"] == 1
    for e in switches:  # the replicas were identical at the pause: evaluated alike before and after
        assert e["test_accuracy_after"] == e["test_accuracy_before"], e
    for e in switches[:2]:  # into local SGD, local SGD into gossip: each replica's own momentum carried
        assert "carried" in e["local_optimizer"][0], e["local_optimizer"]
        assert_carried(e, "passes", "state", "gate", "reopen")
    assert any(e["kind"] == "checkpoint" and e.get("in_epoch") for e in ctl.tracker.events)
    assert_carried(switches[3], "passes", "state", "verify", "gate", "reopen")
    # into hogwild: the replicas' own momentum (they step the shared vector) lowered by what 2 add
    assert "momentum 0.5 -> 0 on the replicas' steps" in switches[3].get("optimizer_translated", ""), switches
    # the after-state-change callback saw the switch as its own state, between two Running ones
    assert States.seen[0] == ("Starting", "Running", None)
    at = States.seen.index(("Running", "Reconfiguring", "SwitchPlan"))
    assert States.seen[at + 1] == ("Reconfiguring", "Running", None)
    n_train = len(ctl.dataset.train)
    for epoch in ctl.consumed:  # every train row exactly once per epoch, across the switches
        rows = [i for steps in epoch.values() for batch in steps for i in batch]
        assert sorted(rows) == sorted(set(rows)) and len(rows) == n_train
    assert status.complete
    assert [p["mode"] for p in ctl.phases] == modes
    assert ctl.phases[0]["end_step"] == ctl.phases[1]["start_step"] > 0
    np.testing.assert_array_equal(flats[0], flats[1])  # hogwild let go of: each replica's own copy, equal


@pytest.mark.full
def test_a_replica_killed_after_a_switch_is_replaced_in_the_new_mode(ray_cluster, tmp_path):
    small = {**SMALL, "data": {"batch_size": 8, "partitions": 32}}  # 50-row partitions: a pause within ~7 steps
    cfg = job_config(strategy={"phases": [{"mode": "allreduce", "until": {"steps": 20}}, {"mode": "downpour"}]},
                     stop={"epochs": 3}, optimizer={"momentum": 0.5}, checkpoint={"storage": str(tmp_path / "ck")},
                     **small)
    # at_step counts the furthest replica's steps: 180 past the switch leaves a loaded host's slower
    # replica time for its first downpour step before the kill
    result, inj, _, _ = fit_with(cfg, [Fault("kill_replica", 1, at_step=200)])
    assert inj.fired and result.epochs == 3 and result.mode == "phases"
    [switch] = events(result, "mode_switch")
    [replaced] = events(result, "replica_replaced")
    assert switch["to"] == "downpour" and replaced["ranks"] == [1]
    assert inj.fired[0]["t_wall"] > switch["stepping_at"]  # killed while every replica ran downpour
    assert replaced["steps_lost"] == 0  # downpour: the survivor never stopped
    assert [p["mode"] for p in result.phases] == ["allreduce", "downpour"]
    assert result.final.test_accuracy > 0.9


def phases_config(tmp_path, phases, epochs, checkpoint=None, tracking=None, **strategy):
    """The main example's CNN, data and optimizer (sgd, lr 0.05, momentum 0.9) in phases."""
    return job_config(strategy={"phases": phases, **strategy}, stop={"epochs": epochs, "target_accuracy": None},
                      model={"factory": "examples.models:mnist_cnn"}, data={"source": "builtin:mnist5k", "batch_size": 64},
                      scaling={"replicas": 2, "cpus_per_replica": 0.5},
                      optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9},
                      checkpoint={"storage": str(tmp_path / "ck"), **(checkpoint or {})}, tracking=tracking or {})


def phases_run(tmp_path, phases, epochs, faults=(), checkpoint=None, tracking=None, **strategy):
    result, _, _, _ = fit_with(phases_config(tmp_path, phases, epochs, checkpoint, tracking, **strategy), list(faults))
    return result


ALLREDUCE_2 = {"mode": "allreduce", "until": {"epochs": 2}}
HURTING = {"mode": "downpour", "optimizer": {"lr": 1e12}}  # the shards' rate: the loss is not finite within steps


@pytest.mark.full
def test_entering_downpour_with_the_jobs_momentum_is_translated_and_does_not_collapse(ray_cluster, tmp_path):
    """allreduce -> downpour with no per-phase optimizer: the shards' momentum is lowered by what
    the asynchrony adds, and accuracy holds after the switch (with the job's momentum 0.9 taken
    as it is, the next test's phase, it falls to chance within an epoch)."""
    result = phases_run(tmp_path, [ALLREDUCE_2, {"mode": "downpour"}], epochs=4)
    [switch] = events(result, "mode_switch")
    assert "momentum 0.9 -> 0.4" in switch["optimizer_translated"], switch
    assert not events(result, "switch_rolled_back")
    after = [e["test_accuracy"] for e in events(result, "epoch_end") if e["epoch"] >= switch["epoch"]]
    assert min(after) > 0.9, after


ROLLBACK_CK = {"every_steps": 20, "keep": 30}
# the driver hears every step: the checkpoint due 20 steps in comes before the ~31-step epoch ends
HEARD = {"log_every_steps": 1, "progress_interval_s": 0}


def rolled_back_run(tmp_path):
    """A downpour phase whose shards step at lr 1e12: within steps of the switch the loss is not
    finite. On probation that does not end the run (it would outside one: a divergence); the
    steps are skipped, that epoch's end finds the test loss not finite or far above the loss at
    the switch, and the run goes back to allreduce with the model from before the switch, and
    stays there. Returns the result and its switch_rolled_back event."""
    result = phases_run(tmp_path, [ALLREDUCE_2, HURTING], epochs=4, checkpoint=ROLLBACK_CK, tracking=HEARD)
    [rolled] = events(result, "switch_rolled_back")
    now, at = rolled["test_loss_now"], rolled["test_loss_at_switch"]
    assert rolled["back_to"] == "allreduce" and (not math.isfinite(now) or now > at * 1.5), rolled
    assert rolled["skipped_steps"] > 0, rolled  # non-finite losses on probation: skipped, the run went on
    switches = events(result, "mode_switch")
    assert [(s["from"], s["to"], s["rule"]) for s in switches] == [("allreduce", "downpour", "until epochs"),
                                                                   ("downpour", "allreduce", "rollback")]
    first, back = switches
    assert back["rollback"] and back["test_accuracy_after"] == first["test_accuracy_before"]  # the same model
    ends = events(result, "epoch_end")
    assert ends[-1]["test_accuracy"] >= first["test_accuracy_before"]
    assert [p["mode"] for p in result.phases] == ["allreduce", "downpour", "allreduce"]
    return result, rolled


def test_a_switch_that_hurts_is_rolled_back_to_the_mode_and_model_before_it(ray_cluster, tmp_path):
    """rolled_back_run's switch, rolled back (its checks); the run also checkpoints inside its epochs."""
    rolled_back_run(tmp_path)


@pytest.mark.full  # the same run again (~15 s), then resumed (~10 s): make test keeps the rollback itself
def test_a_run_resumed_inside_a_probation_is_on_probation_again(ray_cluster, tmp_path):
    """Resumed from the checkpoint taken inside the probation's epoch, the run is on probation
    again (the replicas skip the non-finite steps instead of ending the run as diverged) and that
    epoch's end rolls the switch back."""
    from orchestrator.persistence.checkpoint import CheckpointStore
    from orchestrator.trainer import ElasticTrainer

    _, rolled = rolled_back_run(tmp_path)
    inside = sorted(glob.glob(str(tmp_path / "ck" / "*" / f"*-in_epoch_{rolled['epoch']:04d}.pt.json")))
    assert inside, "no checkpoint was taken inside the probation's epoch"
    sidecar = inside[-1]
    store = CheckpointStore(str(tmp_path / "ck"), os.path.basename(os.path.dirname(sidecar)), keep=30)
    [entry] = [e for e in store.list() if e.name == os.path.basename(sidecar)[: -len(".json")]]
    state, why = store.verify(entry)
    assert state is not None and state["probation"]["until"] == rolled["epoch"], why
    again = ElasticTrainer(phases_config(tmp_path, [ALLREDUCE_2, HURTING], epochs=4, checkpoint=ROLLBACK_CK,
                                         tracking=HEARD), show_progress=False, resume=state).fit()
    [resumed] = events(again, "resumed")
    assert resumed["probation_until"] == rolled["epoch"] and resumed["in_epoch"]["epoch"] == rolled["epoch"]
    since = again.events[again.events.index(resumed):]  # the run's event log goes on from the first run's
    [rolled_again] = [e for e in since if e["kind"] == "switch_rolled_back"]
    assert rolled_again["epoch"] == rolled["epoch"] and rolled_again["back_to"] == "allreduce"
    assert again.phases[-1]["mode"] == "allreduce" and again.epochs == 4


@pytest.mark.full
def test_a_run_that_stops_at_the_rollback_ends_with_the_model_from_before_the_switch(ray_cluster, tmp_path):
    """The stop comes at the same epoch end that finds the switch hurt: the rollback is carried
    out first, so the final model and figures are those from before the switch. Replica 1 is
    SIGKILLed on the hurting phase's probation (~31 steps an epoch: step 70 is inside epoch 3):
    its replacement joins on probation too, skipping the non-finite steps instead of failing."""
    result = phases_run(tmp_path, [ALLREDUCE_2, HURTING], epochs=3, faults=[Fault("kill_replica", 1, at_step=70)])
    [rolled] = events(result, "switch_rolled_back")
    [failed] = events(result, "replica_failed")
    [replaced] = events(result, "replica_replaced")
    assert failed["cause"] == "died" and failed["epoch"] == replaced["epoch"] == 3, (failed, replaced)
    first, back = events(result, "mode_switch")
    assert back["rule"] == "rollback" and result.epochs == 3 and "epochs" in result.stop_reason
    assert result.final.test_accuracy == first["test_accuracy_before"] == back["test_accuracy_after"]


def test_adaptive_backups_drop_a_stragglers_gradients_and_probe_it_again(ray_cluster, tmp_path):
    """strategy.adaptive.async_mode backup: replica 1 slowed 50 ms a step (the tiny MLP's own step
    is about 1 ms) from the start. The policy switches to allreduce with one backup replica
    (predicted to train more rows a second), replica 1's late steps are dropped and counted,
    and after probe_s the run goes back to plain allreduce to measure it, then to the backups
    again. Every replica takes the same steps; the run learns."""
    from orchestrator.trainer import ElasticTrainer

    cfg = job_config(strategy={"switch": "adaptive", "adaptive": {"async_mode": "backup", "balance": False,
                                                                  "patience": 1, "min_phase_s": 0.5, "probe_s": 1.5}},
                     faults={"slow_replicas": [{"rank": 1, "delay_s": 0.05}]}, stop={"epochs": 10},
                     tracking={"progress_interval_s": 0, "log_every_steps": 2,
                               "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"},
                     checkpoint={"storage": f"{tmp_path}/ck"}, scaling={"replicas": 2, "cpus_per_replica": 0.5})
    # 10 epochs: with the straggler's steps dropped an epoch takes a fraction of a second, and a
    # run of 4 on a loaded host once ended before probe_s had passed in the backups
    result = ElasticTrainer(cfg, show_progress=False).fit()
    switches = events(result, "mode_switch")
    rules = [(e["phase"], e["rule"]) for e in switches]
    assert rules[:3] == [(1, "straggler"), (0, "probe"), (1, "straggler")], rules
    first = switches[0]
    assert (first["from"], first["to"], first["numbers"]["slowest_rank"], first["numbers"]["backup_replicas"]) == \
        ("allreduce", "allreduce", 1, 1)
    assert first["numbers"]["predicted_backup_rows_per_s"] > first["numbers"]["predicted_sync_rows_per_s"]
    assert "not measured" in switches[1]["reason"] and switches[1]["numbers"]["probe_s"] == 1.5
    drops = events(result, "backup_drops")
    # the straggler's rows are the ones dropped (a stall of replica 0 past 50 ms on a loaded host
    # can drop one of its steps too, so by share, not by the set of ranks)
    by_rank: dict = {}
    for e in drops:
        for rank, rows in e["dropped_rows_by_rank"].items():
            by_rank[int(rank)] = by_rank.get(int(rank), 0) + rows
    assert drops and by_rank.get(1, 0) >= 0.9 * sum(by_rank.values()), by_rank
    assert sum(e["dropped_rows"] for e in drops) > 0
    assert result.final.test_accuracy > 0.9


@pytest.mark.full
def test_a_replica_lost_in_a_switchs_middle_restarts_it_from_the_phase_it_left(ray_cluster, tmp_path, monkeypatch):
    """allreduce -> downpour at epoch 1's end; replica 1 is SIGKILLed as the driver evaluates the
    new mode's reference (the replicas and the controller are in downpour by then). The loss is
    a failure, the replica is replaced in downpour, and the switch is carried out again from the
    phase the plan recorded: one mode_switch, allreduce -> downpour, the shards seeded once more
    and every replica loading the reference it gives (before, the retry took the controller's
    phase for the old one: "downpour -> downpour"); the metric before it and the guard's model
    are those measured before the commit point (before, the retry measured them again on the
    half-switched replicas)."""
    from orchestrator.testing.chaos import kill_process
    from orchestrator.fleet.replica_group import ReplicaGroup

    original, seen = ReplicaGroup.call, {}

    def call(self, ranks, method, *args, **kwargs):
        if method == "set_mode":
            seen["set_mode"] = seen.get("set_mode", 0) + 1
        if seen.get("set_mode") == 1:  # between the cut-short try and the retry
            seen.setdefault("between", []).append(method)
        if method == "evaluate_reference" and seen.get("set_mode") == 1 and "killed" not in seen:
            seen["killed"] = kill_process(self.members[ranks[-1]])
        return original(self, ranks, method, *args, **kwargs)

    monkeypatch.setattr(ReplicaGroup, "call", call)
    cfg = job_config(strategy={"phases": [{"mode": "allreduce", "until": {"epochs": 1}}, {"mode": "downpour"}]},
                     stop={"epochs": 2}, checkpoint={"storage": str(tmp_path / "ck")}, **SMALL)
    result, _, _, _ = fit_with(cfg, [])
    assert "killed" in seen and seen["set_mode"] == 2, seen  # carried out twice: once cut short, once whole
    # the metric before it and the guard's model, measured once, on allreduce's model: the retry
    # came after the commit point (the replicas in downpour), where they would be the new rule's
    assert seen["between"].count("evaluate_reference") == 1, seen  # the killed try's check only: no second "before"
    [failed] = events(result, "replica_failed")
    assert failed["rank"] == 1 and failed["cause"] == "died"
    assert events(result, "replica_replaced")[0]["ranks"] == [1]
    [switch] = events(result, "mode_switch")
    assert (switch["from"], switch["to"]) == ("allreduce", "downpour"), switch
    assert [p["mode"] for p in result.phases] == ["allreduce", "downpour"]
    assert result.epochs == 2 and result.final.test_accuracy > 0.8


@pytest.mark.full  # ~30 s: the stopped shard's reseed is waited for 5 s, then it is rebuilt
def test_a_shard_stopped_as_a_switch_seeds_it_is_rebuilt_and_seeded_again(ray_cluster):
    """allreduce -> downpour at epoch 1's end, with shard 0 SIGSTOPped just before the switch is
    carried out: its reseed goes unanswered, so the shard is rebuilt from its snapshot and seeded
    again, and the switch completes with every shard holding the replicas' parameters (before,
    the reseed's GetTimeoutError ended the run)."""
    import os
    import signal

    from orchestrator.testing.chaos import kill_process

    ctl = controller([{"mode": "allreduce", "until": {"epochs": 1}}, {"mode": "downpour"}],
                     fault_tolerance={"hang_timeout_s": 60})
    ctl.cfg.strategy.timeout_s = 5.0  # the reseed's wait: well before the shard watch's own ping limit (30 s)
    pid = None
    try:
        ctl.step()
        ctl.run_epoch()
        assert isinstance(ctl.pending_switch, SwitchPlan)
        pid = kill_process(ctl.shard_group.handles[0], signal.SIGSTOP)
        assert isinstance(ctl.step(), Reconfiguring)
        state = ctl.step()
        assert isinstance(state, Running) and ctl.spec.name == "downpour"
        flats = replica_flats(ctl)
        np.testing.assert_array_equal(flats[0], flats[1])
        np.testing.assert_array_equal(ctl.shard_group.values(), flats[0])  # every shard seeded, the rebuilt one too
        ctl.run_epoch()
        rebuilt = [e for e in ctl.tracker.events if e["kind"] == "shard_rebuilt"]
        assert [e["shard"] for e in rebuilt] == [0], rebuilt
        [switch] = [e for e in ctl.tracker.events if e["kind"] == "mode_switch"]
        assert (switch["from"], switch["to"]) == ("allreduce", "downpour")
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        ctl.shutdown()
