"""Preemption notices (orchestrator/fleet/drains.py), without Ray: which members are on a node
being drained, and how often the cluster is asked."""
from orchestrator.fleet.drains import DRAIN_POLL_S, DrainWatch, on_draining


def test_members_on_a_drained_node_are_found_and_spares_or_leavers_are_not_members():
    nodes = {0: "aa", 1: "bb", 2: "bb", 3: "cc"}
    assert on_draining(nodes, [0, 1, 3], {"bb": 1800.0}) == {1: "bb"}  # rank 2 is no member any more
    assert on_draining(nodes, [0, 1, 2, 3], {}) == {}
    assert on_draining({0: "aa"}, [0, 1], {"aa": 0.0}) == {0: "aa"}  # a rank not located yet is skipped


def test_the_watch_asks_once_per_poll_keeps_its_view_when_a_look_fails_and_says_why():
    answers = [{"bb": 1_800_000}, RuntimeError("GCS unreachable"), {}]
    asked = []

    def look():
        asked.append(1)
        answer = answers[len(asked) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    watch = DrainWatch(look)
    assert watch.look(now=100.0) == {"bb": 1800.0} and len(asked) == 1  # ms -> s
    seen = watch.first_seen["bb"]
    assert watch.look(now=100.0 + DRAIN_POLL_S / 2) == {"bb": 1800.0} and len(asked) == 1  # not yet
    assert watch.look(now=100.0 + DRAIN_POLL_S) == {"bb": 1800.0} and "GCS unreachable" in watch.failed
    assert watch.first_seen == {"bb": seen}  # when it was first seen, kept
    assert watch.look(now=100.0 + 2 * DRAIN_POLL_S) == {} and watch.failed is None


def test_a_drained_member_goes_to_a_spare_then_to_room_elsewhere_then_is_dropped_down_to_min_replicas():
    from types import SimpleNamespace

    from orchestrator.control.reconfig.evacuate import decisions
    from orchestrator.control.states import EvacuationPlan
    from policies.decisions.failure import Drop, Replace

    def run(spares, room, members, min_replicas):
        elastic = SimpleNamespace(room_outside=lambda nodes: room)
        pool = SimpleNamespace(usable=lambda draining: spares)  # spares not on a drained node
        group = SimpleNamespace(spare_pool=pool, members=dict.fromkeys(range(members)))
        return SimpleNamespace(fleet=SimpleNamespace(group=group, elastic=elastic),
                               cfg=SimpleNamespace(scaling=SimpleNamespace(min_replicas=min_replicas)))

    plan = EvacuationPlan({1: "bb" * 8, 2: "bb" * 8, 3: "bb" * 8}, {1: 0.0, 2: 0.0, 3: 0.0}, 0.0)
    got = decisions(run(spares=1, room=1, members=4, min_replicas=2), plan)
    assert [type(d) for d in got] == [Replace, Replace, Drop] and got[2].shrink and "spare" in got[0].reason
    got = decisions(run(spares=0, room=0, members=4, min_replicas=3), plan)
    assert [type(d) for d in got] == [Drop, Replace, Replace]  # one drop keeps 3; then no shrink below it


def test_a_drained_driver_node_checkpoints_at_once_and_once_more_just_before_its_deadline():
    from policies.decisions.checkpointing import LAST_CALL_S, due_for_drain

    assert due_for_drain(1000.0, 900.0, taken=0)  # at the notice
    assert not due_for_drain(1000.0, 900.0, taken=1)  # not again until the last call
    assert due_for_drain(1000.0, 1000.0 - LAST_CALL_S, taken=1)
    assert not due_for_drain(1000.0, 999.0, taken=2)  # two at most
    assert due_for_drain(0.0, 900.0, taken=0) and not due_for_drain(0.0, 1e9, taken=1)  # no deadline: one
