"""The partition ledger: every partition exactly once per epoch, whoever is fast or dies."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.decisions.leases import Grant, MAX_GRANT, PartitionLedger, first_grants, grant_size


def run_epoch(ledger, epoch, speeds):
    """Replicas lease in proportion to their speed until nothing is left; returns served partitions."""
    ledger.start_epoch(epoch)
    served = []
    active = list(speeds)
    while active:
        for rank in list(active):
            for _ in range(speeds[rank]):
                lease = ledger.lease(rank)
                if lease is None:
                    active.remove(rank)
                    break
                ledger.complete(rank, lease.partition)
                served.append((rank, lease.partition))
    return served


@settings(max_examples=60, deadline=None)
@given(parts=st.integers(1, 40), replicas=st.integers(1, 5), seed=st.integers(0, 10))
def test_shared_every_partition_once_and_fast_replicas_take_more(parts, replicas, seed):
    ledger = PartitionLedger(parts, replicas, seed)
    speeds = {r: r + 1 for r in range(replicas)}  # rank r is r+1 times as fast as rank 0
    for epoch in (1, 2):
        served = run_epoch(ledger, epoch, speeds)
        assert sorted(p for _, p in served) == list(range(parts))
        assert ledger.epoch_complete
    counts = [sum(1 for r, _ in served if r == k) for k in range(replicas)]
    if replicas >= 2 and parts >= 10 * replicas:
        assert counts[-1] > counts[0]  # load balancing falls out of leasing


def test_order_reshuffles_each_epoch_and_is_reproducible():
    a, b = PartitionLedger(20, 1, seed=3), PartitionLedger(20, 1, seed=3)
    e1 = [p for _, p in run_epoch(a, 1, {0: 1})]
    assert e1 == [p for _, p in run_epoch(b, 1, {0: 1})]
    assert e1 != [p for _, p in run_epoch(a, 2, {0: 1})]


def test_pinned_gives_every_replica_the_same_count():
    ledger = PartitionLedger(12, 3, seed=0, pinned=True)
    served = run_epoch(ledger, 1, {0: 5, 1: 1, 2: 1})
    assert [sum(1 for r, _ in served if r == k) for k in range(3)] == [4, 4, 4]


@pytest.mark.parametrize("pinned", [False, True])
def test_a_dead_replicas_leases_are_served_again_and_reported(pinned):
    ledger = PartitionLedger(10, 2, seed=1, pinned=pinned)
    ledger.start_epoch(1)
    dead_lease = ledger.lease(1)  # replica 1 takes a partition and dies holding it
    done_by_0 = []
    first = ledger.lease(0)
    ledger.complete(0, first.partition)
    done_by_0.append(first.partition)
    back = ledger.release(1, survivors=[0])
    assert back == [dead_lease.partition]
    while (lease := ledger.lease(0)) is not None:
        ledger.complete(0, lease.partition)
        done_by_0.append(lease.partition)
    assert sorted(done_by_0) == list(range(10)) and ledger.epoch_complete
    assert ledger.redone == [{"epoch": 1, "partition": dead_lease.partition, "from_rank": 1}]


def test_cannot_start_an_epoch_before_the_last_is_served():
    ledger = PartitionLedger(3, 1)
    ledger.start_epoch(1)
    ledger.lease(0)
    with pytest.raises(RuntimeError, match="not finished"):
        ledger.start_epoch(2)


@pytest.mark.parametrize("queued, sharers, expected", [(0, 2, 0), (1, 2, 1), (2, 2, 1), (3, 2, 2), (8, 2, 2),
                                                       (40, 2, 2), (3, 3, 1), (4, 3, 2), (1, 1, 1),
                                                       (4, None, 2), (2, None, 2), (1, None, 1), (0, None, 0)])
def test_grant_size_is_a_fair_share_capped(queued, sharers, expected):
    assert grant_size(queued, sharers) == expected


@settings(max_examples=60, deadline=None)
@given(parts=st.integers(1, 40), replicas=st.integers(1, 5), pinned=st.booleans(), seed=st.integers(0, 10))
def test_grants_serve_every_partition_once_and_last_means_nothing_left(parts, replicas, pinned, seed):
    if pinned:
        parts = max(replicas, parts - parts % replicas)
    ledger = PartitionLedger(parts, replicas, seed, pinned=pinned)
    ledger.start_epoch(1)
    served, calls = [], 0
    active = set(range(replicas))
    while active:
        for rank in sorted(active):
            g = ledger.grant(rank)
            calls += 1
            assert len(g.leases) <= MAX_GRANT
            for lease in g.leases:
                ledger.complete(rank, lease.partition)
                served.append(lease.partition)
            if g.last or not g.leases:
                active.discard(rank)
                if g.last:
                    assert ledger.grant(rank).leases == ()  # "last" is never wrong
    assert sorted(served) == list(range(parts)) and ledger.epoch_complete
    assert calls < parts + replicas  # fewer server calls than one per partition plus one in vain each


@pytest.mark.parametrize("pinned", [False, True])
def test_first_grants_computed_apart_are_the_ledgers_own(pinned):
    ledger = PartitionLedger(12, 3, seed=4, pinned=pinned)
    for epoch in (1, 2):
        ledger.start_epoch(epoch)
        own = {r: ledger.grant(r) for r in (0, 1, 2)}
        assert first_grants(12, 3, 4, pinned, True, epoch, [0, 1, 2]) == own
        while any((g := ledger.grant(r)).leases or not g.last for r in (0, 1, 2)):
            pass
        for p, r in list(ledger.leased.items()):
            ledger.complete(r, p)


def serve_rows(ledger, sizes, ranks, batch, budget=None):
    """Replicas take leases in turn and train `batch` rows of a partition at a time (from a
    lease's skip), until nothing is left or `budget` batches were trained. Returns the (partition,
    row) pairs trained and, for a cut run, each held partition's rows trained so far."""
    trained, held = [], {}
    turn = 0
    while budget is None or turn < budget:
        moved = False
        for r in ranks:
            if r not in held:
                lease = ledger.lease(r)
                if lease is None:
                    continue
                held[r] = [lease.partition, lease.skip]
            p, at = held[r]
            stop = min(at + batch, sizes[p])
            trained += [(p, i) for i in range(at, stop)]
            held[r][1] = stop
            if stop == sizes[p]:
                ledger.complete(r, p)
                del held[r]
            moved = True
            turn += 1
        if not moved:
            break
    return trained, {p: at for p, at in held.values()}


