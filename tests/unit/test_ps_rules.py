"""Downpour, EASGD and sharding against plain single-process references (no Ray)."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from examples.models import mnist_cnn, tiny_mlp
from policies.rules.downpour import DownpourWorker
from policies.rules.easgd import EasgdWorker, default_alpha
from policies.rules.sharding import FlatParams, ShardState, shard_bounds
from tests.unit.local_shards import LocalShardClient


def batches(n=12, bs=8, dim=8, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, dim, generator=g), torch.randint(0, classes, (bs,), generator=g)) for _ in range(n)]


def model(seed=0):
    torch.manual_seed(seed)
    return tiny_mlp(in_features=8, hidden=16, num_classes=3)


def flat_of(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 5])
def test_sharding_round_trips_bit_exactly(shards):
    m = mnist_cnn()  # fc1.weight (401,408 floats) is larger than any shard when shards >= 2
    before = flat_of(m).clone()
    flat = FlatParams(list(m.parameters()))
    assert torch.equal(flat.params, before)
    bounds = shard_bounds(flat.numel, shards)
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1 and bounds[0][0] == 0 and bounds[-1][1] == flat.numel
    parts = [ShardState(flat.params[lo:hi].clone()) for lo, hi in bounds]
    out = torch.empty_like(flat.params)
    for (lo, hi), s in zip(bounds, parts):
        out[lo:hi].copy_(s.values)
    assert torch.equal(out, before)
    flat.params.zero_()
    flat.params.copy_(out)  # writing the flat vector writes the model's parameters
    assert torch.equal(flat_of(m), before)


@settings(max_examples=50, deadline=None)
@given(numel=st.integers(1, 10_000), shards=st.integers(1, 8))
def test_bounds_cover_everything_once(numel, shards):
    if shards > numel:
        with pytest.raises(ValueError):
            shard_bounds(numel, shards)
        return
    b = shard_bounds(numel, shards)
    assert [lo for lo, _ in b[1:]] == [hi for _, hi in b[:-1]]
    assert b[0][0] == 0 and b[-1][1] == numel


@pytest.mark.parametrize("shards, momentum", [(1, 0.0), (3, 0.9)])
def test_downpour_one_replica_fetch_push_every_step_is_sgd(shards, momentum):
    data = batches()
    m = model()
    flat = FlatParams(list(m.parameters()))
    client = LocalShardClient(flat.params.clone(), shards, optimizer="sgd", lr=0.1, momentum=momentum)
    worker = DownpourWorker(m, flat, client, rank=0, lr=0.1, n_fetch=1, n_push=1)
    ref = model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=momentum)
    for x, y in data:
        worker.step(x, y)
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
        torch.testing.assert_close(client.values(), flat_of(ref), rtol=1e-6, atol=1e-7)
    stats = worker.end_epoch()
    assert stats["pushes"] == len(data) and stats["staleness_max"] == 0


def test_downpour_accumulates_n_push_and_measures_staleness():
    data = batches(n=8)
    m = model()
    flat = FlatParams(list(m.parameters()))
    client = LocalShardClient(flat.params.clone(), 2, optimizer="sgd", lr=0.1)
    worker = DownpourWorker(m, flat, client, rank=0, lr=0.1, n_fetch=4, n_push=2)
    for x, y in data:
        worker.step(x, y)
    stats = worker.end_epoch()
    assert stats["pushes"] == 4
    # pushes 1 and 2 come from the same fetch: the second is one update stale (on each shard)
    assert stats["staleness_max"] == 1 and 0 < stats["staleness_mean"] < 1


def test_adagrad_shard_is_distbelief_rule():
    s = ShardState(torch.ones(3), optimizer="adagrad", lr=0.5)
    g1, g2 = torch.tensor([1.0, 2.0, 0.5]), torch.tensor([0.5, -1.0, 0.5])
    s.apply_gradient(g1, 0)
    s.apply_gradient(g2, 1)
    acc1, acc2 = g1 ** 2, g1 ** 2 + g2 ** 2
    expected = torch.ones(3) - 0.5 * g1 / (acc1.sqrt() + 1e-10) - 0.5 * g2 / (acc2.sqrt() + 1e-10)
    torch.testing.assert_close(s.values, expected)


def test_staleness_aware_lr_divides_by_staleness():
    s = ShardState(torch.zeros(2), optimizer="sgd", lr=1.0)
    s.apply_gradient(torch.ones(2), 0, staleness_lr=True)  # fresh: full step
    assert s.apply_gradient(torch.ones(2), 0, staleness_lr=True) == 1
    s.apply_gradient(torch.ones(2), 0, staleness_lr=True)  # 2 stale: half a step
    torch.testing.assert_close(s.values, torch.full((2,), -2.5))


@pytest.mark.parametrize("shards, tau", [(1, 1), (2, 3)])
def test_easgd_one_replica_follows_the_paper(shards, tau):
    data = batches()
    eta, alpha = 0.1, default_alpha(1)
    m = model()
    flat = FlatParams(list(m.parameters()))
    client = LocalShardClient(flat.params.clone() + 0.01, shards)  # the center starts elsewhere
    worker = EasgdWorker(m, flat, torch.optim.SGD(m.parameters(), lr=eta), client, replicas=1, alpha=alpha, tau=tau)

    ref = model()
    x_i = flat_of(ref).clone()
    c = x_i + 0.01
    for t, (xb, yb) in enumerate(data):
        worker.step(xb, yb)
        # the paper, written out: gradient at x = x_i, elastic move every tau steps, then SGD
        torch.nn.utils.vector_to_parameters(x_i, ref.parameters())
        ref.zero_grad()
        F.cross_entropy(ref(xb), yb).backward()
        g = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        x = x_i.clone()
        if t % tau == 0:
            x_i = x_i - alpha * (x - c)
            c = c + alpha * (x - c)
        x_i = x_i - eta * g
        torch.testing.assert_close(flat.params, x_i, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(client.values(), c, rtol=1e-5, atol=1e-6)
    assert worker.end_epoch()["exchanges"] == len(range(0, len(data), tau))


def test_easgd_sync_round_moves_center_toward_the_mean():
    c0 = torch.zeros(4)
    s = ShardState(c0.clone())
    xs = [torch.full((4,), 1.0), torch.full((4,), 3.0)]
    assert not s.sync_contribute(0, xs[0], replicas=2, beta=0.9)
    assert s.sync_center_before(0) is None  # round still open: nothing to read yet
    assert s.sync_contribute(0, xs[1], replicas=2, beta=0.9)
    torch.testing.assert_close(s.values, torch.full((4,), 0.9 * 2.0))
    center, active = s.sync_center_before(0)
    torch.testing.assert_close(center, c0)
    assert active == 2


def test_a_sync_round_where_no_replica_has_data_is_only_a_vote():
    s = ShardState(torch.zeros(3))
    s.sync_contribute(0, torch.ones(3), replicas=2, beta=0.9, has_data=False)
    assert s.sync_contribute(0, torch.ones(3), replicas=2, beta=0.9, has_data=False)
    assert torch.equal(s.values, torch.zeros(3)) and s.version == 0
    assert s.sync_center_before(0)[1] == 0


class BlockingRounds:
    """LocalShardClient's sync rounds as a real barrier for replicas running in threads."""

    def __init__(self, client):
        import threading

        self.client, self.cond = client, threading.Condition()

    def __getattr__(self, name):
        return getattr(self.client, name)

    def sync_round(self, round_id, x, replicas, beta, has_data=True):
        with self.cond:
            for (lo, hi), st_ in zip(self.client.bounds, self.client.states):
                st_.sync_contribute(round_id, x[lo:hi], replicas, beta, has_data)
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: round_id in self.client.states[0]._closed, timeout=10), "round never closed"
            replies = [st_.sync_center_before(round_id) for st_ in self.client.states]
            return torch.cat([c for c, _ in replies]), replies[0][1]


