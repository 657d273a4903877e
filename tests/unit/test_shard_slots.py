"""The account of a shard rebuild (orchestrator/fleet/shard_slots.py), without Ray: what a
rebuilt shard lost, and when the account waits for its clients' replay."""
from orchestrator.fleet.shard_slots import Slot, rebuild_event


def info(restored_from=8, replayed=0, resent=0, dropped=0, seen=0, clients=1):
    return {"restored_from": restored_from, "replayed": replayed, "resent": resent, "dropped": dropped,
            "seen": seen, "clients": clients}


def test_a_rebuild_whose_clients_replayed_everything_lost_nothing():
    slot = Slot(handle=None, generation=1, version_at_death=10, rebuilt_from=8, settle_deadline=100.0)
    event = rebuild_event(0, slot, info(replayed=1, resent=1), now=5.0).fields
    assert event["lost_updates"] == 0 and "lost_causes" not in event
    assert (event["version_at_death"], event["snapshot_version"], event["generation"]) == (10, 8, 1)


def test_a_rebuild_waits_for_its_clients_until_the_deadline_then_says_what_is_lost():
    slot = Slot(handle=None, version_at_death=10, rebuilt_from=8, settle_deadline=100.0)
    assert rebuild_event(0, slot, info(replayed=1), now=5.0) is None  # one update missing: wait for replay
    assert rebuild_event(0, slot, info(replayed=2, clients=0), now=5.0) is None  # no client back yet: no evidence
    happened = rebuild_event(0, slot, info(replayed=1, dropped=2, seen=12), now=100.0)
    assert happened.kind == "shard_rebuilt" and "(5 acknowledged updates lost)" in happened.line
    event = happened.fields
    assert event["lost_updates"] == (12 - 9) + 2 and event["version_at_death"] == 12
    assert event["lost_causes"] == {"dropped_from_full_log": 2, "not_replayed_within_settle_s": 3}


def test_a_shard_is_unconfirmed_until_it_answers_a_ping_sent_within_hang_s():
    """ShardGroup.unconfirmed: while a live shard has answered no ping sent in the last hang_s
    (the driver was busy for seconds and did not check), the replicas' hang clocks are held."""
    from orchestrator.fleet.shard_group import ShardGroup

    group = ShardGroup([None, None], [(0, 1), (1, 2)], ["a", "b"], "ns", (), 10.0, 10.0, 1)
    group.hang_s = 3.0
    a, b = group._slots
    a.answered_at, b.answered_at = 100.0, 101.0
    assert not group.unconfirmed(now=102.0)
    assert group.unconfirmed(now=104.5)  # shard a's newest answered ping was sent 4.5 s ago
    a.state = "dead"  # a dead one is the rebuild's business (`repairing`), not this check's
    assert not group.unconfirmed(now=104.0)
    group.hang_s = None  # no ping timeout configured: nothing is held
    assert not group.unconfirmed(now=1e9)
