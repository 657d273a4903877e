"""faults.link_gbps: collectives held to an emulated link's time (a real one-member gloo group)."""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from actors.replica.reducer import EmulatedLink, ProcessGroupReducer


def test_a_transfer_takes_the_ring_traffic_over_the_bandwidth_and_queues_behind_the_last():
    link = EmulatedLink(gbps=1.0, latency_us=100)
    # 4 replicas, 1 MB: a ring sends 2 (p - 1) / p of it over each link
    assert link.seconds(10**6, 4) == pytest.approx(1e-4 + 1.5 * 8e6 / 1e9)
    assert link.seconds(10**6, 1) == pytest.approx(1e-4)  # alone: nothing crosses the link
    t0 = time.perf_counter()
    first = link.reserve(10**6, 2)
    second = link.reserve(10**6, 2)
    assert first >= t0 + link.seconds(10**6, 2)
    assert second == pytest.approx(first + link.seconds(10**6, 2))  # one link: the second waits for the first


def test_every_collective_on_a_paced_reducer_lasts_at_least_the_links_time():
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
    reducer = ProcessGroupReducer(EmulatedLink(gbps=100.0, latency_us=30_000))
    reducer.configure(None, pg, 10.0)
    t = torch.ones(1000)
    t0 = time.perf_counter()
    reducer.wait(reducer.start(t))
    reducer.wait(reducer.start(t))
    reducer.broadcast(t)
    assert time.perf_counter() - t0 >= 3 * 0.03
    assert torch.equal(t, torch.ones(1000))  # the sum of one member: the values are untouched
