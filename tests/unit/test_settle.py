"""What a call to every member came to, judged once (orchestrator/fleet/outcomes.py: settle),
and an epoch's totals across a repair at its end (policies/messages.py: SegmentEnd.then): pure,
no Ray."""
from __future__ import annotations

import math

import pytest

from orchestrator.errors import MemberLost, TrainingError
from orchestrator.fleet.outcomes import DIED, HUNG, OK, RAISED, Outcome, settle
from policies.messages import SegmentEnd


def nobody_dead() -> dict[int, str]:
    return {}


def test_every_member_whose_call_raised_goes_to_the_failure_policy_with_its_error():
    outs = {0: Outcome(OK, 1.0), 1: Outcome(RAISED, detail="RuntimeError: out of memory", traceback="tb1"),
            2: Outcome(RAISED, detail="ValueError: bad batch", traceback="tb2")}
    with pytest.raises(MemberLost) as lost:
        settle(outs, "evaluation", nobody_dead)
    assert lost.value.ranks == [1, 2] and lost.value.causes == {1: "error", 2: "error"}
    assert lost.value.errors == {1: ("RuntimeError: out of memory", "tb1"), 2: ("ValueError: bad batch", "tb2")}


def test_deaths_and_hangs_come_first_a_divergence_ends_the_run_and_answers_come_in_rank_order():
    with pytest.raises(MemberLost) as lost:
        settle({0: Outcome(DIED), 1: Outcome(HUNG), 2: Outcome(RAISED, detail="x")}, "set_mode", nobody_dead)
    assert lost.value.causes == {0: "died", 1: "hung"}
    with pytest.raises(TrainingError, match="evaluation: replica 1: Diverged") as err:
        settle({0: Outcome(RAISED, detail="RuntimeError: x"), 1: Outcome(RAISED, detail="Diverged: nan", fatal=True)},
               "evaluation", nobody_dead)
    assert not isinstance(err.value, MemberLost)
    with pytest.raises(MemberLost) as donor:  # an input's maker died: the member found gone is the loss
        settle({0: Outcome(RAISED, actor_error=True), 1: Outcome(OK, 2)}, "load_state", lambda: {3: "died"})
    assert donor.value.ranks == [3] and donor.value.causes == {3: "died"}
    assert settle({2: Outcome(OK, "b"), 0: Outcome(OK, "a")}, "state", nobody_dead) == ["a", "b"]


def segment(kind: str, steps: int, loss: float, evaluated: bool) -> SegmentEnd:
    return SegmentEnd(kind, rank=0, epoch=1, steps=steps, samples=8 * steps, train_s=1.0, comm_s=0.0, consumed=[],
                      loss=loss, progress=[], step=steps, mode_name="allreduce",
                      eval={"loss_sum": 1.0, "rows": 4.0} if evaluated else None)


def test_a_segment_that_trained_no_row_keeps_the_epoch_s_loss_and_evaluation():
    first = segment("epoch", 100, 0.25, evaluated=True)
    after_repair = segment("epoch", 12, math.nan, evaluated=False)  # empty lock-step steps beside a newcomer
    merged = first.then(after_repair)
    assert merged.loss == 0.25 and merged.eval == {"loss_sum": 1.0, "rows": 4.0} and merged.steps == 112
    assert first.then(segment("epoch", 3, 0.5, evaluated=True)).loss == 0.5  # one that trained: its own
