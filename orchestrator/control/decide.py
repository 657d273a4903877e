"""Running's decision, pure: what the loop does next, from one observation of the epoch.

Each tick of Running (orchestrator/control/running.py: run_segment) gathers an `Observation`
(frozen, hashable: counts and flags, never a stream or an actor), `decide` names the next
`Exit` (one of the frozen values below), and the loop's actions carry it out. Nothing here
imports Ray or the run's context; every exit has a unit test on a constructed observation
(tests/unit/test_decide.py).

Before the epoch's streams open (`begun` False), in this order:
    unjudged failures          -> Judge          (a replica died between epochs: repaired first)
    a switch pending           -> CarrySwitch    (decided at the last epoch's end)
    a stop pending             -> Finish         (the run stopped once a rollback was carried out)
    members on a drained node  -> Evacuate       (they move before the epoch opens)
    a grow's replicas ready    -> Grow(False)    (they join at the epoch boundary)
    else                       -> OpenEpoch
While it runs:
    failures, and the mode is not lock-step or every stream ended -> Judge (a checkpoint waiting
        for its pause is given up first: `abandon_checkpoint`)
    every stream ended, members paused for a switch -> CarrySwitch; for a grow -> Grow(True);
        for an evacuation -> CarryEvacuation; for a checkpoint -> TakeCheckpoint
    every stream ended otherwise -> ClosePass (a checkpoint nobody paused for given up first)
    a SIGTERM seen               -> Interrupt
    else                         -> Read (one tick: read the streams, watch the fleet)

The states these exits lead to are built here too (`enter`; `judged`: the failure policy's
answer as a repair plan, or the run's error), from the segment and what is pending; so are the
other handlers' next states and the plans (the end of this module): no other module builds a
state or a plan (tests/unit/test_decide.py reads the code for it).

Every decision of a run is logged (`DecisionLog`: consecutive repeats counted, not stored) and
written to the run's MLflow artifacts as `decisions.jsonl`; `replay` runs `decide` again on each
recorded observation and names every exit that differs: a run's decisions can be tested, and
today's `decide` checked against yesterday's runs, without Ray (tests/unit/test_decision_log.py replays
a recorded run with a kill, a switch and a grow).
"""
from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass, fields, is_dataclass, replace
from typing import Any, Iterable, Optional, Union, get_args, get_origin, get_type_hints

from orchestrator.control.states import (EpochSegment, Errored, EvacuationPlan, Finished, Finishing, GrowPlan, Pending,
                                         Plan, Reconfiguring, Running, Starting, State, SwitchPlan)
from orchestrator.errors import TrainingError
from policies.decisions.failure import Decision, Fail, ReplicaFailure
from policies.decisions.switching import Switch

PAUSES = ("switch", "grow", "evacuate", "checkpoint")  # why the replicas may be pausing (Pending.pause)


@dataclass(frozen=True)
class Drained:
    """Members on nodes being drained, as the drain watch saw them: (rank, node, deadline) each
    (deadline: wall-clock seconds, 0 when none was given), and when the first drain was seen."""

    members: tuple[tuple[int, str, float], ...]
    seen_wall: float

    def plan(self) -> EvacuationPlan:
        return EvacuationPlan({r: n for r, n, _ in self.members}, {r: d for r, _, d in self.members}, self.seen_wall)


@dataclass(frozen=True)
class RankView:
    """One member as the loop last heard it: its update index (the global step of its last report)
    and its seconds per step then (compute and communication; None before its first row)."""

    rank: int
    update: int
    step_s: Optional[float] = None


@dataclass(frozen=True)
class Observation:
    """What Running's exits read, gathered once a tick (running.observe)."""

    begun: bool  # the epoch's streams are open (False: opened when Running next runs)
    failures: int  # failures seen and not judged yet
    lock_step: bool  # the phase's mode steps together (allreduce, synchronous EASGD)
    open_streams: int  # members whose segment has not ended this pass
    paused: bool  # a member's segment ended paused this pass
    gate: Optional[str]  # why the replicas are pausing (Pending.pause, one of PAUSES); None: the gate is open
    # (or closed for an interrupted run, which ends where it is)
    switch_pending: bool
    evacuation_pending: bool
    stopping: bool
    drained: Optional[Drained] = None  # before the epoch opens: members on drained nodes
    grow_ready: bool = False  # before the epoch opens: replicas started for a grow are ready
    interrupted: bool = False  # a SIGTERM whose KeyboardInterrupt was swallowed where it landed
    # every member's update index and step seconds, by rank (no exit reads them yet: what a fixed
    # global batch and a goodput ledger build on); the decision log keeps them as first seen in a
    # run of repeats
    ranks: tuple[RankView, ...] = ()

    def __post_init__(self) -> None:
        if self.gate is not None and self.gate not in PAUSES:
            raise ValueError(f"gate must be one of {PAUSES} or None, got {self.gate!r}")


