"""The switch policies, without Ray: when a phase ends and why."""
import pytest

from orchestrator.config import JobConfig
from policies.decisions.switching import AdaptivePolicy, Observation, SchedulePolicy, make_switch_policy


def obs(epoch_end=False, epochs=0, step=0, elapsed_s=0.0, metrics=None, compute_s=None, rows=None, members=None):
    return Observation(epoch_end, epochs, step, elapsed_s, metrics or {}, compute_s or {}, rows=rows or {},
                       members=members)


def schedule(*phases):
    return make_switch_policy(JobConfig.from_dict({"strategy": {"phases": list(phases)}}).strategy)


def test_the_contract_example_switches_after_two_epochs_then_at_the_accuracy_threshold():
    pol = schedule({"mode": "downpour", "n_push": 4, "until": {"epochs": 2}},
                   {"mode": "allreduce", "until": {"test_accuracy": 0.96}}, {"mode": "easgd", "tau": 8})
    assert isinstance(pol, SchedulePolicy) and pol.plan[0]["n_push"] == 4 and pol.plan[2]["tau"] == 8
    assert pol.decide(obs(True, 1, 60, 5.0, {"test_accuracy": 0.9})) is None
    assert pol.decide(obs(False, 1, 100, 7.0)) is None  # mid-epoch: epochs count only at epoch ends
    sw = pol.decide(obs(True, 2, 120, 9.0, {"test_accuracy": 0.93}))
    assert (sw.phase, sw.mode, sw.rule) == (1, "allreduce", "until epochs") and sw.numbers["epochs_in_phase"] == 2
    assert pol.decide(obs(True, 3, 180, 12.0, {"test_accuracy": 0.955})) is None
    assert pol.decide(obs(False, 3, 200, 13.0, {"test_accuracy": 0.99})) is None  # metrics only at epoch ends
    sw = pol.decide(obs(True, 4, 240, 15.0, {"test_accuracy": 0.961}))
    assert (sw.phase, sw.mode, sw.rule) == (2, "easgd", "until test_accuracy")
    assert pol.decide(obs(True, 9, 900, 99.0, {"test_accuracy": 0.99})) is None  # the last phase runs to the end


def test_steps_and_seconds_count_from_the_phase_start_and_losses_must_fall():
    pol = schedule({"mode": "allreduce", "until": {"steps": 50}}, {"mode": "downpour", "until": {"seconds": 4}},
                   {"mode": "easgd", "until": {"test_loss": 0.2}}, {"mode": "allreduce"})
    assert pol.decide(obs(step=49, elapsed_s=3.0)) is None
    assert pol.decide(obs(step=50, elapsed_s=3.2)).mode == "downpour"
    assert pol.decide(obs(step=90, elapsed_s=7.1)) is None  # 3.9 s in the phase
    assert pol.decide(obs(step=95, elapsed_s=7.2)).numbers["seconds_in_phase"] == pytest.approx(4.0)
    assert pol.decide(obs(True, 3, 100, 8.0, {"test_loss": 0.25})) is None
    assert pol.decide(obs(True, 4, 120, 9.0, {"test_loss": 0.2})).mode == "allreduce"


def test_one_mode_is_one_phase_that_never_switches():
    pol = make_switch_policy(JobConfig.from_dict({"strategy": {"mode": "easgd", "tau": 2}}).strategy)
    assert [p["mode"] for p in pol.plan] == ["easgd"] and pol.plan[0]["tau"] == 2
    assert pol.decide(obs(True, 50, 10_000, 1e4, {"test_accuracy": 1.0})) is None