@settings(max_examples=80, deadline=None)
@given(parts=st.integers(1, 20), replicas=st.integers(1, 4), seed=st.integers(0, 5), pinned=st.booleans(),
       cut=st.integers(0, 60), batch=st.integers(1, 7), again=st.integers(1, 4))
def test_an_epoch_gone_on_from_its_place_trains_every_row_once(parts, replicas, seed, pinned, cut, batch, again):
    """A run cut part way through an epoch (a checkpoint's place: the partitions done and the rows
    of each begun one), started again over another replica count: every row of the epoch once."""
    sizes = [5 + (p * 7) % 11 for p in range(parts)]
    ledger = PartitionLedger(parts, replicas, seed, pinned)
    ledger.start_epoch(3)
    before, begun = serve_rows(ledger, sizes, list(range(replicas)), batch, budget=cut)
    done = sorted(ledger.done)
    resumed = PartitionLedger(parts, again, seed, pinned)
    resumed.resume_epoch(3, list(range(again)), done, begun)
    after, left = serve_rows(resumed, sizes, list(range(again)), batch)
    rows = sorted(before + after)
    assert rows == sorted((p, i) for p in range(parts) for i in range(sizes[p])) and not left
    assert resumed.epoch_complete and all(resumed.done[p] == -1 for p in done)


