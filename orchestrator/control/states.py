"""The controller's states and what they carry: the epoch in flight (`EpochSegment`), what is
pending beyond it (`Pending`: a switch decided, a switch on probation, a stop waiting for a
rollback, an evacuation waiting for the pause, why the replicas are pausing), a repair plan (`Plan`), a switch plan
(`SwitchPlan`), a grow plan (`GrowPlan`), an evacuation plan (`EvacuationPlan`), the reason a run
errored. All of the run's control state is here, in the state the controller holds;
the contexts (orchestrator/control/context.py) hold the fleet, the phase running, the ledger of
what was done. This module imports nothing of the orchestrator above it;
orchestrator/control/controller.py maps each state to its handler.

    Starting -> Running(segment, pending) -> Reconfiguring(plan, segment, pending) -> Running(segment, pending)
             ... -> Finishing -> Finished
    any state -> Errored(error)

`EpochSegment` is the epoch in flight as a value (its number, when it began, whether its
streams are open, its pass): every state is a frozen value and holds no stream or actor. The
streams and their hang clocks are the fleet's reader's (orchestrator/fleet/epoch_reader.py);
what they said, the epoch's record (orchestrator/control/epoch_record.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

from policies.decisions.failure import Decision, ReplicaFailure
from policies.decisions.switching import Switch
from policies.messages import Probation


@dataclass(frozen=True, eq=False)
class Plan:
    """What Reconfiguring carries out: the failures and the policy's decision for each (frozen,
    compared by identity; `made` fills in as its replacements are made)."""

    failures: list[ReplicaFailure]
    decisions: list[Decision]
    t_detect_wall: float
    steps_at_interrupt: dict[int, int] = field(default_factory=dict)  # lock-step survivors' steps
    # rank -> how: replacements an earlier try of this repair made, alive: kept when it is carried out again
    made: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EpochSegment:
    """The epoch in flight, as a value: its number, when its streams were opened (or it was
    made), whether they are open yet, and which pass over its partitions runs (a pass after
    the first serves what a disturbed one left). The live half is the fleet's reader
    (orchestrator/fleet/epoch_reader.py: the streams, their hang clocks); what the streams said,
    the epoch's record (orchestrator/control/epoch_record.py)."""

    epoch: int
    t_start: float
    begun: bool = True  # False: the epoch's streams are opened when Running next runs
    passes: int = 1


@dataclass(frozen=True, eq=False)
class SwitchPlan:
    """What Reconfiguring carries out for a phase switch (decided in orchestrator/control/reconfig/phase_switch.py):
    from which phase to which. The from-phase is recorded when the switch is decided, so a
    switch carried out again after a replica was lost in its middle (the controller already in
    the new phase by then) still knows where it came from."""

    switch: Switch
    t_decide_wall: float
    t_decide: float
    mid_epoch: bool
    from_mode: str = ""  # the mode of the phase running when it was decided
    rollback: Optional[dict[str, Any]] = None  # a rollback: the state from before the switch it undoes
    # the headline metric before it and its guard, measured once before its commit point: carried
    # out again after a member was lost past that point, the replicas already run the new rule
    measured: Optional[tuple[float, Optional["Guard"]]] = None


@dataclass(frozen=True, eq=False)
class Guard:
    """A switch on probation (orchestrator/control/reconfig/phase_switch.py: check_guard): the phase, mode and model
    from before it, and the test loss at it."""

    phase: int
    mode: str
    state: dict[str, Any]
    loss: float
    checks: int  # epoch ends left to look at
    until: int = -1  # the last epoch it judges: the replicas skip non-finite steps up to its end

    def saved(self) -> dict[str, Any]:
        """What a checkpoint keeps of it (a run resumed inside its probation is on probation too)."""
        return {"phase": self.phase, "mode": self.mode, "state": self.state, "loss": self.loss, "checks": self.checks,
                "until": self.until}

    @classmethod
    def from_saved(cls, saved: Optional[Probation]) -> Optional["Guard"]:
        return None if saved is None else cls(saved.phase, saved.mode, saved.state, saved.loss, saved.checks,
                                              saved.until)


@dataclass(frozen=True, eq=False)
class EvacuationPlan:
    """What Reconfiguring carries out for a preemption notice (orchestrator/control/reconfig/evacuate.py):
    the members on nodes being drained, moved off them before the deadline."""

    nodes: dict[int, str]  # rank -> the node being drained it runs on
    deadlines: dict[int, float]  # rank -> its node's deadline (wall-clock seconds; 0: none given)
    t_notice_wall: float  # when the run first saw the drain (evacuate_s counts from it)


