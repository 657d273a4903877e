"""Running's decision (orchestrator/control/decide.py): every exit of `decide` from a constructed
observation, no Ray; the states `enter` and `judged` build; observations and exits are hashable;
the module imports nothing that brings Ray in."""
from __future__ import annotations

import ast
import dataclasses

import pytest

from orchestrator.control import decide as d
from orchestrator.control.states import (EpochSegment, Errored, EvacuationPlan, Finishing, Guard, GrowPlan, Pending,
                                         Plan, Reconfiguring, Running, SwitchPlan)
from policies.decisions.failure import Fail, Replace, ReplicaFailure
from policies.decisions.switching import Switch
from tests.unit.test_import_graph import import_graph, modules

# an epoch running, two streams open, nothing pending: the loop reads
RUNNING = d.Observation(begun=True, failures=0, lock_step=True, open_streams=2, paused=False, gate=None,
                        switch_pending=False, evacuation_pending=False, stopping=False)
BOUNDARY = dataclasses.replace(RUNNING, begun=False, open_streams=0)
DRAINED = d.Drained(((1, "node-b", 1234.0),), 1200.0)


def at(obs: d.Observation, **changes) -> d.Exit:
    return d.decide(dataclasses.replace(obs, **changes))


# ---- before the epoch opens --------------------------------------------------------------------
def test_boundary_exits_in_order():
    assert d.decide(BOUNDARY) == d.OpenEpoch()
    assert at(BOUNDARY, grow_ready=True) == d.Grow(mid_epoch=False)
    assert at(BOUNDARY, grow_ready=True, drained=DRAINED) == d.Evacuate(DRAINED)
    assert at(BOUNDARY, drained=DRAINED, stopping=True) == d.Finish()
    assert at(BOUNDARY, stopping=True, switch_pending=True) == d.CarrySwitch()
    assert at(BOUNDARY, switch_pending=True, failures=1) == d.Judge(abandon_checkpoint=False)


# ---- while the epoch runs ------------------------------------------------------------------------
def test_reading_goes_on_until_something_is_due():
    assert d.decide(RUNNING) == d.Read()
    assert at(RUNNING, interrupted=True) == d.Interrupt()
    assert at(RUNNING, gate="switch", switch_pending=True) == d.Read()  # paused ranks still streaming


def test_a_lock_step_failure_waits_for_every_stream_to_end():
    assert at(RUNNING, failures=1) == d.Read()  # the peers' collective fails too: they end their segments
    assert at(RUNNING, failures=1, open_streams=0) == d.Judge()
    assert at(RUNNING, failures=1, lock_step=False) == d.Judge()  # asynchronous: judged at once
    assert at(RUNNING, failures=1, lock_step=False, gate="checkpoint") == d.Judge(abandon_checkpoint=True)


def test_every_pause_has_its_exit_once_the_streams_ended():
    ended = dataclasses.replace(RUNNING, open_streams=0, paused=True)
    assert at(ended, gate="switch", switch_pending=True) == d.CarrySwitch()
    assert at(ended, gate="grow") == d.Grow(mid_epoch=True)
    assert at(ended, gate="evacuate", evacuation_pending=True) == d.CarryEvacuation()
    assert at(ended, gate="checkpoint") == d.TakeCheckpoint()
    assert at(ended, gate="checkpoint", paused=False) == d.ClosePass(give_up_checkpoint=True)
    assert at(ended, gate=None, paused=False) == d.ClosePass()
    # a pause whose plan is not pending (nothing to carry out) ends the pass instead
    assert at(ended, gate="switch") == d.ClosePass()
    assert at(ended, gate="evacuate") == d.ClosePass()
    # a pause nobody reached (every member ended its pass first) is no pause: the pass closes
    assert at(ended, gate="grow", paused=False) == d.ClosePass()


def test_an_unknown_pause_is_refused():
    with pytest.raises(ValueError, match="gate must be one of"):
        dataclasses.replace(RUNNING, gate="lunch")


