"""The account of a shard rebuild (orchestrator/fleet/shard_slots.py), without Ray: what a
rebuilt shard lost, and when the account waits for its clients' replay."""
from orchestrator.fleet.shard_slots import Slot, rebuild_event


def info(restored_from=8, replayed=0, resent=0, dropped=0, seen=0, clients=1):
    return {"restored_from": restored_from, "replayed": replayed, "resent": resent, "dropped": dropped,
            "seen": seen, "clients": clients}


def test_a_rebuild_whose_clients_replayed_everything_lost_nothing():
    slot = Slot(handle=None, generation=1, version_at_death=10, rebuilt_from=8, settle_deadline=100.0)
    event = rebuild_event(0, slot, info(replayed=1, resent=1), now=5.0)
    assert event["lost_updates"] == 0 and "lost_causes" not in event
    assert (event["version_at_death"], event["snapshot_version"], event["generation"]) == (10, 8, 1)


def test_a_rebuild_waits_for_its_clients_until_the_deadline_then_says_what_is_lost():
    slot = Slot(handle=None, version_at_death=10, rebuilt_from=8, settle_deadline=100.0)
    assert rebuild_event(0, slot, info(replayed=1), now=5.0) is None  # one update missing: wait for replay
    assert rebuild_event(0, slot, info(replayed=2, clients=0), now=5.0) is None  # no client back yet: no evidence
    event = rebuild_event(0, slot, info(replayed=1, dropped=2, seen=12), now=100.0)
    assert event["lost_updates"] == (12 - 9) + 2 and event["version_at_death"] == 12
    assert event["lost_causes"] == {"dropped_from_full_log": 2, "not_replayed_within_settle_s": 3}