@dataclass(frozen=True)
class CheckpointPause:
    """Why the replicas pause for a checkpoint inside the epoch besides its being due
    (orchestrator/control/mid_epoch.py): the driver's own node is being drained (`for_drain`:
    counted once written), or a callback's Action.CHECKPOINT asked (`asked_by`: who, after which
    event; asked again if the checkpoint is given up)."""

    for_drain: bool = False
    asked_by: Optional[str] = None


@dataclass(frozen=True)
class Pending:
    """What Running carries from one epoch to the next besides the epoch itself, and
    Reconfiguring hands back to it: a phase switch decided and not carried out yet (at the next
    pause, or before the next epoch opens), the last switch on probation (its guard: rolled back
    if the loss rose), and a stop decided while a rollback was pending (the run finishes once it
    is carried out). A switch interrupted by a lost member stays here and is carried out again
    after the repair, from the phase it recorded. A frozen value: whoever changes what is
    pending returns a new one (`dataclasses.replace`), and Running hands it on in a new state at
    once (orchestrator/control/running.py), so the controller's state is always what is pending.
    Its plans and guard are compared and hashed by identity (they hold models and dicts)."""

    switch: Optional[SwitchPlan] = None
    guard: Optional[Guard] = None
    stopping: bool = False
    evacuation: Optional[EvacuationPlan] = None  # members on a drained node: carried out once every replica paused
    # why the replicas are pausing at their next partition boundary (decide.PAUSES: "switch",
    # "grow", "evacuate", "checkpoint"), set with the gate's close; None while the gate is open
    pause: Optional[str] = None
    checkpoint: Optional[CheckpointPause] = None  # pause "checkpoint": what it is for besides being due

    def pause_for(self, gate: Any, why: str, checkpoint: Optional[CheckpointPause] = None) -> "Pending":
        """Close the pause gate (orchestrator/fleet/pause.py) for `why`: what is pending then;
        this one, unchanged, when the gate is closed already (one pause at a time)."""
        return replace(self, pause=why, checkpoint=checkpoint) if gate.close() else self

    def probation(self) -> Optional[dict[str, Any]]:
        """The guard still judging, as a checkpoint keeps it (`Guard.saved`), or None."""
        return self.guard.saved() if self.guard is not None else None


@dataclass(frozen=True)
class GrowPlan:
    """What Reconfiguring carries out for a grow: the replicas started for it that are ready join
    (orchestrator/control/reconfig/elastic.py holds who they are)."""

    mid_epoch: bool  # every replica paused for it mid-epoch; else at an epoch boundary


@dataclass(frozen=True)
class RateBase:
    """The phase's rate a resize's schedule is a factor of: its shards' (or replicas') optimizer
    lr, and whether the mode's rate applies to the global batch (the resize event's fields)."""

    lr: float
    global_batch: bool


@dataclass(frozen=True)
class Starting:
    pass


@dataclass(frozen=True)
class Running:
    segment: EpochSegment
    pending: Pending = field(default_factory=Pending)


@dataclass(frozen=True)
class Reconfiguring:
    plan: Union[Plan, SwitchPlan, GrowPlan, EvacuationPlan]  # failures to repair, a switch, a grow, an evacuation
    segment: EpochSegment
    pending: Pending = field(default_factory=Pending)  # then: Running(segment, pending) goes on with it


@dataclass(frozen=True)
class Finishing:
    pass


@dataclass(frozen=True)
class Finished:
    pass


@dataclass(frozen=True)
class Errored:
    error: BaseException
    pending: Optional[Pending] = None  # the state's it left (an interrupt: its checkpoint keeps a switch's guard)


State = Union[Starting, Running, Reconfiguring, Finishing, Finished, Errored]
TERMINAL = (Finished, Errored)
PLAN_NAMES = ((Plan, "repair"), (SwitchPlan, "switch"), (GrowPlan, "grow"), (EvacuationPlan, "evacuation"))


def state_name(state: State) -> str:
    """The name a state's seconds are counted under (RunTotals.state_s): starting, running,
    repair, switch, grow, evacuation (Reconfiguring, by its plan), finishing."""
    if isinstance(state, Reconfiguring):
        return next(name for kind, name in PLAN_NAMES if isinstance(state.plan, kind))
    return type(state).__name__.lower()
