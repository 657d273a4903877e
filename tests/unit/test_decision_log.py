"""The control loop's decision log (orchestrator/control/decide.py: DecisionLog, record, replay),
no Ray: records round-trip through JSON, repeats are counted, a changed decision is named by the
replay, a recorded run (a SIGKILLed replica, two phase switches, a grow, checkpoints inside
epochs) replays to the same decisions, and properties of `decide` over random observations."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.control import decide as d

RECORDED = os.path.join(os.path.dirname(__file__), "..", "data", "decisions_kill_switch_grow.jsonl")
RUNNING = d.Observation(begun=True, failures=0, lock_step=True, open_streams=2, paused=False, gate=None,
                        switch_pending=False, evacuation_pending=False, stopping=False)
DRAINED = d.Drained(((1, "node-b", 1234.0), (2, "node-b", 0.0)), 1200.0)
EVERY_EXIT = [d.Judge(True), d.CarrySwitch(), d.Finish(), d.Evacuate(DRAINED), d.CarryEvacuation(), d.Grow(True),
              d.OpenEpoch(), d.TakeCheckpoint(), d.ClosePass(True), d.Interrupt(), d.Read()]


def test_every_exit_and_observation_round_trips_through_json():
    assert {type(e).__name__ for e in EVERY_EXIT} == set(d.EXITS)
    obs = dataclasses.replace(RUNNING, begun=False, drained=DRAINED, grow_ready=True, interrupted=True,
                              ranks=(d.RankView(0, 41, 0.012), d.RankView(2, 40, None)))
    for exit_ in EVERY_EXIT:
        back = d.from_record(json.loads(json.dumps(d.record(obs, exit_, times=3))))
        assert back == (obs, exit_)
        hash(back)


def test_repeats_are_counted_not_stored_and_the_log_keeps_its_last_records():
    log = d.DecisionLog()
    for _ in range(5):
        log.note(RUNNING, d.Read())
    log.note(dataclasses.replace(RUNNING, open_streams=1), d.Read())
    log.note(RUNNING, d.Read())
    log.note(dataclasses.replace(RUNNING, ranks=(d.RankView(0, 7, 0.01),)), d.Read())  # a member stepped: no new decision
    assert [r["times"] for r in log.records] == [5, 1, 2]
    assert log.records[-1]["observation"]["ranks"] == ()  # as first seen in the run of repeats
    assert d.read_jsonl(log.jsonl()) == [json.loads(json.dumps(r)) for r in log.records]
    small = d.DecisionLog()
    small.records = type(small.records)(maxlen=3)
    for n in range(6):
        small.note(dataclasses.replace(RUNNING, open_streams=n), d.Read())
    assert [r["observation"]["open_streams"] for r in small.records] == [3, 4, 5]


def test_the_replay_names_every_decision_that_differs_and_refuses_what_is_no_record():
    records = [d.record(RUNNING, d.Read()), d.record(dataclasses.replace(RUNNING, open_streams=0), d.ClosePass())]
    assert d.replay(records) == []
    records[1]["exit"] = {"kind": "TakeCheckpoint"}  # a decision today's decide would not make
    assert d.replay(records) == [(1, d.TakeCheckpoint(), d.ClosePass())]
    with pytest.raises(ValueError, match="not a decision record"):
        d.replay([{"observation": {"begun": True}, "exit": {"kind": "Read"}}])
    with pytest.raises(ValueError, match="not a decision record"):
        d.replay([{"observation": dataclasses.asdict(RUNNING), "exit": {"kind": "Explode"}}])


def test_a_recorded_run_s_decisions_are_made_again():
    """tests/data/decisions_kill_switch_grow.jsonl: the decisions of examples/mnist_phases.yaml
    (downpour, switched to allreduce mid-epoch) at 2 replicas with room for 3, checkpoints inside
    epochs, and replica 1's process SIGKILLed at step 40, recorded by a real run
    (tests/data/record_decisions.py). Today's `decide` makes each of its decisions again; the run
    had each kind of turn this test is about."""
    with open(RECORDED) as f:
        records = d.read_jsonl(f.read())
    kinds = {r["exit"]["kind"] for r in records}
    assert {"Judge", "CarrySwitch", "Grow", "TakeCheckpoint", "OpenEpoch", "ClosePass", "Read"} <= kinds, kinds
    assert d.replay(records) == []


# ---- properties over random observations ---------------------------------------------------------
drained = st.none() | st.builds(d.Drained, st.lists(st.tuples(st.integers(0, 7), st.sampled_from(["a", "b"]),
                                                              st.floats(0, 1e4)), min_size=1, max_size=3).map(tuple),
                                st.floats(0, 1e4))
observations = st.builds(d.Observation, begun=st.booleans(), failures=st.integers(0, 3), lock_step=st.booleans(),
                         open_streams=st.integers(0, 4), paused=st.booleans(), gate=st.sampled_from((None,) + d.PAUSES),
                         switch_pending=st.booleans(), evacuation_pending=st.booleans(), stopping=st.booleans(),
                         drained=drained, grow_ready=st.booleans(), interrupted=st.booleans(),
                         ranks=st.lists(st.builds(d.RankView, st.integers(0, 7), st.integers(0, 10**6),
                                                  st.none() | st.floats(0, 10)), max_size=3).map(tuple))


@settings(max_examples=400, deadline=None)
@given(observations)
def test_decide_is_total_and_each_turn_waits_for_what_it_needs(obs):
    exit_ = d.decide(obs)
    assert type(exit_).__name__ in d.EXITS and d.decide(obs) == exit_  # one answer, the same every time
    if obs.failures and (not obs.begun or not obs.lock_step or not obs.open_streams):
        assert isinstance(exit_, d.Judge)  # a failure is judged before anything else is carried out
    if obs.begun and obs.open_streams:
        # nothing is carried out while a member still streams (a pause half reached): read on,
        # judge an asynchronous mode's failure, or end on a SIGTERM
        assert isinstance(exit_, (d.Read, d.Judge, d.Interrupt))
    if isinstance(exit_, d.CarrySwitch):
        assert obs.switch_pending and not obs.failures
    if isinstance(exit_, d.TakeCheckpoint):
        assert obs.gate == "checkpoint" and obs.paused and not obs.failures and not obs.open_streams
    if isinstance(exit_, (d.Evacuate, d.OpenEpoch)) or exit_ == d.Grow(mid_epoch=False):
        assert not obs.begun and not obs.switch_pending and not obs.stopping  # a pending switch or stop comes first
    if isinstance(exit_, d.CarryEvacuation):
        assert obs.evacuation_pending and obs.gate == "evacuate"
    if isinstance(exit_, d.Interrupt):
        assert obs.interrupted


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(observations, st.sampled_from(EVERY_EXIT)), max_size=30))
def test_any_sequence_of_decisions_logs_and_reads_back_as_it_was(seq):
    log = d.DecisionLog()
    for obs, exit_ in seq:
        log.note(obs, exit_)
    back = [d.from_record(r) for r in d.read_jsonl(log.jsonl())]
    key = [(dataclasses.replace(obs, ranks=()), exit_) for obs, exit_ in seq]
    collapsed = [pair for i, pair in enumerate(seq) if i == 0 or key[i - 1] != key[i]]
    assert back == collapsed
    assert sum(r["times"] for r in log.records) == len(seq)
