"""The cost model's maths (policies/decisions/cost_model.py), against straightforward references."""
from __future__ import annotations

import numpy as np
import pytest

from policies.decisions.cost_model import (Calibration, ModeShape, Stragglers, fit_link, max_compute, predict,
                                 ring_allreduce_s, table)

CAL = Calibration(params=100_000, batch=64, compute_s=0.01, alpha_s=50e-6, beta_s_per_byte=1e-9)


def test_one_replica_allreduce_is_the_single_process_step():
    one = predict("allreduce", 1, CAL)
    single = predict("single", 1, CAL)
    assert one.comm_s == 0 and one.step_s == pytest.approx(single.step_s) == pytest.approx(0.01)
    assert one.samples_per_s == pytest.approx(6400)


def test_ring_allreduce_is_the_alpha_beta_formula():
    m = 400_000  # bytes
    for n in (2, 4, 1024):
        assert ring_allreduce_s(CAL, n) == pytest.approx(2 * (n - 1) / n * m * 1e-9 + 2 * (n - 1) * 50e-6)
    p = predict("allreduce", 4, CAL)
    assert p.step_s == pytest.approx(0.01 + ring_allreduce_s(CAL, 4))
    assert p.samples_per_s == pytest.approx(4 * 64 / p.step_s)


def test_local_sgd_with_period_one_is_allreduce_and_a_longer_period_pays_less_communication():
    s = Stragglers(p=0.1, factor=3.0, jitter=0.2)
    h1 = predict("local_sgd", 8, CAL, s, ModeShape(period=1))
    ar = predict("allreduce", 8, CAL, s)
    assert h1.step_s == pytest.approx(ar.step_s)
    h8 = predict("local_sgd", 8, CAL, s, ModeShape(period=8))
    assert h8.comm_s == pytest.approx(ar.comm_s / 8)
    assert h8.compute_s < ar.compute_s  # a block of 8 steps averages transient stragglers out


def test_expected_max_matches_a_plain_monte_carlo_reference():
    rng = np.random.default_rng(123)
    for n, s in [(4, Stragglers(p=0.2, factor=3.0)), (16, Stragglers(p=0.05, factor=2.0, jitter=0.3))]:
        draws = np.where(rng.random((200_000, n)) < s.p, s.factor, 1.0) * rng.lognormal(0, s.jitter, (200_000, n))
        reference = 0.01 * draws.max(axis=1).mean()
        assert max_compute(CAL, n, s) == pytest.approx(reference, rel=0.03)


def test_a_persistent_straggler_sets_every_lock_step():
    s = Stragglers(p=0.25, factor=3.0, persistent=True)
    assert max_compute(CAL, 4, s, block=8) == pytest.approx(0.03)  # one of 4 is 3x slower, always
    assert predict("downpour", 4, CAL, s).compute_s == pytest.approx(0.01 * (1 + 0.25 * 2))  # the mean replica


def test_the_shards_cap_an_asynchronous_mode():
    big = Calibration(params=25_000_000, batch=32, compute_s=0.01, alpha_s=0.0, beta_s_per_byte=8 / 10e9)
    few = predict("downpour", 256, big, shape=ModeShape(shards=1))
    many = predict("downpour", 256, big, shape=ModeShape(shards=64))
    assert few.bound == "shards" and few.samples_per_s == pytest.approx(32 / (2 * 100e6 * 8 / 10e9))
    assert many.samples_per_s > 10 * few.samples_per_s
    easgd = predict("easgd", 256, big, shape=ModeShape(period=8, shards=1))
    assert easgd.samples_per_s == pytest.approx(8 * few.samples_per_s)  # 2/tau per step against 2: 1/8 of the traffic


def test_cores_slow_compute_beyond_what_the_hosts_hold():
    cal = Calibration(params=1000, batch=64, compute_s=0.01, alpha_s=0, beta_s_per_byte=0, cores=2)
    assert predict("allreduce", 2, cal).samples_per_s == pytest.approx(2 * 6400)
    assert predict("allreduce", 4, cal).samples_per_s == pytest.approx(2 * 6400)  # 4 on 2 cores: no gain


