"""hogwild's rule without Ray: replicas whose parameters are views into one shared-memory vector
(a memfd, as the shard keeps it) write their steps into it in place; in turn they equal one
process taking the same batches in the same order; at once, from separate processes and with no
lock, they still solve a least-squares problem; a replica that cannot map it pushes and pulls."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from orchestrator.config import JobConfig
from orchestrator.errors import ConfigError
from policies.rules.downpour import DownpourWorker
from policies.rules.hogwild import HogwildWorker, process_alive
from policies.rules.sharding import FlatParams, ShardState
from tests.unit.local_shards import LocalShardClient


_FDS: list[int] = []


@pytest.fixture(autouse=True)
def _close_memfds():
    yield
    while _FDS:
        os.close(_FDS.pop())


def memfd_vector(values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The vector in an anonymous memory file, as ParameterShard.mapping keeps it: (mapping, fd);
    the fd is closed after the test (the mapping outlives it)."""
    fd = os.memfd_create("test-hogwild")
    _FDS.append(fd)
    os.ftruncate(fd, 4 * values.numel())
    mapped = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=values.numel(), dtype=torch.float32)
    mapped.copy_(values)
    return mapped, fd


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(12, 8, generator=g), torch.randint(0, 3, (12,), generator=g)) for _ in range(n)]


def worker(net: torch.nn.Module, share, lr: float = 0.1, remote=None) -> HogwildWorker:
    flat = FlatParams(list(net.parameters()))
    return HogwildWorker(net, flat, torch.optim.SGD(net.parameters(), lr=lr), share, remote)


def test_replicas_in_turn_equal_one_process_taking_their_batches_in_that_order():
    reference = model()
    start = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    shared, fd = memfd_vector(start)
    view = lambda: (torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=start.numel(), dtype=torch.float32),
                    os.getpid())
    a, b = worker(model(5), view), worker(model(6), view)  # their own initial values are replaced by the vector's
    assert a.holds_reference and b.holds_reference
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for i, (x, y) in enumerate(batches(10)):
        (a if i % 2 == 0 else b).step(x, y)
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        opt.step()
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    torch.testing.assert_close(shared, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in a.model.parameters()]), expected,
                               rtol=0, atol=1e-6)
    assert a.end_epoch()["direct_steps"] == 5 and b.end_epoch()["direct_steps"] == 5

    a.release()  # a phase switch: a's parameters are its own copy now, the next mode's steps leave the vector alone
    before = shared.clone()
    with torch.no_grad():
        for p in a.model.parameters():
            p.add_(1.0)
    assert torch.equal(shared, before) and not a.holds_reference


def test_a_shard_keeps_its_values_and_optimizer_state_when_shared():
    state = ShardState(torch.arange(6, dtype=torch.float32), "sgd", lr=0.5, momentum=0.9)
    state.apply_gradient(torch.ones(6), 0)
    expected = state.snapshot()
    mapped, fd = memfd_vector(torch.zeros(6))
    state.share(mapped)
    torch.testing.assert_close(mapped, torch.tensor(expected["values"]))
    other = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=6, dtype=torch.float32)
    state.apply_gradient(torch.ones(6), 1)  # the second step uses the momentum the first left
    assert torch.equal(other, state.values)
    reference = ShardState.from_snapshot(expected)
    reference.apply_gradient(torch.ones(6), 1)
    torch.testing.assert_close(other, reference.values)


def test_a_replica_that_cannot_map_the_vector_pushes_and_pulls_every_step():
    net = model()
    start = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    client = LocalShardClient(start, shards=1, optimizer="sgd", lr=0.1)
    flat = FlatParams(list(net.parameters()))
    remote = DownpourWorker(net, flat, client, 0, lr=0.1)
    w = HogwildWorker(net, flat, torch.optim.SGD(net.parameters(), lr=0.1), lambda: None, remote)
    assert not w.holds_reference
    reference = model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in batches(4):
        w.step(x, y)
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        opt.step()
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    torch.testing.assert_close(client.values(), expected, rtol=0, atol=1e-6)
    stats = w.end_epoch()
    assert stats["direct_steps"] == 0 and stats["pushes"] == 4


def lost_holder():
    """A worker bound to a vector whose holder is gone, and the vector its successor hands out
    (the rebuilt shard restored an older snapshot: zeros here)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert not process_alive(gone.pid) and process_alive(os.getpid())
    start = torch.cat([p.detach().reshape(-1) for p in model().parameters()])
    old, _ = memfd_vector(start)
    new, _ = memfd_vector(start * 0)
    handed = iter([(old, gone.pid), (new, os.getpid())])
    return worker(model(), lambda: next(handed)), start, old, new


def test_a_lost_holder_is_noticed_and_the_successors_vector_mapped():
    w, start, old, new = lost_holder()
    x, y = batches(1)[0]
    w.step(x, y)  # the holder is found gone before the step: the step goes into the new vector
    assert torch.equal(old, start) and not torch.equal(new, start * 0)
    assert w.end_epoch()["remaps"] == 1


def test_a_lost_holder_is_noticed_before_an_evaluation_or_a_checkpoint_reads_the_model():
    w, start, old, new = lost_holder()
    assert w.holds_reference  # asked before evaluating: the orphaned vector let go of, the successor's mapped
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in w.model.parameters()]), new)
    assert w.remaps == 1


SOLVE = """
import sys, time, torch
torch.set_num_threads(1)
path, n, seed, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
a = torch.randn(256, n)
b = a @ torch.linspace(-1, 1, n)
shared = torch.from_file(path, shared=True, size=n + 4, dtype=torch.float32)
x, flags = shared[:n], shared[n:]
flags[seed] = 1.0  # ready; then all start together when the parent says go
while flags[3] == 0:
    time.sleep(0.001)
g = torch.Generator().manual_seed(seed)
for _ in range(steps):
    rows = torch.randint(0, 256, (8,), generator=g)
    x.sub_(0.02 * (a[rows].T @ (a[rows] @ x - b[rows]) / 8))
"""  # one process's SGD on 0.5 |A x - b|^2, rows from its own seed, writing the shared x with no lock


def test_processes_writing_one_vector_at_once_without_locks_solve_least_squares():
    n = 32
    shared, fd = memfd_vector(torch.zeros(n + 4))  # x, then three ready flags and a go flag
    x, flags = shared[:n], shared[n:]
    path = f"/proc/{os.getpid()}/fd/{fd}"
    procs = [subprocess.Popen([sys.executable, "-c", SOLVE, path, str(n), str(seed), "20000"]) for seed in range(3)]
    try:
        deadline = time.monotonic() + 120
        while not bool((flags[:3] == 1).all()) and time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.01)
        flags[3] = 1.0  # every process steps at once from here
        assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    torch.testing.assert_close(x, torch.linspace(-1, 1, n), rtol=0, atol=1e-2)


@pytest.mark.parametrize("overrides, message", [
    (["strategy.mode=hogwild", "scaling.shards=2"], "scaling.shards: hogwild keeps the whole parameter vector in one shard"),
    (["strategy.mode=hogwild", "optimizer.name=adafactor"], "hogwild's shards apply the optimizer to their slices, and adafactor"),
])
def test_hogwild_configs_that_cannot_work_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        JobConfig.from_dict({}, overrides)
