"""Local SGD with period H and DiLoCo's outer step against a plain one-process reference, without
Ray: p threads stand in for p replicas and meet at a barrier that sums their rounds."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from examples.models import tiny_mlp
from policies.rules.local_sgd import LocalSgdWorker, outer_step
from policies.rules.modes import Interrupted
from tests.unit.test_allreduce_rule import ThreadSum, run_replicas


def model(seed=0):
    torch.manual_seed(seed)
    return tiny_mlp(in_features=8, hidden=16, num_classes=3)


def data(counts, rows=6, seed=1):
    """counts[r] batches of `rows` rows for replica r (the last one short)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in counts:
        batches = [(torch.randn(rows - (i == n - 1), 8, generator=g), torch.randint(0, 3, (rows - (i == n - 1),),
                                                                                   generator=g)) for i in range(n)]
        out.append(batches)
    return out


def run_workers(workers, batches):
    """Each replica's epoch loop in its own thread: steps (empty once its data ran out) until a
    step's result says no replica has another batch."""
    results = {r: [] for r in range(len(workers))}

    def body(rank):
        w, mine, i = workers[rank], batches[rank], 0
        while True:
            x, y = mine[i] if i < len(mine) else (None, None)
            res = w.step(x, y, more=i + 1 < len(mine))
            results[rank].append(res)
            i += 1
            if not res.go_on:
                return

    run_replicas(len(workers), body)
    return results


def local_steps(models, opts, batches, t):
    """Step t of each copy that has a batch t: its own SGD step. Returns each copy's rows."""
    rows = []
    for r, model in enumerate(models):
        if t < len(batches[r]):
            x, y = batches[r][t]
            opts[r].zero_grad()
            F.cross_entropy(model(x), y).backward()
            opts[r].step()
        rows.append(len(batches[r][t][1]) if t < len(batches[r]) else 0)
    return rows


def reference(base, batches, period, lr, momentum, outer_lr, outer_momentum):
    """p copies of the model, each stepping its own SGD on its own batches in turn; every
    `period` steps the rows-weighted mean move is applied to the global model (with Nesterov
    outer momentum when asked), and every copy takes it; the epoch ends at the first round
    after the last batch."""
    p = len(batches)
    models = [copy.deepcopy(base) for _ in range(p)]
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum) for m in models]
    center = parameters_to_vector(base.parameters()).detach().clone()
    outer_m = torch.zeros_like(center)
    rows = [0] * p
    longest, t = max(len(b) for b in batches), 0
    while True:
        for r, n in enumerate(local_steps(models, opts, batches, t)):
            rows[r] += n
        t += 1
        if t % period == 0:
            moves = [(parameters_to_vector(m.parameters()).detach() - center) * n for m, n in zip(models, rows)]
            if sum(rows):
                delta = sum(moves) / sum(rows)
                if outer_momentum:
                    outer_m = outer_momentum * outer_m - delta
                    center = center + outer_lr * delta - outer_lr * outer_momentum * outer_m
                else:
                    center = center + outer_lr * delta
            for m in models:
                vector_to_parameters(center.clone(), m.parameters())
            rows = [0] * p
            if t >= longest:
                return center


def workers_for(base, p, period, lr, momentum, outer_lr=1.0, outer_momentum=0.0):
    sums = ThreadSum(p)
    out = []
    for r in range(p):
        m = copy.deepcopy(base)
        out.append(LocalSgdWorker(m, torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum), sums.for_rank(r),
                                  period=period, outer_lr=outer_lr, outer_momentum=outer_momentum))
    return out


def flat(worker):
    return parameters_to_vector(worker.model.parameters()).detach()


def test_outer_step_is_averaging_or_nesterov_on_the_mean_move():
    c, delta = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0])
    plain = c.clone()
    outer_step(plain, None, delta, 1.0, 0.0)
    assert torch.equal(plain, c + delta)
    m, nest = torch.tensor([0.2, 0.0]), c.clone()
    outer_step(nest, m, delta, 0.7, 0.9)
    m_ref = 0.9 * torch.tensor([0.2, 0.0]) - delta  # the outer gradient is -delta
    assert torch.allclose(m, m_ref)
    assert torch.allclose(nest, c - 0.7 * (-delta + 0.9 * m_ref))