def test_a_rolled_back_policy_decides_no_further_switch_and_a_checkpoint_keeps_that():
    """The guard rolls a switch back: the policy is at the phase before it and decides nothing
    more this run, also when the run is resumed from a checkpoint of its state."""
    for pol in (schedule({"mode": "allreduce", "until": {"steps": 10}}, {"mode": "downpour"}),
                adaptive(async_mode="downpour")):
        slow = {0: 0.010, 1: 0.031}
        pol.roll_back(0)
        pol.commit()  # the rollback carried out (its switch's commit point)
        assert pol.current == 0 and pol.off
        for t in range(3, 12):  # past every threshold, patience and min_phase_s
            assert pol.decide(obs(step=100 * t, elapsed_s=10.0 * t, compute_s=slow)) is None
        again = type(pol)(pol.plan, **({} if isinstance(pol, SchedulePolicy) else
                                       {"slow_ratio": 2.0, "recover_ratio": 1.5, "patience": 1, "min_phase_s": 0}))
        again.load_state_dict(pol.state_dict())
        assert again.off and again.decide(obs(step=10_000, elapsed_s=1e4, compute_s=slow)) is None
        fresh = {k: v for k, v in pol.state_dict().items() if k != "off"}  # a checkpoint from before "off" was kept
        again.load_state_dict(fresh)
        assert not again.off


def adaptive(**kw):
    """The adaptive policy without balancing (the compute-time spread decides) unless asked."""
    cfg = {"switch": "adaptive", "adaptive": {"patience": 2, "min_phase_s": 3.0, "balance": False, **kw}}
    return make_switch_policy(JobConfig.from_dict({"strategy": cfg}).strategy)


def test_with_balancing_a_straggler_the_balance_absorbs_is_no_reason_to_switch():
    pol = adaptive(balance=True, patience=1, min_phase_s=0)
    assert pol.plan[0]["balance"] is True and pol.plan[1]["balance"] is False
    rows = {0: 64, 1: 64}
    for _ in range(5):  # 3x slower: the balanced split (96, 32) makes every replica busy as long
        assert pol.decide(obs(compute_s={0: 0.010, 1: 0.030}, rows=rows)) is None
    ratio, slow, numbers = pol.residual({0: 0.010, 1: 0.030}, rows)
    assert ratio == pytest.approx(1.0) and slow == 1 and numbers["balanced_shares"] == {"0": 96, "1": 32}


def test_with_balancing_a_straggler_past_the_share_bounds_goes_asynchronous_with_its_predicted_gain():
    pol = adaptive(balance=True, patience=1, min_phase_s=0)
    # 30x slower: its share stops at 0.25 x 64 = 16 rows, 16 / (64/0.3 rows/s) = 0.075 s a step
    sw = pol.decide(obs(compute_s={0: 0.010, 1: 0.300}, rows={0: 64, 1: 64}))
    assert (sw.mode, sw.rule, sw.numbers["slowest_rank"]) == ("easgd", "straggler", 1)
    ideal = 128 / (6400 + 64 / 0.3)
    assert sw.numbers["predicted_balanced_step_s"] == pytest.approx(0.075, abs=1e-5)
    assert sw.numbers["predicted_ideal_step_s"] == pytest.approx(ideal, abs=1e-5)
    assert sw.numbers["ratio"] == pytest.approx(0.075 / ideal, abs=1e-3)
    assert sw.numbers["predicted_gain"] == pytest.approx(1 - ideal / 0.075, abs=1e-3)
    back = pol.decide(obs(compute_s={0: 0.010, 1: 0.020}, rows={0: 64, 1: 64}))
    assert (back.mode, back.rule) == ("allreduce", "recovered") and back.numbers["predicted_gain"] < 0


@pytest.mark.parametrize("mode", ["downpour", "hogwild"])
def test_adaptive_goes_asynchronous_while_a_replica_straggles_and_back_when_it_recovers(mode):
    assert [p["mode"] for p in adaptive().plan] == ["allreduce", "easgd"]  # the default asynchronous mode
    pol = adaptive(async_mode=mode)
    assert isinstance(pol, AdaptivePolicy) and [p["mode"] for p in pol.plan] == ["allreduce", mode]
    even = {0: 0.010, 1: 0.011}
    slow = {0: 0.010, 1: 0.031}
    assert pol.decide(obs(elapsed_s=4, compute_s=even)) is None
    assert pol.decide(obs(elapsed_s=5, compute_s=slow)) is None  # once is not enough (patience 2)
    sw = pol.decide(obs(elapsed_s=6, compute_s=slow))
    assert (sw.mode, sw.rule, sw.numbers["slowest_rank"]) == (mode, "straggler", 1)
    assert sw.numbers["ratio"] == pytest.approx(3.1) and sw.numbers["threshold"] == 2.0
    assert pol.decide(obs(elapsed_s=7, compute_s=even)) is None
    assert pol.decide(obs(elapsed_s=8, compute_s=even)) is None  # min_phase_s: 2 s since the switch
    sw = pol.decide(obs(elapsed_s=9.5, compute_s=even))
    assert (sw.mode, sw.rule) == ("allreduce", "recovered")