def test_fit_link_recovers_alpha_and_beta():
    sizes = [4, 100_000, 400_000]
    seconds = [2 * 30e-6 + 1 / 2 * 2 * s * 2e-9 for s in sizes]  # n = 2
    alpha, beta = fit_link(sizes, seconds, n=2)
    assert alpha == pytest.approx(30e-6, rel=1e-6) and beta == pytest.approx(2e-9, rel=1e-6)


def test_a_link_measured_with_no_slope_is_measured_again_then_bounded_by_its_big_message(monkeypatch):
    """A busy host's loopback timings with the small message as slow as the big one fit beta 0
    (free bandwidth); calibrate_link measures again, then takes the big message's time over its
    bytes as beta (an upper bound), never 0."""
    from orchestrator.cli import calibration as cal

    flat, sloped = [3e-4, 1e-4, 1e-4], [1e-4, 2e-4, 5e-4]
    calls = []
    monkeypatch.setattr(cal, "_link_timings", lambda sizes, repeats: calls.append(sizes) or flat)
    alpha, beta = cal.calibrate_link(1000)
    assert len(calls) == cal.LINK_TRIES and beta == pytest.approx(1e-4 / cal.LINK_MIN_BYTES) and alpha >= 0
    answers = iter([flat, sloped])
    monkeypatch.setattr(cal, "_link_timings", lambda sizes, repeats: next(answers))
    assert cal.calibrate_link(1000) == fit_link([4, cal.LINK_MIN_BYTES // 4, cal.LINK_MIN_BYTES], sloped)


def test_table_lists_single_once_and_every_mode_at_every_count():
    rows = table([1, 2, 1024], CAL)
    assert [(r.mode, r.replicas) for r in rows if r.mode == "single"] == [("single", 1)]
    assert {(r.mode, r.replicas) for r in rows if r.mode == "easgd"} == {("easgd", 1), ("easgd", 2), ("easgd", 1024)}


@pytest.mark.parametrize("bad", [dict(params=0), dict(compute_s=-1.0), dict(alpha_s=float("nan")), dict(cores=0)])
def test_bad_calibration_is_refused(bad):
    fields = dict(params=10, batch=1, compute_s=0.1, alpha_s=0.0, beta_s_per_byte=0.0)
    with pytest.raises(ValueError):
        Calibration(**{**fields, **bad})


def test_bad_stragglers_and_modes_are_refused():
    with pytest.raises(ValueError):
        Stragglers(p=1.5)
    with pytest.raises(ValueError):
        Stragglers(factor=0.5)
    with pytest.raises(ValueError):
        predict("no-such-mode", 2, CAL)


def test_half_precision_halves_the_ring_all_reduce_bandwidth_term():
    from dataclasses import replace

    from policies.decisions.cost_model import Calibration, ring_allreduce_s

    cal = Calibration(params=1_000_000, batch=64, compute_s=0.01, alpha_s=0.0, beta_s_per_byte=1e-9)
    assert ring_allreduce_s(replace(cal, allreduce_bytes_per_param=2), 4) == pytest.approx(ring_allreduce_s(cal, 4) / 2)


def test_a_run_of_several_replicas_calibrates_the_cores_its_hosts_gave_them():
    """--from-run with a 2-replica run: the step stays the one timed here alone, and the cores
    are what sharing the hosts did to it, so the model gives the run's own step back at 2."""
    from orchestrator.config import JobConfig
    from orchestrator.cli.calibration import calibration

    cfg = JobConfig.from_dict({"model": {"factory": "examples.models:tiny_mlp"},
                               "data": {"source": "builtin:synthetic", "batch_size": 32}})
    alone = calibration(cfg, latency_us=10, bandwidth_gbps=10)
    run = {"run": "r1", "mode": "allreduce", "replicas": 2, "batch": 32, "step_s": 0.0, "comm_s": 0.0,
           "compute_s": 3 * alone.compute_s, "shape": {}}
    cal = calibration(cfg, run, latency_us=10, bandwidth_gbps=10)
    assert "run r1" in cal.source
    # timed again here: the same step within timing noise, so cores ~ 2 x 1/3
    assert cal.cores == pytest.approx(2 * cal.compute_s / run["compute_s"])
    assert 0.3 < cal.cores < 1.2
    assert predict("allreduce", 2, cal).compute_s == pytest.approx(run["compute_s"], rel=1e-9)
    fast = calibration(cfg, {**run, "compute_s": alone.compute_s / 10}, latency_us=10, bandwidth_gbps=10)
    assert fast.cores == 2.0  # a run no slower than the step alone: every replica had its own cores
    # and the run's step is the one modelled (a busy host here must not slow the model of that run)
    assert fast.compute_s == pytest.approx(alone.compute_s / 10)
    assert predict("allreduce", 2, fast).compute_s == pytest.approx(alone.compute_s / 10, rel=1e-9)


def test_the_shards_path_from_a_sharded_run_sets_the_asynchronous_modes_traffic():
    cal = Calibration(params=1000, batch=64, compute_s=0.01, alpha_s=0.0, beta_s_per_byte=1e-12,
                      shard_beta_s_per_byte=1e-6)
    p = predict("downpour", 1, cal, shape=ModeShape(n_push=1, n_fetch=1))
    assert p.comm_s == pytest.approx(2 * 4000 * 1e-6)  # M up and M down on the shards' path, not the link's
    assert predict("allreduce", 2, cal).comm_s == pytest.approx(ring_allreduce_s(cal, 2))


@pytest.mark.parametrize("n,b,persistent", [(4, 1, False), (5, 2, False), (4, 1, True), (3, 0, False)])
def test_backups_wait_for_the_first_replicas_as_a_plain_simulation_says(n, b, persistent):
    """The backup row: the (n - b)-th fastest replica's compute (closed form), against a plain
    numpy draw of every replica's step; it trains on (n - b) batches a step; b = 0 is allreduce."""
    s = Stragglers(p=0.3, factor=3.0, persistent=persistent)
    shape = ModeShape(backups=b)
    got = predict("backup", n, CAL, s, shape)
    rng = np.random.default_rng(1)
    if persistent:
        steps = np.ones((1, n))
        steps[:, : round(s.p * n)] = s.factor
    else:
        steps = np.where(rng.random((200_000, n)) < s.p, s.factor, 1.0)
    kth = np.sort(steps, axis=1)[:, n - b - 1].mean() * CAL.compute_s
    assert got.compute_s == pytest.approx(kth, rel=0.01)
    assert got.samples_per_s == pytest.approx((n - b) * CAL.batch / (kth + ring_allreduce_s(CAL, n)), rel=0.01)
    if b == 0:
        assert got.samples_per_s == pytest.approx(predict("allreduce", n, CAL, s).samples_per_s)
    jittered = predict("backup", n, CAL, Stragglers(p=0.3, factor=3.0, jitter=0.2), shape)
    assert jittered.compute_s < predict("allreduce", n, CAL, Stragglers(p=0.3, factor=3.0, jitter=0.2)).compute_s or b == 0


def test_a_runs_all_reduce_faster_than_the_latency_fitted_here_still_sets_the_link():
    """--from-run of a 2-replica allreduce run whose all-reduce took less than the latency this
    host's loopback showed when calibrating (a loaded machine): the link scales to the run's
    time, so the model gives the run's own step back at 2 instead of a latency floor."""
    from orchestrator.config import JobConfig
    from orchestrator.cli.calibration import calibration

    cfg = JobConfig.from_dict({"model": {"factory": "examples.models:tiny_mlp"},
                               "data": {"source": "builtin:synthetic", "batch_size": 32}})
    run = {"run": "r2", "mode": "allreduce", "replicas": 2, "batch": 32, "step_s": 0.0, "comm_s": 1e-7,
           "compute_s": 0.002, "shape": {}}
    cal = calibration(cfg, run)
    assert "run r2's communication" in cal.source
    got = predict("allreduce", 2, cal)
    assert got.comm_s == pytest.approx(run["comm_s"], rel=1e-6)
    assert got.compute_s == pytest.approx(run["compute_s"], rel=1e-9)
    # the shape kept: more replicas cost more. The latency fitted on this host's loopback may be 0
    # (fit_link keeps it >= 0 when a loaded host's timings give a negative intercept)
    assert cal.alpha_s >= 0 and cal.beta_s_per_byte > 0
    assert predict("allreduce", 8, cal).comm_s > got.comm_s


def test_on_shared_cores_communication_slows_as_compute_does():
    """More replicas than cores: the loopback link is work on the same cores, so the ring
    all-reduce and the shards' exchanges stretch by n / cores as compute does."""
    from dataclasses import replace

    from policies.decisions.cost_model import Calibration, ring_allreduce_s

    own = Calibration(params=100_000, batch=64, compute_s=0.01, alpha_s=1e-4, beta_s_per_byte=1e-9)
    shared = replace(own, cores=2.0)
    for mode, n in (("allreduce", 4), ("backup", 4), ("downpour", 4), ("easgd", 8), ("local_sgd", 4)):
        a, b = predict(mode, n, own), predict(mode, n, shared)
        assert b.comm_s == pytest.approx(a.comm_s * n / 2) and b.compute_s == pytest.approx(a.compute_s * n / 2)
    assert predict("allreduce", 2, shared).comm_s == pytest.approx(ring_allreduce_s(own, 2))  # within the cores


@pytest.mark.full  # make test: the link calibrated from a run (above)
def test_a_half_precision_run_calibrates_the_link_with_the_bytes_it_sent():
    """--from-run of an fp16 allreduce run: the link is fitted to the bytes the prediction counts
    (2 per parameter), so the model gives the run's own communication back at its n."""
    from orchestrator.config import JobConfig
    from orchestrator.cli.simulate import simulate

    cfg = JobConfig.from_dict({"model": {"factory": "examples.models:tiny_mlp"},
                               "data": {"source": "builtin:synthetic", "batch_size": 32},
                               "strategy": {"compression": "fp16"}})
    run = {"run": "r3", "mode": "allreduce", "replicas": 2, "batch": 32, "step_s": 0.0, "comm_s": 0.004,
           "compute_s": 1e-6, "shape": {}}
    cal, preds = simulate(cfg, [2], Stragglers(), run, latency_us=10)
    [got] = [p for p in preds if p.mode == "allreduce" and p.replicas == 2]
    assert cal.allreduce_bytes_per_param == 2 and got.comm_s == pytest.approx(run["comm_s"], rel=1e-6)


def test_the_shard_path_option_refuses_an_unknown_value_and_a_modelled_link():
    """--shard-path: 'link' or 'here'; 'here' with --bandwidth-gbps contradicts itself. Both are
    refused before anything is timed or any Ray is started."""
    from orchestrator.config import JobConfig
    from orchestrator.errors import ConfigError
    from orchestrator.cli.calibration import calibration

    cfg = JobConfig.from_dict({"model": {"factory": "examples.models:tiny_mlp"},
                               "data": {"source": "builtin:synthetic", "batch_size": 32}})
    with pytest.raises(ConfigError, match="--shard-path must be one of link, here"):
        calibration(cfg, shard_path="there")
    with pytest.raises(ConfigError, match="--bandwidth-gbps"):
        calibration(cfg, bandwidth_gbps=1.0, shard_path="here")


def test_fsdp_pays_one_and_a_half_rings_of_bytes_and_three_messages_a_unit():
    """fsdp: per unit two all-gathers and a reduce-scatter, (n-1)/n of its bytes each, and two
    small all-reduces; one replica is the single step; a replica holds 1/n of the state."""
    cal = Calibration(params=1_000_000, batch=64, compute_s=0.01, alpha_s=5e-5, beta_s_per_byte=1e-9)
    one = predict("fsdp", 1, cal)
    assert one.comm_s == 0.0 and one.step_s == pytest.approx(cal.compute_s)
    for n in (2, 8, 1024):
        p = predict("fsdp", n, cal, shape=ModeShape(units=5))
        want = 3 * (n - 1) / n * cal.model_bytes * cal.beta_s_per_byte + (3 * 5 + 4) * (n - 1) * cal.alpha_s
        assert p.comm_s == pytest.approx(want) and p.extra["state_share"] == pytest.approx(1 / n)
        assert p.comm_s > predict("allreduce", n, cal).comm_s  # more bytes and more messages than the ring


def test_hogwild_writers_on_the_shards_node_pay_nothing_and_the_others_are_downpour_through_one_shard():
    """hogwild: every replica on the shard's node steps at compute speed with nothing on the wire;
    those beyond `node_replicas` push and pull every step (downpour with n_push = n_fetch = 1 and
    one shard), the shard's link capping them."""
    cal = Calibration(params=1_000_000, batch=64, compute_s=0.01, alpha_s=5e-5, beta_s_per_byte=1e-9)
    for n in (1, 4, 1024):
        p = predict("hogwild", n, cal)
        assert p.comm_s == 0.0 and p.samples_per_s == pytest.approx(n * 64 / 0.01) and p.extra["through_shard"] == 0
    mixed = predict("hogwild", 1024, cal, shape=ModeShape(node_replicas=8))
    remote = predict("downpour", 1016, cal, shape=ModeShape(shards=1))
    assert mixed.extra == {"direct": 8, "through_shard": 1016} and mixed.bound == remote.bound == "shards"
    assert mixed.samples_per_s == pytest.approx(8 * 64 / 0.01 + remote.samples_per_s)


def test_hogwild_direct_writers_together_go_no_faster_than_the_nodes_memory_carries_the_shared_vector():
    """Each direct step reads the shared vector and reads and writes it again (3 M bytes); the k
    writers share the node's memory bandwidth: past b mem / (3 M) samples/s more writers add
    nothing (bound "memory"), below it they add their compute speed as before; the writers
    through the shard are not held by the node's memory."""
    mem = 20e9
    cal = Calibration(params=25_000_000, batch=64, compute_s=0.05, alpha_s=5e-5, beta_s_per_byte=1e-9,
                      memory_bytes_per_s=mem)
    cap = 64 * mem / (3 * 100_000_000)  # 4,267 samples/s: 3.3 writers' worth of compute
    assert predict("hogwild", 2, cal).samples_per_s == pytest.approx(2 * 64 / 0.05)
    assert predict("hogwild", 2, cal).bound == "replicas"
    for n in (4, 64):
        p = predict("hogwild", n, cal)
        assert p.samples_per_s == pytest.approx(cap) and p.bound == "memory", p
        assert p.extra["memory_cap_samples_per_s"] == pytest.approx(cap)
    mixed = predict("hogwild", 12, cal, shape=ModeShape(node_replicas=8))
    assert mixed.samples_per_s == pytest.approx(cap + predict("downpour", 4, cal, shape=ModeShape(shards=1)).samples_per_s)
    free = predict("hogwild", 64, Calibration(params=25_000_000, batch=64, compute_s=0.05, alpha_s=5e-5,
                                              beta_s_per_byte=1e-9))
    assert free.samples_per_s == pytest.approx(64 * 64 / 0.05) and "memory_cap_samples_per_s" not in free.extra
    with pytest.raises(ValueError, match="memory_bytes_per_s"):
        Calibration(params=1, batch=1, compute_s=0.0, alpha_s=0.0, beta_s_per_byte=0.0, memory_bytes_per_s=0.0)


def test_sandblaster_pays_a_push_per_task_and_the_pass_end_and_the_shards_cap_it():
    """sandblaster: M bytes pushed per task of k steps, a pull and the coordinator's 2h + 6 round
    trips per pass spread over a replica's steps of it; the wait for the last task grows with a
    straggler; the shards' links cap the rate as downpour's do, eased k times."""
    cal = Calibration(params=1_000_000, batch=64, compute_s=0.01, alpha_s=5e-5, beta_s_per_byte=1e-9)
    shape = ModeShape(task_steps=4, pass_steps=64, history=10, shards=2)
    wire = cal.model_bytes * cal.beta_s_per_byte + cal.alpha_s
    for n in (1, 2, 8):
        p = predict("sandblaster", n, cal, shape=shape)
        want = wire / 4 + (wire + 26 * cal.alpha_s) / max(1.0, 64 / n)
        assert p.comm_s == pytest.approx(want) and p.extra["updates_per_pass"] == 1
        assert p.samples_per_s == pytest.approx(n * 64 / (0.01 + want))
    slow = predict("sandblaster", 8, cal, Stragglers(p=1 / 8, factor=4.0, persistent=True), shape)
    assert slow.comm_s > predict("sandblaster", 8, cal, shape=shape).comm_s  # the pass waits for the straggler's task
    many = predict("sandblaster", 1024, cal, shape=shape)
    assert many.bound == "shards" and many.samples_per_s == pytest.approx(64 * 4 / (cal.model_bytes / 2 * 1e-9))