@pytest.mark.parametrize("outer_lr,outer_momentum", [(1.0, 0.0), (0.7, 0.9)])
def test_uneven_replicas_match_the_one_process_reference_and_end_identical(outer_lr, outer_momentum):
    base = model()
    batches = data([7, 5, 6])  # uneven: replicas whose data ran out take empty steps until the round
    workers = workers_for(base, 3, period=3, lr=0.1, momentum=0.9, outer_lr=outer_lr, outer_momentum=outer_momentum)
    results = run_workers(workers, batches)
    ref = reference(base, batches, 3, 0.1, 0.9, outer_lr, outer_momentum)
    assert len({len(r) for r in results.values()}) == 1  # lock-step: the same number of steps on every replica
    assert len(results[0]) == 9  # the first round after the last batch (step 7) is at step 9
    for w in workers:
        assert torch.allclose(flat(w), ref, atol=1e-6)
    assert sum(res.rows for res in results[0]) == sum(len(y) for _, y in batches[0])  # every row of its own once
    stats = workers[0].end_epoch()
    assert stats["rounds"] == 3 and stats["local_drift"] > 0


def test_period_one_without_momentum_is_allreduce_on_the_global_batch():
    base = model()
    batches = data([4, 4], rows=5)
    batches = [[(x[:5], y[:5]) for x, y in b] for b in batches]  # full batches: the mean of means is the mean
    workers = workers_for(base, 2, period=1, lr=0.2, momentum=0.0)
    run_workers(workers, batches)
    single = copy.deepcopy(base)
    opt = torch.optim.SGD(single.parameters(), lr=0.2)
    for t in range(4):
        x = torch.cat([batches[0][t][0], batches[1][t][0]])
        y = torch.cat([batches[0][t][1], batches[1][t][1]])
        opt.zero_grad()
        F.cross_entropy(single(x), y).backward()
        opt.step()
    for w in workers:
        assert torch.allclose(flat(w), parameters_to_vector(single.parameters()).detach(), atol=1e-6)


class FailOnce:
    """A one-replica reducer whose first collective fails (a peer died)."""

    def __init__(self):
        self.failed = False

    def start(self, tensor):
        if not self.failed:
            self.failed = True
            raise Interrupted("a peer died")
        return None

    def wait(self, handle):
        pass

    def broadcast(self, tensor):
        pass


def test_a_failed_round_moves_nothing_and_the_retried_step_does_not_train_the_batch_twice():
    base = model()
    (batches,) = data([2])
    plain = LocalSgdWorker(copy.deepcopy(base), None, ThreadSum(1).for_rank(0), period=2)
    plain.optimizer = torch.optim.SGD(plain.model.parameters(), lr=0.1)
    failing = LocalSgdWorker(copy.deepcopy(base), None, FailOnce(), period=2)
    failing.optimizer = torch.optim.SGD(failing.model.parameters(), lr=0.1)
    for w in (plain, failing):
        w.step(*batches[0], more=True)
    plain.step(*batches[1], more=False)
    before = flat(failing).clone()
    with pytest.raises(Interrupted):
        failing.step(*batches[1], more=False)  # trained, then the round failed
    assert failing.owed
    trained = flat(failing).clone()
    assert not torch.equal(trained, before)
    res = failing.step(*batches[1], more=False)  # the loop takes the same step again
    assert res.rows == 0 and not res.go_on  # only the round: the batch is not trained again
    assert torch.allclose(flat(failing), flat(plain), atol=1e-7)


def test_a_pause_takes_effect_at_the_next_round_with_every_replica_identical():
    base = model()
    batches = data([6, 6])
    workers = workers_for(base, 2, period=4, lr=0.1, momentum=0.9)
    seen = {0: [], 1: []}

    def body(rank):
        for i in range(6):
            x, y = batches[rank][i]
            res = workers[rank].step(x, y, more=True, pause=rank == 0 and i == 1)
            seen[rank].append(res.paused)
            if res.paused:
                return

    run_replicas(2, body)
    # rank 0 asked at step 2, the round at step 4 carried it: both stop after step 4
    assert seen[0] == [False, False, False, True] and seen[1] == [False, False, False, True]
    assert torch.equal(flat(workers[0]), flat(workers[1]))