def normal(pending: Pending, gate_closed: bool) -> Pending:
    """Pending.pause is None whenever the gate is open: whoever opened it (a checkpoint taken, a
    change carried out, a grow's pause lifted at the boundary) ended the pause."""
    return replace(pending, pause=None, checkpoint=None) if not gate_closed and pending.pause is not None else pending


@dataclass(frozen=True)
class Judge:
    abandon_checkpoint: bool = False  # the gate was closed for a checkpoint: it is given up first


@dataclass(frozen=True)
class CarrySwitch:
    pass


@dataclass(frozen=True)
class Finish:
    pass


@dataclass(frozen=True)
class Evacuate:
    drained: Drained  # before the epoch opens


@dataclass(frozen=True)
class CarryEvacuation:
    pass  # mid-epoch: the evacuation pending since the notice


@dataclass(frozen=True)
class Grow:
    mid_epoch: bool


@dataclass(frozen=True)
class OpenEpoch:
    pass


@dataclass(frozen=True)
class TakeCheckpoint:
    pass


@dataclass(frozen=True)
class ClosePass:
    give_up_checkpoint: bool = False  # the gate was closed for a checkpoint nobody paused for


@dataclass(frozen=True)
class Interrupt:
    pass


@dataclass(frozen=True)
class Read:
    pass


Exit = Union[Judge, CarrySwitch, Finish, Evacuate, CarryEvacuation, Grow, OpenEpoch, TakeCheckpoint, ClosePass,
             Interrupt, Read]
EXITS = {cls.__name__: cls for cls in (Judge, CarrySwitch, Finish, Evacuate, CarryEvacuation, Grow, OpenEpoch,
                                       TakeCheckpoint, ClosePass, Interrupt, Read)}
LEAVING = (CarrySwitch, Finish, Evacuate, CarryEvacuation, Grow)  # exits `enter` turns into the next state


def decide(obs: Observation) -> Exit:
    """The next exit of Running for one observation (module doc: the order)."""
    if not obs.begun:
        if obs.failures:
            return Judge()
        if obs.switch_pending:
            return CarrySwitch()
        if obs.stopping:
            return Finish()
        if obs.drained is not None:
            return Evacuate(obs.drained)
        if obs.grow_ready:
            return Grow(mid_epoch=False)
        return OpenEpoch()
    if obs.failures and (not obs.lock_step or not obs.open_streams):
        return Judge(abandon_checkpoint=obs.gate == "checkpoint")
    if not obs.open_streams:
        if obs.paused and obs.gate == "switch" and obs.switch_pending:
            return CarrySwitch()
        if obs.paused and obs.gate == "grow":
            return Grow(mid_epoch=True)
        if obs.paused and obs.gate == "evacuate" and obs.evacuation_pending:
            return CarryEvacuation()
        if obs.gate == "checkpoint":
            return TakeCheckpoint() if obs.paused else ClosePass(give_up_checkpoint=True)
        return ClosePass()
    if obs.interrupted:
        return Interrupt()
    return Read()


def holding(exc: BaseException, pending: Pending) -> None:
    """Keep what was pending when `exc` went up on it (`pending_at`): a handler that changed what
    is pending and is cut short (an interrupt inside an epoch's end after its guard was judged,
    inside a switch past its commit point) leaves the controller's Errored state what was
    pending then, not what was pending when the state it left was entered."""
    if getattr(exc, "run_pending", None) is None:
        exc.run_pending = pending  # type: ignore[attr-defined]


def pending_at(exc: BaseException, left: Any) -> Optional[Pending]:
    """What was pending when `exc` ended the state `left`: what a handler kept on it (`holding`),
    else the state's own."""
    return getattr(exc, "run_pending", None) or getattr(left, "pending", None)


# ---- the decision log: what a run decided, replayable without the run ---------------------------
def record(obs: Observation, exit_: Exit, times: int = 1) -> dict[str, Any]:
    """One decision as a JSON-able record: the observation, the exit named for it (by its class
    name, with its fields) and how many ticks in a row it was the same."""
    return {"observation": asdict(obs), "exit": {"kind": type(exit_).__name__, **asdict(exit_)}, "times": times}


def _typed(tp: Any, value: Any) -> Any:
    """`value` (a value's `asdict` form, read back from JSON) as the type `tp` declares: a frozen
    value field by field as its class declares them, a tuple item by item."""
    if value is None:
        return None
    args = get_args(tp)
    if get_origin(tp) is Union:
        return _typed(next(a for a in args if a is not type(None)), value)
    if is_dataclass(tp):
        hints = get_type_hints(tp)
        return tp(**{f.name: _typed(hints[f.name], value[f.name]) for f in fields(tp) if f.name in value})
    if get_origin(tp) is tuple:
        return tuple(_typed(args[0] if args[-1] is Ellipsis else args[i], v) for i, v in enumerate(value))
    return value


def from_record(rec: dict[str, Any]) -> tuple[Observation, Exit]:
    """A record back as the observation and the exit it names (ValueError: not a decision record)."""
    try:
        e = dict(rec["exit"])
        return _typed(Observation, rec["observation"]), _typed(EXITS[e.pop("kind")], e)
    except (KeyError, TypeError, IndexError, StopIteration) as exc:
        raise ValueError(f"not a decision record ({type(exc).__name__}: {exc}): {rec!r:.200}") from None


