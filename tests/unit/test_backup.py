"""Backup replicas (policies/rules/backup.py) against a one-process reference, without Ray: threads
stand in for replicas (tests/unit/test_allreduce_rule.py's ThreadSum), a straggler's delay
waits until the step has its gradients, and each step must equal one process training on the
batches of the replicas that were in time."""
import time

import numpy as np
import pytest
import torch

from policies.rules.backup import BackupGate, LocalArrivals, quorum
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


def test_a_late_replica_stops_its_backward_pass_where_it_learns_it():
    """The straggler is slow inside its backward pass (a hook on its last layer waits until the
    step has its gradients): the pass stops at the next gradient to land, so its first layer's
    gradient is never computed, and the step is still the in-time replicas' SGD."""
    rng = np.random.default_rng(6)
    steps = 3
    data = [[batch(rng, 5) for _ in range(steps)] for _ in range(3)]
    reached_first_layer = []
    holders = {}

    def slow_backward(rank, worker):
        model = worker.model
        layers = [p for p in model.parameters()]
        layers[-1].register_hook(lambda g: (wait_until_late(0.0, worker.gate.late), g)[1])
        layers[0].register_hook(lambda g: (reached_first_layer.append(rank), g)[1])
        holders[rank] = worker

    ends = {}
    models, _, _ = lock_step_replicas(data, backups=1, ends=ends, setup={2: slow_backward})
    ref, _ = reference_training([[data[0][s], data[1][s]] for s in range(steps)])
    for m in models:
        assert torch.equal(flat(m), flat(models[0]))
    torch.testing.assert_close(flat(models[0]), flat(ref), rtol=1e-5, atol=1e-6)
    assert ends[2]["dropped_steps"] == steps and 2 not in reached_first_layer


def test_a_new_generation_of_the_group_counts_in_its_own_store():
    """A regroup (a new process group, its own store) at the same ranks and size: every member
    starts a gate in the new store, so the step after it is decided there."""
    from tests.unit.test_allreduce_rule import ThreadSum, make, run_replicas
    from policies.rules.allreduce import AllReduceWorker

    rng = np.random.default_rng(7)
    data = [[batch(rng, 4) for _ in range(4)] for _ in range(3)]
    models = [make() for _ in range(3)]
    group = ThreadSum(3)
    reducers = [group.for_rank(r) for r in range(3)]
    old, new = group.counters, LocalArrivals()

    def replica(rank):
        m, opt = models[rank]
        worker = AllReduceWorker(m, opt, 256, reducers[rank], backups=1)
        worker.straggle = wait_until_late if rank == 2 else None
        for step in range(4):
            if step == 2:  # the regroup: a new group and store, the same ranks
                group.barrier.wait()
                reducers[rank].pg = object()
                group.counters = new
                group.barrier.wait()
            x, y = data[rank][step]
            worker.step(x, y, step < 3)

    run_replicas(3, replica)
    assert old.counts["backup-rounds"] == 3 and new.counts["backup-rounds"] == 3
    assert any(k.startswith("backup/0/") for k in new.counts)
    ref, _ = reference_training([[data[0][s], data[1][s]] for s in range(4)])
    torch.testing.assert_close(flat(models[2][0]), flat(ref), rtol=1e-5, atol=1e-6)


def test_drops_of_a_segment_paused_for_a_grow_count_in_the_epoch():
    from orchestrator.control.epoch_record import EpochRecord

    from policies.messages import SegmentEnd

    def seg(kind, mode, drops):
        return SegmentEnd(kind, rank=1, epoch=3, steps=5, samples=40, train_s=1.0, comm_s=0.1, consumed=[], loss=0.5,
                          progress=[], step=0, mode_name=mode, mode={"dropped_steps": drops, "dropped_rows": 8 * drops})

    record = EpochRecord(items=[seg("paused", "allreduce", 2), seg("epoch", "allreduce", 3)])
    [row] = record.merged()
    assert row.mode == {"dropped_steps": 5, "dropped_rows": 40} and row.steps == 10 and row.kind == "epoch"
    other = EpochRecord(items=[seg("paused", "local_sgd", 2), seg("epoch", "allreduce", 3)])
    assert other.merged()[0].mode["dropped_steps"] == 3  # another mode's segment: not this mode's figure
    with pytest.raises(ValueError, match="segment ends as one of"):
        seg("finished", "allreduce", 0)