def test_observations_and_exits_are_hashable_values():
    seen = {RUNNING, BOUNDARY, dataclasses.replace(BOUNDARY, drained=DRAINED)}
    assert len(seen) == 3 and RUNNING in seen
    exits = {d.decide(o) for o in seen}
    assert exits == {d.Read(), d.OpenEpoch(), d.Evacuate(DRAINED)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        RUNNING.failures = 2  # type: ignore[misc]


# ---- the states the exits lead to ----------------------------------------------------------------
def test_enter_builds_each_leaving_state():
    seg = EpochSegment(epoch=3, t_start=0.0)
    switch = SwitchPlan(Switch(phase=1, mode="downpour", rule="until epochs", reason="plateau", numbers={}), 0.0, 0.0, mid_epoch=True)
    pending = Pending(switch=switch)
    nxt = d.enter(d.CarrySwitch(), seg, pending)
    assert isinstance(nxt, Reconfiguring) and nxt.plan is switch and nxt.segment is seg and nxt.pending is pending
    assert isinstance(d.enter(d.Finish(), seg, pending), Finishing)
    moved = d.enter(d.Evacuate(DRAINED), seg, Pending())
    assert dataclasses.astuple(moved.plan) == ({1: "node-b"}, {1: 1234.0}, 1200.0)  # plans compare by identity
    evac = EvacuationPlan({0: "node-a"}, {0: 0.0}, 5.0)
    assert d.enter(d.CarryEvacuation(), seg, Pending(evacuation=evac)).plan is evac
    assert d.enter(d.Grow(mid_epoch=True), seg, Pending()).plan == GrowPlan(mid_epoch=True)
    with pytest.raises(ValueError, match="no state of its own"):
        d.enter(d.Read(), seg, pending)


def test_judged_is_a_repair_plan_or_the_runs_error():
    seg = EpochSegment(epoch=2, t_start=0.0)
    ended = {0: 17, 1: 9}  # each member's step where its segment ended interrupted
    failures = [ReplicaFailure(1, "died", "gone")]
    nxt = d.judged(seg, Pending(), failures, [Replace(1, 0.0, "a new actor")], 99.0, ended)
    assert isinstance(nxt, Reconfiguring) and isinstance(nxt.plan, Plan)
    assert nxt.plan.steps_at_interrupt == {0: 17}  # the survivors' steps, not the failed one's
    assert nxt.plan.t_detect_wall == 99.0 and nxt.plan.failures == failures
    over = d.judged(seg, Pending(), failures, Fail("no restarts left"), 99.0, ended)
    assert isinstance(over, Errored) and "epoch 2: no restarts left" in str(over.error)


def test_the_decision_module_brings_no_ray_in():
    """Neither decide.py nor any module of the project it imports, however deep, imports Ray
    (the packages' __init__ files, which Python loads on the way, aside)."""
    mods = modules()
    graph = import_graph(mods)
    seen, todo = set(), ["orchestrator.control.decide"]
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo.extend(graph[mod])
    with_ray = []
    for mod in sorted(seen):
        with open(mods[mod], encoding="utf-8") as f:
            tree = ast.parse(f.read())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level]
        if any(name == "ray" or name.startswith("ray.") for name in names):
            with_ray.append(mod)
    assert "orchestrator.control.states" in seen and len(seen) >= 4
    assert with_ray == [], f"the decision reaches Ray through {with_ray}"


def test_the_pause_is_the_states_and_ends_when_the_gate_opens():
    pending = Pending(pause="grow")
    assert d.normal(pending, gate_closed=True) is pending  # still pausing: the replicas have not all paused yet
    assert d.normal(pending, gate_closed=False) == Pending()  # the gate opened (the grow carried out, or lifted)
    assert pending.pause == "grow"  # a value: what is pending is a new one