def test_a_resumed_epochs_first_grants_are_the_servers_and_a_foreign_place_is_refused():
    ledger = PartitionLedger(8, 2, seed=1, pinned=True)
    ledger.resume_epoch(2, [0, 1], [0, 5], {3: 4})
    own = {r: ledger.grant(r) for r in (0, 1)}
    assert first_grants(8, 2, 1, True, True, 2, [0, 1], resume={"done": [0, 5], "skips": {3: 4}}) == own
    leases = [x for g in own.values() for x in g.leases]
    assert not {0, 5} & {x.partition for x in leases}
    assert all(x.skip == (4 if x.partition == 3 else 0) for x in leases)
    with pytest.raises(ValueError, match=r"partitions \[9\]"):
        PartitionLedger(8, 2).resume_epoch(1, [0, 1], [9], {})


def test_a_checkpoint_inside_an_epoch_is_due_by_steps_or_seconds():
    from policies.decisions.checkpointing import due_inside

    assert not due_inside(1000, 1e6, every_steps=0, every_s=0)  # both off
    assert not due_inside(9, 0.0, every_steps=10, every_s=0) and due_inside(10, 0.0, every_steps=10, every_s=0)
    assert not due_inside(0, 4.9, every_steps=0, every_s=5) and due_inside(0, 5.0, every_steps=0, every_s=5)
    assert due_inside(3, 6.0, every_steps=10, every_s=5)  # either rule


def test_backups_copy_the_slowest_holders_newest_lease_once_and_the_first_completion_counts():
    """sandblaster's backups: once the shared queue is empty a replica asking for more gets a copy
    of a partition a slower replica holds; the first completion counts, the second changes nothing;
    a dead holder's partition stays with its copy instead of being served again."""
    ledger = PartitionLedger(4, 3, seed=0, backups=True)
    ledger.start_epoch(1)
    grants = [ledger.grant(r) for r in range(3)]
    assert [len(g.leases) for g in grants] == [2, 1, 1]
    assert grants[2].drained and not grants[2].last  # the queue is empty, but a copy may still be asked for
    ledger = PartitionLedger(5, 3, seed=0, backups=True)
    ledger.start_epoch(1)
    a, b, c = [ledger.lease(0), ledger.lease(0)], [ledger.lease(1), ledger.lease(1)], ledger.lease(2)
    for lease in a:
        ledger.complete(0, lease.partition)
    ledger.complete(1, b[0].partition)
    backup = ledger.grant(0)  # 2 completed; replica 2 (none completed) holds the one expected to end last
    assert len(backup.leases) == 1 and backup.leases[0].backup and not backup.last and backup.drained
    assert backup.leases[0].partition == c.partition and ledger.copies == {c.partition: 0}
    assert backup.leases[0].seed == c.seed  # the same rows in the same order
    assert ledger.grant(2) == Grant((), True, True)  # replica 2 completed fewest: it backs up nobody
    again = ledger.grant(0)
    assert again.leases[0].partition == b[1].partition and again.leases[0].backup
    assert ledger.grant(0) == Grant((), True, True)  # nothing left to copy
    ledger.complete(0, c.partition)  # the copy first
    ledger.complete(2, c.partition)  # the holder's completion: nothing
    assert ledger.done[c.partition] == 0 and c.partition not in ledger.leased and not ledger.copies.get(c.partition)
    assert ledger.release(1) == []  # replica 1 died: its partition stays with replica 0's copy
    assert ledger.leased == {b[1].partition: 0} and ledger.redone == []
    ledger.complete(0, b[1].partition)
    assert ledger.epoch_complete
    ledger.start_epoch(2)  # nothing is left held
    without = PartitionLedger(4, 3, seed=0)
    without.start_epoch(1)
    assert [without.grant(r).last for r in range(3)] == [False, False, True]
    held = next(iter(without.leased))
    with pytest.raises(ValueError, match="does not hold"):
        without.complete((without.leased[held] + 1) % 3, held)