def test_a_copy_of_a_replica_takes_its_global_model_and_outer_momentum_and_adds_no_move():
    base = model()
    w = workers_for(base, 1, period=2, lr=0.1, momentum=0.0, outer_lr=0.7, outer_momentum=0.9)[0]
    (batches,) = data([4])
    for x, y in batches:
        w.step(x, y, more=True)
    state = w.export()
    other = workers_for(base, 1, period=2, lr=0.1, momentum=0.0, outer_lr=0.7, outer_momentum=0.9)[0]
    other.load(state)
    assert torch.equal(other.center, w.center) and torch.equal(other.momentum, w.momentum)
    assert other.rows_since == 0


def test_balanced_periods_split_the_rounds_steps_by_speed_within_the_bounds():
    w = workers_for(model(), 2, period=8, lr=0.1, momentum=0.0)[0]
    w.balance = {"min_share": 0.25, "max_share": 4.0}
    w._rebalance([8, 0.8, 8, 2.4], 2, fresh=False)  # rank 1 takes 3x as long per step
    assert w.periods == [12, 4]  # 16 steps a round, in proportion to 10 and 3.33 steps/s
    w._rebalance([12, 1.3, 4, 0.4], 2, fresh=False)  # rank 1 back to full speed (3x: taken alone), rank 0
    assert w.speeds[1] == 10.0 and abs(w.speeds[0] - (10 + 12 / 1.3) / 2) < 1e-9  # 1.08x slower: halved
    assert w.periods == [8, 8]  # the straggler's end is followed in one round
    w._rebalance([8, 0.8, 8, 80.0], 2, fresh=False)
    assert w.periods[1] == 2  # at most 0.25 x 8 steps fewer: the bound holds the slow one
    w._rebalance([0, 0, 0, 0], 2, fresh=True)  # a new group: speeds from the old one are not used
    assert w.periods is None and w.my_period == 8


def test_a_slower_replica_takes_fewer_steps_a_round_and_all_end_identical():
    import time

    base = model()
    batches = data([30, 30])
    workers = workers_for(base, 2, period=4, lr=0.05, momentum=0.9)
    for w in workers:
        w.balance = {"min_share": 0.25, "max_share": 4.0}
    steps = {0: 0, 1: 0}

    def body(rank):
        w, mine, i = workers[rank], batches[rank], 0
        while True:
            x, y = mine[i] if i < len(mine) else (None, None)
            if rank == 1 and x is not None:
                time.sleep(0.02)  # a device 3x-or-more slower than the other
            res = w.step(x, y, more=i + 1 < len(mine))
            steps[rank] += x is not None
            i += 1
            if not res.go_on:
                return

    run_replicas(2, body)
    assert workers[0].periods == workers[1].periods  # both computed the same split from the same sums
    fast, slow = workers[0].periods
    assert fast + slow == 8 and fast > slow
    assert torch.equal(flat(workers[0]), flat(workers[1]))
    assert steps == {0: 30, 1: 30}  # every batch trained once (the fast one waited with empty steps at the end)


def test_balanced_periods_stay_even_for_speeds_a_little_apart():
    """Speeds 1.15x apart (what timing noise alone shows on a shared host) keep the period of
    every replica: a 9 / 7 split would make each round wait for the 9."""
    w = workers_for(model(), 2, period=8, lr=0.1, momentum=0.0)[0]
    w.balance = {"min_share": 0.25, "max_share": 4.0}
    w._rebalance([8, 0.8, 8, 0.92], 2, fresh=False)
    assert w.periods == [8, 8] and w.my_period == 8
    w._rebalance([8, 0.8, 8, 2.4], 2, fresh=False)  # then 3x (a change, taken alone): balanced
    assert w.periods[0] > w.periods[1]


def test_balanced_local_sgd_leases_pinned_while_the_periods_are_even():
    """With no straggler balanced local SGD leases as plain local SGD (the same data on the same
    replica); uneven periods share one queue, the faster replica reading more partitions."""
    from policies.rules.registry import mode_spec

    spec = mode_spec("local_sgd")
    balanced = {"mode": "local_sgd", "period": 8, "balance": True}
    assert spec.balanced_share == "period"
    assert spec.leases_pinned(balanced) and spec.leases_pinned(balanced, [8, 8])
    assert not spec.leases_pinned(balanced, [11, 5])
    w = workers_for(model(), 2, period=8, lr=0.1, momentum=0.0)[0]
    assert w.balanced_period is None  # plain: its rows carry no period
    w.balance = {"min_share": 0.25, "max_share": 4.0}
    w._rebalance([8, 0.8, 8, 2.4], 2, fresh=False)
    assert w.balanced_period == w.periods[0] == 12