def test_adaptive_hysteresis_keeps_the_mode_between_the_two_thresholds():
    pol = adaptive(slow_ratio=2.0, recover_ratio=1.4, async_mode="easgd")
    for t in range(10, 14):
        pol.decide(obs(elapsed_s=t, compute_s={0: 0.01, 1: 0.025}))
    assert pol.plan[pol.current]["mode"] == "easgd" and pol.plan[pol.current]["variant"] == "async"
    for t in range(14, 40):  # 1.7x: not slow enough to leave sync, not fast enough to come back
        assert pol.decide(obs(elapsed_s=t, compute_s={0: 0.01, 1: 0.017})) is None
    assert pol.plan[pol.current]["mode"] == "easgd"


def test_adaptive_needs_two_replicas_reporting_and_uses_the_median_of_the_others():
    pol = adaptive(patience=1, min_phase_s=0)
    assert pol.decide(obs(compute_s={0: 0.01})) is None
    assert AdaptivePolicy.spread({0: 0.01, 1: 0.012, 2: 0.03}) == (pytest.approx(2.727, abs=1e-3), 2)
    assert pol.decide(obs(compute_s={0: 0.01, 1: 0.012, 2: 0.03})).numbers["slowest_rank"] == 2


def test_entering_downpour_or_hogwild_lowers_the_momentum_by_what_the_asynchrony_adds():
    from policies.decisions.switching import entering_optimizer

    job = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}
    opt, note = entering_optimizer("downpour", job, None, replicas=2, in_phases=True)
    assert opt == {"lr": 0.05, "momentum": 0.4, "weight_decay": 0.0} and "0.9 -> 0.4" in note
    opt, _ = entering_optimizer("downpour", job, None, replicas=8, in_phases=True)
    assert opt["momentum"] == 0.025  # 0.9 - (1 - 1/8)
    opt, _ = entering_optimizer("downpour", {**job, "momentum": 0.5}, None, replicas=2, in_phases=True)
    assert opt["momentum"] == 0.0
    # taken as given: the phase's own momentum, a single-mode run, another mode, one replica
    assert entering_optimizer("downpour", job, {"momentum": 0.7}, 2, True) == ({**job, "momentum": 0.7}, None)
    assert entering_optimizer("downpour", job, None, 2, False) == (job, None)
    assert entering_optimizer("easgd", job, None, 2, True) == (job, None)
    # hogwild: each replica's own optimizer steps the one shared vector, as stale as downpour's
    opt, note = entering_optimizer("hogwild", job, None, replicas=2, in_phases=True)
    assert opt["momentum"] == 0.4 and "replicas' steps into the shared vector" in note
    # and the strategy hogwild's replicas run carries it (their own optimizers); other modes' as given
    from policies.decisions.switching import replicas_strategy

    hog = {"mode": "hogwild", "optimizer": {"lr": 0.01}}
    assert replicas_strategy(hog, job, 2, True)[0] == {"mode": "hogwild", "optimizer": {"lr": 0.01, "momentum": 0.4}}
    assert replicas_strategy(hog, job, 2, False) == (hog, None)  # one mode for the run: the job's momentum
    assert replicas_strategy({"mode": "downpour"}, job, 2, True) == ({"mode": "downpour"}, None)
    assert entering_optimizer("downpour", job, {"lr": 0.01}, 1, True) == ({**job, "lr": 0.01}, None)


