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

`EpochSegment` is the driver's view of one epoch while it runs: the replicas' open epoch
streams, what each sent, failures seen and not yet judged, and recoveries waiting for every
member to step again. It holds no copy of which partitions were served: the PartitionServer
is the one ledger of that.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

from policies.decisions.failure import Decision, ReplicaFailure
from policies.decisions.switching import Switch
from policies.messages import EpochCounts, Probation, ProgressRow, SegmentEnd



COUNTED = ("dropped_steps", "dropped_rows", "tasks_pushed", "tasks_counted", "tasks_superseded", "tasks_backup")  # mode figures that are counts: summed over an epoch's segments

@dataclass
class Recovery:
    """A reconfiguration (a recovery or a phase switch) waiting for its members' first steps (to
    time it)."""

    event: dict[str, Any]  # the replica_replaced / replica_dropped event's fields so far
    t_detect_wall: float  # when the first failure of the plan was seen
    waiting: set[int]  # ranks that have not stepped since
    stepping_at: float = 0.0
    duration_key: str = "recovery_s"  # the event's name for the time until every member stepped


@dataclass
class Plan:
    """What Reconfiguring carries out: the failures and the policy's decision for each."""

    failures: list[ReplicaFailure]
    decisions: list[Decision]
    t_detect_wall: float
    steps_at_interrupt: dict[int, int] = field(default_factory=dict)  # lock-step survivors' steps
    # rank -> how: replacements an earlier try of this repair made, alive: kept when it is carried out again
    made: dict[int, str] = field(default_factory=dict)


@dataclass
class EpochSegment:
    epoch: int
    t_start: float
    streams: dict[int, Any] = field(default_factory=dict)  # rank -> its open run_epoch stream
    heard: dict[int, float] = field(default_factory=dict)  # rank -> perf_counter of its last item
    items: list[SegmentEnd] = field(default_factory=list)  # segment ends: "epoch" / "interrupted" / "paused"
    ended: dict[int, SegmentEnd] = field(default_factory=dict)  # rank -> its last segment end this pass
    progress: list[ProgressRow] = field(default_factory=list)  # the lowest rank's progress rows
    all_progress: list[ProgressRow] = field(default_factory=list)  # every rank's (per-replica step figures)
    failures: list[ReplicaFailure] = field(default_factory=list)  # seen, not yet judged
    t_first_failure: Optional[float] = None
    recoveries: list[Recovery] = field(default_factory=list)
    started: Any = None  # the server's start_epoch call, checked once the replicas are done
    disturbed: bool = False  # the membership changed: the end of the epoch asks the server's ledger
    had_failure: bool = False
    passes: int = 1
    begun: bool = True  # False: the epoch's streams are opened when Running next runs
    fresh_signals: bool = False  # progress rows arrived since the switch policy last looked
    evaluations: dict[int, dict[int, Any]] = field(default_factory=dict)  # eval.every_steps: step -> rank -> sums
    carried: EpochCounts = field(default_factory=EpochCounts)  # what was trained before a restart inside it

    def merged(self) -> list[SegmentEnd]:
        """One totals row per rank (a rank runs several segments when the epoch was interrupted
        or needed a second pass); evaluation, loss and mode figures from its last epoch end,
        the mode's counts (`COUNTED`: backup replicas' drops) summed over the segments of
        that mode (a segment paused for a grow reported its own)."""
        merged: dict[int, SegmentEnd] = {}
        counts: dict[int, dict[tuple[str, str], int]] = {}
        for s in self.items:
            for key in COUNTED:
                if s.mode and key in s.mode:
                    c = counts.setdefault(s.rank, {})
                    c[(s.mode_name, key)] = c.get((s.mode_name, key), 0) + s.mode[key]
            merged[s.rank] = merged[s.rank].then(s) if s.rank in merged else s
        for rank, m in merged.items():
            mine = {key: v for (name, key), v in counts.get(rank, {}).items() if name == m.mode_name}
            if m.mode is not None and mine:
                merged[rank] = replace(m, mode={**m.mode, **mine})
        return [merged[r] for r in sorted(merged)]

    def counts(self, stats: Optional[list[SegmentEnd]] = None) -> EpochCounts:
        """The epoch's counts so far: steps (the furthest rank's), samples (all ranks'), train_s
        and comm_s (the slowest rank's), over its segments (`stats`, default `merged()`) plus what
        was trained before a restart inside it (`carried`)."""
        stats = self.merged() if stats is None else stats
        c = self.carried
        return EpochCounts(c.steps + max((s.steps for s in stats), default=0),
                           c.samples + sum(s.samples for s in stats),
                           c.train_s + max((s.train_s for s in stats), default=0.0),
                           c.comm_s + max((s.comm_s for s in stats), default=0.0))

    def consumed(self) -> dict[int, list[list[int]]]:
        out: dict[int, list[list[int]]] = {}
        for s in self.items:
            out.setdefault(s.rank, []).extend(s.consumed)
        return out

    def paused_ranks(self) -> list[int]:
        """The replicas whose segment ended paused (for a switch or a grow) this pass."""
        return [r for r, item in self.ended.items() if item.kind == "paused"] if self.begun else []

    def awaiting_steps(self) -> set[int]:
        return set().union(*(r.waiting for r in self.recoveries)) if self.recoveries else set()


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

    def pause_for(self, gate: Any, why: str) -> "Pending":
        """Close the pause gate (orchestrator/fleet/pause.py) for `why`: what is pending then;
        this one, unchanged, when the gate is closed already (one pause at a time)."""
        return replace(self, pause=why) if gate.close() else self

    def probation(self) -> Optional[dict[str, Any]]:
        """The guard still judging, as a checkpoint keeps it (`Guard.saved`), or None."""
        return self.guard.saved() if self.guard is not None else None


@dataclass
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


@dataclass
class Starting:
    pass


@dataclass
class Running:
    segment: EpochSegment
    pending: Pending = field(default_factory=Pending)


@dataclass
class Reconfiguring:
    plan: Union[Plan, SwitchPlan, GrowPlan, EvacuationPlan]  # failures to repair, a switch, a grow, an evacuation
    segment: EpochSegment
    pending: Pending = field(default_factory=Pending)  # then: Running(segment, pending) goes on with it


@dataclass
class Finishing:
    pass


@dataclass
class Finished:
    pass


@dataclass
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
