"""The allreduce update rule against a plain single-process reference, without Ray: p threads
stand in for p replicas and meet at a barrier that sums their buckets (or hands out rank 0's)."""
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from examples.models import tiny_mlp
from policies.rules.allreduce import AllReduceWorker
from policies.rules.buckets import GradientBuckets
from policies.rules.backup import LocalArrivals


class ThreadSum:
    """reduce_sum_ for p threads: each contributes its buffers; all get the elementwise sum."""

    def __init__(self, p: int):
        self.p, self.barrier, self.slots = p, threading.Barrier(p), {}
        self.counters = LocalArrivals()  # the group store's counters (backup replicas)

    def for_rank(self, rank):
        outer = self

        class Reducer:  # buckets start in the same order on every rank, so a barrier pairs them
            def group(self):
                return rank, outer.p

            def start(self, tensor):
                outer.slots[rank] = tensor.clone()
                outer.barrier.wait()
                total = sum(outer.slots[r] for r in range(outer.p))
                outer.barrier.wait()
                tensor.copy_(total)

            def wait(self, handle):
                pass

            def arrivals(self):
                return outer.counters

            def broadcast(self, tensor):
                outer.slots[rank] = tensor.clone()
                outer.barrier.wait()
                root = outer.slots[0]
                outer.barrier.wait()
                tensor.copy_(root)

            def exchange(self, tensor, peers):  # every rank posts its tensor; each takes its peers'
                outer.slots[rank] = tensor.clone()
                outer.barrier.wait()
                got = [outer.slots[p].clone() for p in peers]
                outer.barrier.wait()
                return got

        return Reducer()


def run_replicas(p, body):
    """body(rank) in p threads (the replicas); re-raises the first failure."""
    errors = []

    def target(rank):
        try:
            body(rank)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(p)]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]
    if errors:
        raise errors[0]


def make(seed=0, momentum=0.9):
    torch.manual_seed(seed)
    m = tiny_mlp(in_features=8, hidden=16, num_classes=3)
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum)


def test_buckets_are_views_in_backward_order_and_split_by_size():
    m, _ = make()
    params = list(m.parameters())
    b = GradientBuckets.attach(params, bucket_bytes=200)
    assert len(b.buffers) > 1
    assert b.numel == sum(p.numel() for p in params)
    b.buffers[0].fill_(3.0)
    assert torch.all(params[-1].grad == 3.0)  # the first bucket holds the last layer's grads
    assert sum(b.members) == len(params)


def test_a_bucket_starts_during_backward_once_its_grads_are_in():
    from examples.models import mnist_cnn

    model = mnist_cnn()
    buckets = GradientBuckets.attach(list(model.parameters()), bucket_bytes=25 * 2**20)
    assert len(buckets.buffers) == 2  # [fc2, fc1] closes at 1 MiB; the convs follow
    started = []

    class Recorder:
        def start(self, tensor):
            # conv1's grad is still unset when the fc bucket leaves: it overlaps the conv backward
            started.append(float(model[0].weight.grad.abs().sum()))

        def wait(self, handle):
            pass

    buckets.begin_step(Recorder())
    F.cross_entropy(model(torch.randn(4, 1, 28, 28)), torch.tensor([0, 1, 2, 3])).backward()
    buckets.finish_step()
    assert len(started) == 2 and started[0] == 0.0 and started[1] > 0.0


flat = lambda m: torch.cat([q.detach().reshape(-1) for q in m.parameters()])  # noqa: E731


def reference_training(batches_by_step, momentum=0.9):
    """One process: each step, the mean gradient over the union of that step's batches."""
    ref, ref_opt = make(momentum=momentum)
    losses = []
    for step in batches_by_step:
        x = torch.cat([b[0] for b in step])
        y = torch.cat([b[1] for b in step])
        ref.zero_grad()
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        ref_opt.step()
        losses.append(loss.item())
    return ref, losses


def lock_step_replicas(data, momentum=0.9, backups=0, straggle=None, ends=None, setup=None):
    """data[rank] = that replica's batches for the epoch (any number, any sizes). Each replica
    runs the worker's lock-step loop (empty steps once its data ran out). Returns the models,
    the steps each took and the losses each saw. `backups`: the workers' backup replicas;
    `straggle`: {rank: the worker's straggle}; `ends`: a dict that receives each rank's
    end_epoch stats; `setup`: {rank: f(rank, worker)} called once the worker is built."""
    p = len(data)
    models = [make(momentum=momentum) for _ in range(p)]
    reducer = ThreadSum(p)
    steps, losses = {}, {}

    def replica(rank):
        m, opt = models[rank]
        worker = AllReduceWorker(m, opt, 256, reducer.for_rank(rank), backups=backups)
        worker.straggle = (straggle or {}).get(rank)
        if rank in (setup or {}):
            setup[rank](rank, worker)
        batches, n, seen = list(data[rank]), 0, []
        while True:
            x, y = batches.pop(0) if batches else (None, None)
            result = worker.step(x, y, bool(batches))
            n += 1
            seen.append(result.loss)
            if not result.go_on:
                break
        stats = worker.end_epoch()
        if ends is not None:
            ends[rank] = stats
        steps[rank], losses[rank] = n, seen

    run_replicas(p, replica)
    return [m for m, _ in models], steps, losses


