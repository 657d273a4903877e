"""The failure policy, as a plain object (no Ray)."""
import pytest

from policies.decisions.failure import Drop, Fail, FailurePolicy, Replace, ReplicaFailure, error_detail


def died(rank=1, replacement=False):
    return ReplicaFailure(rank, "died", "ActorDiedError", replacement=replacement)


def test_replaces_until_the_budget_then_drops_while_min_replicas_allows():
    policy = FailurePolicy(max_restarts=2, min_replicas=2)
    assert isinstance(policy.decide(died(), survivors=2), Replace)
    assert isinstance(policy.decide(died(), survivors=2), Replace)
    third = policy.decide(died(), survivors=2)
    assert isinstance(third, Drop) and "max_replica_restarts (2) spent" in third.reason
    last = policy.decide(died(), survivors=1)
    assert isinstance(last, Fail) and "1 replicas left < scaling.min_replicas 2" in last.reason


def test_backoff_doubles_in_a_row_is_capped_and_starts_over_after_a_clean_epoch():
    policy = FailurePolicy(max_restarts=10, backoff_s=1.0)
    assert [policy.decide(died(), 1).backoff_s for _ in range(3)] == [1.0, 2.0, 4.0]
    policy.epoch_without_failure()
    assert policy.decide(died(), 1).backoff_s == 1.0
    policy.in_a_row = 20
    assert policy.decide(died(), 1).backoff_s == 30.0
    assert FailurePolicy(max_restarts=1).decide(died(), 1).backoff_s == 0.0


def test_the_same_user_error_twice_on_a_fresh_replica_ends_the_run():
    policy = FailurePolicy(max_restarts=5)
    detail = error_detail("ValueError", "bad batch\nmore lines")
    assert detail == "ValueError: bad batch"
    first = policy.decide(ReplicaFailure(0, "error", detail, "Traceback ..."), survivors=1)
    assert isinstance(first, Replace)
    again = policy.decide(ReplicaFailure(0, "error", detail, "Traceback (most recent call last)", replacement=True), 1)
    assert isinstance(again, Fail) and "same error twice in a row" in again.reason and "Traceback" in again.reason


def test_a_different_error_or_an_original_replica_is_retried():
    policy = FailurePolicy(max_restarts=5)
    policy.decide(ReplicaFailure(0, "error", "ValueError: a"), 1)
    assert isinstance(policy.decide(ReplicaFailure(0, "error", "ValueError: b", replacement=True), 1), Replace)
    assert isinstance(policy.decide(ReplicaFailure(1, "error", "ValueError: b"), 1), Replace)  # another rank
    policy.decide(died(0, replacement=True), 1)  # a death in between clears the streak
    assert isinstance(policy.decide(ReplicaFailure(0, "error", "ValueError: b", replacement=True), 1), Replace)


def test_an_unknown_cause_is_refused():
    with pytest.raises(ValueError):
        ReplicaFailure(0, "tired", "")


def test_no_room_for_a_replacement_shrinks_without_spending_a_restart():
    policy = FailurePolicy(max_restarts=3, min_replicas=1)
    d = policy.decide(died(), 1, placeable=False, capacity_note="node n1 lost; room for 0 more")
    assert isinstance(d, Drop) and d.shrink and "no room for a replacement: node n1 lost" in d.reason
    assert policy.restarts == 0
    assert isinstance(policy.decide(died(), 1), Replace)  # with room: replaced as before


def test_no_room_and_too_few_survivors_fails():
    d = FailurePolicy(max_restarts=3, min_replicas=2).decide(died(), 1, placeable=False)
    assert isinstance(d, Fail) and "min_replicas 2" in d.reason


def test_a_resumed_policy_has_the_budget_it_had_left():
    """The policy's position goes into every checkpoint: a run resumed after spending its
    replacements does not get them again."""
    used = FailurePolicy(max_restarts=2, min_replicas=1)
    for _ in range(2):
        assert isinstance(used.decide(ReplicaFailure(1, "died", "gone"), survivors=1), Replace)
    used.decide(ReplicaFailure(0, "error", "ValueError: x"), survivors=1)  # a third: over budget, remembered
    resumed = FailurePolicy(max_restarts=2, min_replicas=1)
    resumed.load_state_dict(used.state_dict())
    assert (resumed.restarts, resumed.in_a_row, resumed.last_error) == (used.restarts, used.in_a_row, used.last_error)
    assert isinstance(resumed.decide(ReplicaFailure(1, "died", "gone"), survivors=1), Drop)


def test_a_loss_stuck_at_chance_after_learning_is_divergence():
    import math

    from policies.decisions.stop import ChanceWatch

    w = ChanceWatch(10)
    chance = math.log(10)
    assert w.observe(chance) is None and w.observe(chance) is None  # never learned yet: early training
    assert w.observe(0.3) is None  # learned
    assert w.observe(chance * 0.99) is None  # one epoch end at chance: not yet
    why = w.observe(chance * 1.01)
    assert why is not None and "chance level" in why and "2 epoch ends" in why
    w = ChanceWatch(10)
    w.observe(0.3)
    assert w.observe(chance) is None and w.observe(0.5) is None and w.observe(chance) is None  # not in a row
    assert ChanceWatch(10, patience=1, learned=True).observe(float("nan")) is not None