def test_sync_easgd_is_lock_step_with_uneven_data():
    """Replica 0 holds 7 batches, replica 1 holds 2: both end the epoch after the same step
    (replica 1 taking empty steps and meeting every round), nobody waits at a round the other
    skips, and the elastic distance each reports is ||x_i - c|| at the end."""
    import threading

    data = batches(n=9)
    models = [model(), model()]
    flats = [FlatParams(list(m.parameters())) for m in models]
    client = BlockingRounds(LocalShardClient(flats[0].params.clone(), 2, replicas=2))
    workers = [EasgdWorker(m, f, torch.optim.SGD(m.parameters(), lr=0.1), client, replicas=2, alpha=0.45, tau=2,
                           variant="sync") for m, f in zip(models, flats)]
    mine = [data[:7], data[7:]]
    steps, stats = {}, {}

    def replica(rank):
        w, queue, n = workers[rank], list(mine[rank]), 0
        while True:
            x, y = queue.pop(0) if queue else (None, None)
            n += 1
            if not w.step(x, y, bool(queue)).go_on:
                break
        steps[rank], stats[rank] = n, w.end_epoch()

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    assert steps == {0: 9, 1: 9}  # 7 real steps, then the vote round at step 8 (tau = 2)
    assert [w.step_count for w in workers] == [7, 2]
    center = client.values()
    for w, f in zip(workers, flats):
        assert stats[workers.index(w)]["elastic_distance"] == pytest.approx(float((f.params - center).norm()), rel=1e-5)