def test_backups_as_the_straggler_phase_are_allreduce_with_backups_and_no_balancing():
    pol = adaptive(async_mode="backup", balance=True)
    sync, straggler = pol.plan
    assert (sync["mode"], sync["balance"], sync["backup_replicas"]) == ("allreduce", True, 0)
    assert (straggler["mode"], straggler["balance"], straggler["backup_replicas"]) == ("allreduce", False, 1)
    cfg = {"switch": "adaptive", "backup_replicas": 2, "adaptive": {"async_mode": "backup"}}
    two = make_switch_policy(JobConfig.from_dict({"strategy": cfg, "scaling": {"replicas": 4}}).strategy)
    assert two.backups == 2 and two.plan[0]["backup_replicas"] == 0 and two.plan[1]["backup_replicas"] == 2
    with pytest.raises(ValueError, match="backup_replicas"):  # 2 backups of 2 replicas
        JobConfig.from_dict({"strategy": cfg, "scaling": {"replicas": 2}})


def test_backups_are_entered_only_when_predicted_to_train_more_rows_a_second():
    """Two replicas, b = 1, balancing on. 30x slower: the balanced step trains 128 rows in 0.075 s
    (1,707 rows/s); with backups the fast one's 64 rows in 0.010 s (6,400 rows/s). 4 replicas, one
    20x slower, no balancing: waiting trains 256 rows in 0.2 s; backups 3 batches at the
    third-fastest's pace, 192 rows in 0.010 s."""
    pol = adaptive(async_mode="backup", balance=True, patience=1, min_phase_s=0)
    sw = pol.decide(obs(compute_s={0: 0.010, 1: 0.300}, rows={0: 64, 1: 64}))
    assert (sw.phase, sw.mode, sw.rule) == (1, "allreduce", "straggler")
    assert sw.numbers["predicted_sync_rows_per_s"] == pytest.approx(128 / 0.075, abs=0.1)
    assert sw.numbers["predicted_backup_rows_per_s"] == pytest.approx(6400, abs=0.1)
    assert sw.numbers["predicted_gain"] == pytest.approx(6400 / (128 / 0.075) - 1, abs=1e-3)
    assert sw.numbers["backup_replicas"] == 1 and "drop the late" in sw.reason

    cfg = {"switch": "adaptive", "adaptive": {"async_mode": "backup", "balance": False, "patience": 1,
                                              "min_phase_s": 0}}
    four = make_switch_policy(JobConfig.from_dict({"strategy": cfg, "scaling": {"replicas": 4}}).strategy)
    sw = four.decide(obs(compute_s={0: 0.010, 1: 0.010, 2: 0.011, 3: 0.200}, rows=dict.fromkeys(range(4), 64)))
    assert sw.numbers["predicted_backup_rows_per_s"] == pytest.approx(3 * 64 / 0.011, abs=0.1)
    assert sw.numbers["predicted_sync_rows_per_s"] == pytest.approx(256 / 0.2, abs=0.1)

    # 4 replicas, 2 of them 3x slower: the ratio says straggler, but one backup still waits for a
    # slow one (3 x 64 rows per 0.03 s) and trains fewer rows than waiting for both (256 per 0.03 s)
    four = make_switch_policy(JobConfig.from_dict({"strategy": cfg, "scaling": {"replicas": 4}}).strategy)
    for _ in range(3):
        assert four.decide(obs(compute_s={0: 0.010, 1: 0.010, 2: 0.030, 3: 0.030},
                               rows=dict.fromkeys(range(4), 64))) is None


def test_with_backups_a_late_replica_unmeasured_is_probed_and_a_measured_recovery_comes_back():
    pol = adaptive(async_mode="backup", balance=False, patience=2, min_phase_s=1.0, probe_s=10.0)
    slow = {0: 0.010, 1: 0.300}
    pol.decide(obs(elapsed_s=2, compute_s=slow, rows={0: 64, 1: 64}))
    assert pol.decide(obs(elapsed_s=3, compute_s=slow, rows={0: 64, 1: 64})).rule == "straggler"
    # replica 1 is late at every step: no figure of its own, so nothing to decide on ...
    for t in (4, 8, 12.9):
        assert pol.decide(obs(elapsed_s=t, compute_s={0: 0.010}, rows={0: 64})) is None
    # ... until probe_s has passed: back to the synchronous mode to measure it
    sw = pol.decide(obs(elapsed_s=13, compute_s={0: 0.010}, rows={0: 64}))
    assert (sw.phase, sw.rule, sw.numbers["probe_s"], sw.numbers["ratio"]) == (0, "probe", 10.0, None)
    assert "not measured" in sw.reason
    # still slow: back to the backups (patience 2, min_phase_s 1)
    pol.decide(obs(elapsed_s=14, compute_s=slow, rows={0: 64, 1: 64}))
    assert pol.decide(obs(elapsed_s=15, compute_s=slow, rows={0: 64, 1: 64})).rule == "straggler"
    # in time again often enough to be measured, and as fast: recovered before the probe
    even = {0: 0.010, 1: 0.011}
    assert pol.decide(obs(elapsed_s=16, compute_s=even, rows={0: 64, 1: 64})) is None
    sw = pol.decide(obs(elapsed_s=17, compute_s=even, rows={0: 64, 1: 64}))
    assert (sw.phase, sw.rule) == (0, "recovered") and sw.numbers["predicted_gain"] > 0