def test_why_a_checkpoint_pauses_is_the_states_and_goes_with_the_pause():
    """A checkpoint inside the epoch for the driver's drained node, or a callback's: the reason
    rides on what is pending with the pause (not on the drain watch or the checkpoint part), and
    is dropped with it once the gate opens."""
    from orchestrator.control.states import CheckpointPause

    class Gate:
        closed = False

        def close(self):
            was, self.closed = self.closed, True
            return not was

    gate, why = Gate(), CheckpointPause(for_drain=True, asked_by="Saver after progress")
    paused = Pending().pause_for(gate, "checkpoint", why)
    assert (paused.pause, paused.checkpoint) == ("checkpoint", why)
    assert paused.pause_for(gate, "grow") is paused  # one pause at a time: the gate was closed already
    assert d.normal(paused, gate_closed=False) == Pending()


def test_what_is_pending_is_a_frozen_hashable_value():
    guard = Guard(1, "allreduce", {"w": [1.0]}, 0.5, checks=2)
    pending = Pending(guard=guard, pause="switch")
    with pytest.raises(dataclasses.FrozenInstanceError):
        pending.pause = None
    assert hash(pending) == hash(dataclasses.replace(pending)) and pending == dataclasses.replace(pending)
    assert dataclasses.replace(pending, stopping=True) != pending


def test_every_state_is_a_frozen_hashable_value_and_the_epoch_holds_no_stream():
    """The states and the epoch in flight are values: frozen, hashable; the segment holds only
    numbers and flags (the streams and their hang clocks are the fleet's EpochReader's)."""
    seg = EpochSegment(3, 0.0)
    assert {type(getattr(seg, f.name)) for f in dataclasses.fields(seg)} <= {int, float, bool}
    states = [d.starting(), Running(seg, Pending()), d.enter(d.Grow(mid_epoch=True), seg, Pending()),
              d.judged(seg, Pending(), [ReplicaFailure(1, "died", "gone")], [Replace(1, 0.0, "a new actor")], 9.0),
              d.finished(), d.errored(KeyboardInterrupt(), Pending())]
    for state in states:
        hash(state)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(state, dataclasses.fields(state)[0].name if dataclasses.fields(state) else "x", None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        seg.begun = False
    assert dataclasses.replace(seg, begun=False) != seg and hash(dataclasses.replace(seg)) == hash(seg)


def test_an_interrupt_keeps_what_was_pending_when_it_went_up():
    left = Running(EpochSegment(3, 0.0), Pending())
    rolled = Pending(stopping=True)
    exc = KeyboardInterrupt()
    assert d.pending_at(exc, left) == Pending()  # nothing kept: the state's own
    d.holding(exc, rolled)
    d.holding(exc, Pending(pause="grow"))  # the innermost handler's is kept
    assert d.pending_at(exc, left) is rolled and d.errored(exc, d.pending_at(exc, left)).pending is rolled


BUILT_HERE = {"Starting", "Running", "Reconfiguring", "Finishing", "Finished", "Errored", "Plan", "SwitchPlan",
              "GrowPlan", "EvacuationPlan"}


def test_states_and_plans_are_built_only_in_the_decision_module():
    """Read the code: no module of the packages but states.py (where they are defined) and
    decide.py calls a state's or a plan's class."""
    mods = modules()
    builders = {}
    for mod, path in mods.items():
        if mod in ("orchestrator.control.states", "orchestrator.control.decide"):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = node.func.id if isinstance(node.func, ast.Name) else \
                    node.func.attr if isinstance(node.func, ast.Attribute) else None
                if name in BUILT_HERE:
                    builders.setdefault(mod, []).append(f"{name} (line {node.lineno})")
    assert builders == {}, builders
    with open(mods["orchestrator.control.decide"], encoding="utf-8") as f:
        built = {n.func.id for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert BUILT_HERE <= built, BUILT_HERE - built


def test_a_pause_is_set_by_the_one_close_that_took_the_gate():
    from orchestrator.fleet.pause import PauseGate

    class Server:
        def call(self, *args, **kwargs):
            pass

    gate = PauseGate(Server())
    pending = Pending().pause_for(gate, "checkpoint")
    assert pending.pause == "checkpoint" and gate.closed
    assert pending.pause_for(gate, "switch") is pending  # one pause at a time: the gate was closed already