def test_average_buffers_means_floats_and_keeps_the_largest_count():
    import numpy as np

    from policies.rules.sharding import average_buffers

    out = average_buffers({0: {"m": np.array([1.0, 3.0], np.float32), "n": np.array(4)},
                           1: {"m": np.array([3.0, 5.0], np.float32), "n": np.array(6)}})
    assert out["m"].tolist() == [2.0, 4.0] and out["m"].dtype == np.float32 and int(out["n"]) == 6
    assert average_buffers({}) == {}


def test_the_shard_observes_the_lead_over_the_slowest_replica():
    s = ShardState(torch.zeros(1))
    s.init_clocks(2)
    s.report_clock(0, 5)  # replica 1 still at 0
    s.report_clock(1, 2)
    s.report_clock(0, 6)
    assert s.max_lead == 5
    s.forget(1)
    s.report_clock(0, 50)  # alone: nobody to lead
    assert s.max_lead == 5


def test_flat_params_stay_on_the_parameters_device():
    m = model()
    flat = FlatParams(list(m.parameters()))
    assert flat.params.device == next(m.parameters()).device == flat.grads.device == flat.device
    with pytest.raises(ValueError, match="one device"):
        FlatParams([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, device="meta"))])


def test_warmstart_holds_other_replicas_until_rank_0_has_trained():
    import threading

    data = batches(n=6)
    m0, m1 = model(), model()
    f0, f1 = FlatParams(list(m0.parameters())), FlatParams(list(m1.parameters()))
    client = LocalShardClient(f0.params.clone(), 1, replicas=2, optimizer="sgd", lr=0.1)
    lone = DownpourWorker(m1, f1, client, rank=1, lr=0.1, warmstart_steps=3, timeout_s=0.3)
    with pytest.raises(TimeoutError, match="warmstart"):
        lone.step(*data[0])  # nobody has pushed: rank 1 waits, and says why when it gives up
    first = DownpourWorker(m0, f0, client, rank=0, lr=0.1, warmstart_steps=3)
    waiting = DownpourWorker(m1, f1, client, rank=1, lr=0.1, warmstart_steps=3, timeout_s=10)
    started = []
    t = threading.Thread(target=lambda: (waiting.step(*data[0]), started.append(client.version())))
    t.start()
    for x, y in data[:3]:
        assert not started  # still held back
        first.step(x, y)
    t.join(timeout=10)
    assert started and started[0] >= 3  # it began only after rank 0's first 3 steps


@pytest.mark.parametrize("alpha, p, new_p, expected", [(0.45, 2, 4, 0.225), (0.45, 2, 1, 0.9), (0.5, 4, 1, 1.0)])
def test_easgd_regroup_keeps_beta_equal_p_alpha(alpha, p, new_p, expected):
    """A resize from p to new_p replicas: alpha = beta / new_p with beta = p alpha (at most 1 per
    replica: alpha stays in (0, 1])."""
    m = model()
    flat = FlatParams(list(m.parameters()))
    worker = EasgdWorker(m, flat, torch.optim.SGD(m.parameters(), lr=0.1), LocalShardClient(flat.params.clone(), 1),
                         replicas=p, alpha=alpha)
    worker.regroup(new_p, generation=2)
    assert worker.replicas == new_p and worker.alpha == pytest.approx(expected)
    worker.regroup(new_p, generation=3)  # the same size again (a replacement): alpha unchanged
    assert worker.alpha == pytest.approx(expected)