def test_with_backups_and_three_replicas_the_in_time_two_alone_are_not_a_recovery():
    """Replica 2 late at every step reports no compute time; replicas 0 and 1, in time and even,
    must not read as "recovered" (that flipped the run in and out of the backups every few
    seconds): only a measured group, every member in time, comes back, or the probe."""
    pol = adaptive(async_mode="backup", balance=False, patience=2, min_phase_s=1.0, probe_s=10.0)
    slow, rows = {0: 0.010, 1: 0.010, 2: 0.300}, dict.fromkeys(range(3), 64)
    pol.decide(obs(elapsed_s=2, compute_s=slow, rows=rows, members=3))
    assert pol.decide(obs(elapsed_s=3, compute_s=slow, rows=rows, members=3)).rule == "straggler"
    two = {0: 0.010, 1: 0.0105}
    for t in (4, 6, 8, 12.9):
        assert pol.decide(obs(elapsed_s=t, compute_s=two, rows={0: 64, 1: 64}, members=3)) is None
    assert pol.decide(obs(elapsed_s=13, compute_s=two, rows={0: 64, 1: 64}, members=3)).rule == "probe"
    pol.decide(obs(elapsed_s=14, compute_s=slow, rows=rows, members=3))
    assert pol.decide(obs(elapsed_s=15, compute_s=slow, rows=rows, members=3)).rule == "straggler"
    even = {0: 0.010, 1: 0.010, 2: 0.011}
    assert pol.decide(obs(elapsed_s=16, compute_s=even, rows=rows, members=3)) is None
    assert pol.decide(obs(elapsed_s=17, compute_s=even, rows=rows, members=3)).rule == "recovered"


def test_a_checkpoint_taken_while_a_decided_switch_waits_records_the_phase_that_runs():
    """The policy's place in a checkpoint is the phase the replicas run: a switch decided but not
    carried out yet (the replicas pausing for it, or an epoch's end before it) leaves it where it
    was, so a run resumed from that checkpoint runs phase N and switches again, from phase N's
    model (its own mode_switch), instead of starting in N+1 with N's model."""
    phases = ({"mode": "allreduce", "until": {"steps": 50}}, {"mode": "downpour"})
    pol = schedule(*phases)
    assert pol.decide(obs(step=50, elapsed_s=2.0)).phase == 1
    saved = pol.state_dict()
    assert saved["current"] == 0 and saved["mark"] == [0, 0, 0.0]
    resumed = schedule(*phases)
    resumed.load_state_dict(saved)
    assert resumed.decide(obs(step=55, elapsed_s=2.5)).phase == 1  # decided again after the resume
    pol.commit()  # the switch's commit point: the replicas run phase 1 from here
    assert pol.state_dict()["current"] == 1 and pol.state_dict()["mark"] == [0, 50, 2.0]

    ada = adaptive(patience=1, min_phase_s=0)
    assert ada.decide(obs(compute_s={0: 0.01, 1: 0.05}, elapsed_s=4.0)).mode == "easgd"
    assert ada.state_dict()["current"] == 0  # decided, not carried out
    ada.commit()
    assert ada.state_dict() == {"current": 1, "streak": 0, "last_switch_s": 4.0, "off": False}
    ada.roll_back(0)  # a rollback is a switch too: carried out, then committed
    assert ada.state_dict()["current"] == 1
    ada.commit()
    assert ada.state_dict()["current"] == 0 and ada.state_dict()["off"]
