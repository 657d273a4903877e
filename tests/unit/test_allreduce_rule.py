"""The allreduce update rule against a plain single-process reference, without Ray: p threads
stand in for p replicas and meet at a barrier that sums their buckets."""
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from examples.models import tiny_mlp
from policies.allreduce import GradientBuckets, allreduce_step, steps_per_partition


class ThreadSum:
    """reduce_sum_ for p threads: each contributes its buffers; all get the elementwise sum."""

    def __init__(self, p: int):
        self.p, self.barrier, self.slots = p, threading.Barrier(p), {}

    def for_rank(self, rank):
        outer = self

        class Reducer:  # buckets start in the same order on every rank, so a barrier pairs them
            def start(self, tensor):
                outer.slots[rank] = tensor.clone()
                outer.barrier.wait()
                total = sum(outer.slots[r] for r in range(outer.p))
                outer.barrier.wait()
                tensor.copy_(total)

            def wait(self, handle):
                pass

        return Reducer()


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


@pytest.mark.parametrize("p", [1, 2, 3])
def test_replicas_match_single_process_reference(p):
    rng = np.random.default_rng(0)
    steps = 5
    xs = torch.from_numpy(rng.normal(size=(steps, p, 4, 8)).astype(np.float32))
    ys = torch.from_numpy(rng.integers(0, 3, size=(steps, p, 4)))

    models = [make() for _ in range(p)]
    reducer = ThreadSum(p)
    losses = {}

    def replica(rank):
        m, opt = models[rank]
        buckets = GradientBuckets.attach(list(m.parameters()), bucket_bytes=256)
        red = reducer.for_rank(rank)
        losses[rank] = [allreduce_step(m, opt, buckets, xs[s, rank], ys[s, rank], p, red)[0] for s in range(steps)]

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(p)]
    [t.start() for t in threads]
    [t.join() for t in threads]

    ref, ref_opt = make()
    ref_losses = []
    for s in range(steps):
        grads, ls = [], []
        for r in range(p):
            ref.zero_grad()
            loss = F.cross_entropy(ref(xs[s, r]), ys[s, r])
            loss.backward()
            grads.append([q.grad.clone() for q in ref.parameters()])
            ls.append(loss.item())
        for i, q in enumerate(ref.parameters()):
            q.grad = sum(g[i] for g in grads) / p
        ref_opt.step()
        ref_losses.append(sum(ls) / p)

    flat = lambda m: torch.cat([q.detach().reshape(-1) for q in m.parameters()])
    for m, _ in models:
        assert torch.equal(flat(m), flat(models[0][0]))  # identical across replicas
        torch.testing.assert_close(flat(m), flat(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses[0], ref_losses, rtol=1e-5)


def test_ragged_end():
    assert steps_per_partition([2000, 1999], 64) == 31
    with pytest.raises(ValueError, match="fewer than one batch"):
        steps_per_partition([10, 100], 64)
