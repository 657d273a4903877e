"""Backup replicas (policies/backup.py) against a one-process reference, without Ray: threads
stand in for replicas (tests/unit/test_allreduce_rule.py's ThreadSum), a straggler's delay
waits until the step has its gradients, and each step must equal one process training on the
batches of the replicas that were in time."""
import time

import numpy as np
import pytest
import torch

from policies.backup import BackupGate, LocalArrivals, quorum
from tests.unit.test_allreduce_rule import flat, lock_step_replicas, reference_training


def batch(rng, rows):
    return torch.from_numpy(rng.normal(size=(rows, 8)).astype(np.float32)), torch.from_numpy(rng.integers(0, 3, rows))


def wait_until_late(busy_s, late):
    """A straggler far slower than the others: its delay ends only once it is late (at most 10 s)."""
    end = time.monotonic() + 10
    while not late():
        assert time.monotonic() < end, "the step never got its gradients without the straggler"
        time.sleep(0.002)


def test_quorum_is_the_holders_less_the_backups_and_at_least_one():
    assert [quorum(h, 1) for h in (1, 2, 3, 4)] == [1, 1, 2, 3]
    assert quorum(4, 0) == 4 and quorum(2, 5) == 1


def test_gates_agree_on_their_round_and_the_first_arrivals_are_in_time():
    arrivals = LocalArrivals()
    first = [BackupGate(1, arrivals, 3, r) for r in range(3)]
    again = [BackupGate(1, arrivals, 3, r) for r in range(3)]  # a regroup: every member starts a gate again
    assert {g.round for g in first} == {0} and {g.round for g in again} == {1}
    for g in again:
        g.begin()
    assert not again[2].late()
    assert again[0].arrive() and again[1].arrive()  # 2 of 3 needed
    assert again[2].late() and not again[2].arrive()
    assert not first[0].late()  # another round's counter: untouched


def test_each_step_applies_the_first_gradients_and_the_straggler_drops_its_own():
    """3 replicas, one backup, rank 2 a straggler: every step is SGD on ranks 0 and 1's batches,
    all three replicas identical, and rank 2 counts every one of its batches dropped."""
    rng = np.random.default_rng(3)
    steps = 4
    data = [[batch(rng, 5) for _ in range(steps)] for _ in range(3)]
    ends = {}
    models, taken, _ = lock_step_replicas(data, backups=1, straggle={2: wait_until_late}, ends=ends)
    ref, _ = reference_training([[data[0][s], data[1][s]] for s in range(steps)])
    for m in models:
        assert torch.equal(flat(m), flat(models[0]))
    torch.testing.assert_close(flat(models[0]), flat(ref), rtol=1e-5, atol=1e-6)
    assert set(taken.values()) == {steps}
    assert ends[2] == {"dropped_steps": steps, "dropped_rows": 5 * steps}
    assert ends[0] == ends[1] == {"dropped_steps": 0, "dropped_rows": 0}


def test_the_quorum_follows_the_replicas_still_holding_a_batch():
    """Rank 1 holds one batch, ranks 0 and 2 three; rank 2 straggles. Step 1: three hold a batch,
    the first two count (0 and 1); steps 2 and 3: two hold one, so the first one counts (0)."""
    rng = np.random.default_rng(4)
    data = [[batch(rng, 4), batch(rng, 4), batch(rng, 3)], [batch(rng, 6)], [batch(rng, 4) for _ in range(3)]]
    ends = {}
    models, taken, _ = lock_step_replicas(data, backups=1, straggle={2: wait_until_late}, ends=ends)
    ref, _ = reference_training([[data[0][0], data[1][0]], [data[0][1]], [data[0][2]]])
    assert taken == {0: 3, 1: 3, 2: 3}
    for m in models:
        assert torch.equal(flat(m), flat(models[0]))
    torch.testing.assert_close(flat(models[0]), flat(ref), rtol=1e-5, atol=1e-6)
    assert ends[2] == {"dropped_steps": 3, "dropped_rows": 12}


@pytest.mark.parametrize("p", [2, 3])
def test_with_backups_every_step_applies_exactly_the_quorum(p):
    """No straggler: who is in time is a race, but every step applies the gradients of exactly
    p - 1 replicas, and the replicas stay identical."""
    rng = np.random.default_rng(5)
    steps = 6
    data = [[batch(rng, 4) for _ in range(steps)] for _ in range(p)]
    ends = {}
    models, _, _ = lock_step_replicas(data, backups=1, ends=ends)
    for m in models:
        assert torch.equal(flat(m), flat(models[0]))
    assert sum(e["dropped_steps"] for e in ends.values()) == steps