def replay(records: Iterable[dict[str, Any]]) -> list[tuple[int, Exit, Exit]]:
    """`decide` again on each recorded observation: (index, the exit recorded, the exit decided
    now) for every record where they differ (none: today's `decide` makes the run's decisions)."""
    out = []
    for i, rec in enumerate(records):
        obs, recorded = from_record(rec)
        now = decide(obs)
        if now != recorded:
            out.append((i, recorded, now))
    return out


class DecisionLog:
    """The decisions of one driver's run, in order (RunContext's ledger; MLflow's `decisions.jsonl`
    at the run's end): a decision the same as the one before (a Read of an unchanged epoch, tick
    after tick) adds to its `times` instead of a record; the last MAX_RECORDS are kept."""

    MAX_RECORDS = 20_000

    def __init__(self) -> None:
        self.records: deque[dict[str, Any]] = deque(maxlen=self.MAX_RECORDS)
        self._last: Optional[tuple[Observation, Exit]] = None

    def note(self, obs: Observation, exit_: Exit) -> None:
        key = (replace(obs, ranks=()), exit_)  # a member's new step alone is no new decision
        if self._last == key and self.records:
            self.records[-1]["times"] += 1
            return
        self._last = key
        self.records.append(record(obs, exit_))

    def jsonl(self) -> str:
        return "".join(json.dumps(r) + "\n" for r in self.records)


def read_jsonl(text: str) -> list[dict[str, Any]]:
    """The records of a decisions.jsonl (blank lines skipped)."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def enter(exit_: Exit, seg: EpochSegment, pending: Pending) -> State:
    """The state an exit in LEAVING leads to."""
    if isinstance(exit_, CarrySwitch):
        assert pending.switch is not None
        return Reconfiguring(pending.switch, seg, pending)
    if isinstance(exit_, Finish):
        return Finishing()
    if isinstance(exit_, Evacuate):
        return Reconfiguring(exit_.drained.plan(), seg, pending)
    if isinstance(exit_, CarryEvacuation):
        assert pending.evacuation is not None
        return Reconfiguring(pending.evacuation, seg, pending)
    if isinstance(exit_, Grow):
        return Reconfiguring(GrowPlan(mid_epoch=exit_.mid_epoch), seg, pending)
    raise ValueError(f"{type(exit_).__name__} leads to no state of its own")


def judged(seg: EpochSegment, pending: Pending, failures: list[ReplicaFailure], decisions: Union[Fail, list[Decision]],
           t_first_failure: float, interrupted: Optional[dict[int, int]] = None) -> State:
    """Judge's next state: the failure policy's `Fail` ends the run (Errored); else the repair
    plan, with the lock-step survivors' steps at their interruption (`interrupted`: rank -> step
    of every member whose last segment this pass ended interrupted, the failed ones' dropped)."""
    if isinstance(decisions, Fail):
        return Errored(TrainingError(f"epoch {seg.epoch}: {decisions.reason}"))
    failed = {f.rank for f in failures}
    steps = {r: step for r, step in (interrupted or {}).items() if r not in failed}
    return Reconfiguring(repair_plan(failures, decisions, t_first_failure, steps), seg, pending)


# ---- the other handlers' next states, and the plans ----------------------------------------------
def starting() -> Starting:
    return Starting()


def running(seg: EpochSegment, pending: Pending) -> Running:
    """Running: the run started, a reconfiguration carried out or a member lost while the driver
    waited (the same segment goes on), or the next epoch (a new segment, not begun)."""
    return Running(seg, pending)


def after_epoch(finish: bool, nxt: EpochSegment, pending: Pending) -> State:
    """An epoch's end: Finishing when the run stops there (no rollback pending), else the next
    epoch (a stop waiting for a rollback is `pending.stopping`)."""
    return Finishing() if finish else Running(nxt, pending)


def finished() -> Finished:
    return Finished()


def errored(exc: BaseException, pending: Optional[Pending]) -> Errored:
    return Errored(exc, pending)


def switch_plan(sw: Switch, mid_epoch: bool, from_mode: str, rollback: Optional[dict[str, Any]] = None) -> SwitchPlan:
    """A switch the policy decided (or a rollback: the state from before the switch it undoes),
    timed from now."""
    return SwitchPlan(sw, time.time(), time.perf_counter(), mid_epoch, from_mode=from_mode, rollback=rollback)


def repair_plan(failures: list[ReplicaFailure], decisions: list[Decision], t_detect_wall: float,
                steps_at_interrupt: Optional[dict[int, int]] = None, made: Optional[dict[int, str]] = None) -> Plan:
    """Failures with the failure policy's decisions (a repair folded again after a loss: the
    replacements it already made, `made`, are kept)."""
    return Plan(failures, decisions, t_detect_wall, dict(steps_at_interrupt or {}), made=dict(made or {}))
