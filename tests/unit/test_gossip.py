"""Gossip (decentralized SGD) against a plain one-process reference, without Ray: p threads
stand in for p replicas; their rounds meet at a barrier that sums the flags and hands each
replica its ring neighbours' models."""
import copy

import pytest
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from policies.rules.gossip import GossipWorker, gossip_metrics, ring_neighbours
from policies.messages import SegmentEnd
from tests.unit.test_allreduce_rule import ThreadSum
from tests.unit.test_local_sgd import data, local_steps, model, run_workers


def test_ring_neighbours():
    assert ring_neighbours(0, 1) == []
    assert ring_neighbours(0, 2) == [1] and ring_neighbours(1, 2) == [0]
    assert ring_neighbours(0, 4) == [1, 3] and ring_neighbours(2, 4) == [1, 3] and ring_neighbours(1, 3) == [0, 2]


def reference(base, batches, period, lr, momentum):
    """p copies of the model, each stepping its own SGD on its own batches in turn; every
    `period` steps a round: each copy takes the mean of itself and its ring neighbours, or,
    at the round where no copy has another batch (the epoch's end), the mean of all copies."""
    p = len(batches)
    models = [copy.deepcopy(base) for _ in range(p)]
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum) for m in models]
    t = 0
    while True:
        local_steps(models, opts, batches, t)
        t += 1
        if t % period:
            continue
        more = any(t < len(b) for b in batches)
        with torch.no_grad():
            xs = [parameters_to_vector(m.parameters()).detach().clone() for m in models]
            for r, m in enumerate(models):
                if more:
                    new = torch.stack([xs[r], *(xs[q] for q in ring_neighbours(r, p))]).mean(dim=0)
                else:
                    new = torch.stack(xs).mean(dim=0)
                vector_to_parameters(new, m.parameters())
        if not more:
            return models


@pytest.mark.parametrize("p,period,counts", [(2, 1, [5, 5]), (3, 2, [6, 4, 5]), (4, 3, [7, 7, 5, 6])])
def test_gossip_equals_the_one_process_reference(p, period, counts):
    base = model()
    batches = data(counts)
    sums = ThreadSum(p)
    workers = []
    for r in range(p):
        m = copy.deepcopy(base)
        workers.append(GossipWorker(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), sums.for_rank(r),
                                    period=period))
    results = run_workers(workers, batches)
    ref = reference(base, batches, period, lr=0.1, momentum=0.9)
    for r in range(p):
        torch.testing.assert_close(parameters_to_vector(workers[r].model.parameters()),
                                   parameters_to_vector(ref[r].parameters()), rtol=1e-5, atol=1e-6)
    flats = [parameters_to_vector(w.model.parameters()) for w in workers]
    assert all(torch.equal(f, flats[0]) for f in flats)  # the epoch's last round is a consensus
    stats = [w.end_epoch() for w in workers]
    assert all(s["rounds"] == len(results[0]) // period + (len(results[0]) % period > 0) for s in stats)
    assert all(s["consensus_distance"] > 0 for s in stats)  # the replicas had drifted apart by then


def test_gossip_metrics_combine_the_replicas():
    def end(rank, distance, rounds, train_s):
        return SegmentEnd("epoch", rank, 1, 10, 100, train_s, 0.1, [], 0.5, [], 10, "gossip",
                          mode={"rounds": rounds, "consensus_distance": distance})

    got = gossip_metrics([end(0, 0.2, 10, 2.0), end(1, 0.4, 10, 4.0)])
    assert got == pytest.approx({"consensus_distance": 0.3, "rounds_per_s": 2.5})