@pytest.mark.parametrize("p", [1, 2, 3])
def test_replicas_match_single_process_reference(p):
    rng = np.random.default_rng(0)
    n_steps = 5
    data = [[(torch.from_numpy(rng.normal(size=(4, 8)).astype(np.float32)), torch.from_numpy(rng.integers(0, 3, 4)))
             for _ in range(n_steps)] for _ in range(p)]
    models, steps, losses = lock_step_replicas(data)
    ref, ref_losses = reference_training([[data[r][s] for r in range(p)] for s in range(n_steps)])
    for m in models:
        assert torch.equal(flat(m), flat(models[0]))  # identical across replicas
        torch.testing.assert_close(flat(m), flat(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses[0], ref_losses, rtol=1e-5)
    assert set(steps.values()) == {n_steps}


def test_uneven_data_every_row_used_in_lock_step_weighted_by_rows():
    """Replica 0 holds 4 batches (the last short), replica 1 one batch: both take 4 steps (1's
    last 3 empty), never wait at a collective the other skips, and the update of every step is
    the mean gradient over exactly the rows seen in it: one process on the union equals it."""
    rng = np.random.default_rng(1)

    def batch(rows):
        return torch.from_numpy(rng.normal(size=(rows, 8)).astype(np.float32)), torch.from_numpy(rng.integers(0, 3, rows))

    data = [[batch(6), batch(6), batch(6), batch(2)], [batch(5)]]
    models, steps, _ = lock_step_replicas(data)
    assert steps == {0: 4, 1: 4}
    ref, _ = reference_training([[data[0][0], data[1][0]], [data[0][1]], [data[0][2]], [data[0][3]]])
    assert torch.equal(flat(models[0]), flat(models[1]))
    torch.testing.assert_close(flat(models[0]), flat(ref), rtol=1e-5, atol=1e-6)


def test_a_replica_with_no_data_joins_until_the_others_are_done():
    rng = np.random.default_rng(2)
    data = [[(torch.from_numpy(rng.normal(size=(3, 8)).astype(np.float32)), torch.from_numpy(rng.integers(0, 3, 3)))
             for _ in range(2)], []]
    models, steps, _ = lock_step_replicas(data)
    assert steps == {0: 2, 1: 2}
    ref, _ = reference_training([[d] for d in data[0]])
    torch.testing.assert_close(flat(models[1]), flat(ref), rtol=1e-5, atol=1e-6)


def test_a_non_finite_loss_stops_every_replica_before_the_step_is_applied():
    p = 2
    models = [make() for _ in range(p)]
    for m, opt in models:
        for group in opt.param_groups:
            group["lr"] = 1e30
    before = [flat(m).clone() for m, _ in models]
    reducer = ThreadSum(p)
    raised = {}
    x = torch.full((4, 8), float("nan"))
    y = torch.tensor([0, 1, 2, 0])

    def replica(rank):
        m, opt = models[rank]
        worker = AllReduceWorker(m, opt, 256, reducer.for_rank(rank))
        try:
            worker.step(x, y, False)
        except FloatingPointError as exc:
            raised[rank] = str(exc)

    run_replicas(p, replica)
    assert set(raised) == {0, 1} and "loss is" in raised[0]
    for (m, _), b in zip(models, before):
        assert torch.equal(flat(m), b)  # not applied


def test_buffers_follow_rank_0_like_ddp_broadcast_buffers():
    """BatchNorm: every replica's running statistics equal rank 0's after the epoch, and rank
    0's are what one replica seeing only its own batches would have."""
    p = 2
    rng = np.random.default_rng(3)

    def bn_model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    models = [bn_model() for _ in range(p)]
    data = [[(torch.from_numpy(rng.normal(loc=r * 3.0, size=(8, 8)).astype(np.float32)), torch.from_numpy(rng.integers(0, 3, 8)))
             for _ in range(3)] for r in range(p)]
    reducer = ThreadSum(p)

    def replica(rank):
        m, opt = models[rank]
        worker = AllReduceWorker(m, opt, 256, reducer.for_rank(rank))
        for i, (x, y) in enumerate(data[rank]):
            worker.step(x, y, i < 2)
        worker.end_epoch()

    run_replicas(p, replica)
    bufs = [dict(m.named_buffers()) for m, _ in models]
    for name in bufs[0]:
        assert torch.equal(bufs[0][name], bufs[1][name]), name
    assert int(bufs[0]["1.num_batches_tracked"]) == 3
