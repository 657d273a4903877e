"""The controller: a state machine whose states carry their payloads. Policies decide, the
controller acts, actors hold state and move tensors.

    Starting -> Running(segment, pending) -> ... -> Finishing -> Finished
                   |        ^
                   v        |                  any state -> Errored(error)
              Reconfiguring(plan, segment, pending)

`step()` runs the current state once and returns the next:
- Starting: actors, data into the object store, process group, first epoch's segment;
- Running(segment, pending): reads the replicas' epoch streams (orchestrator/control/running.py) until the epoch
  ends (-> the epoch's bookkeeping, then Running(next epoch) or Finishing) or a failure needs a
  decision. A failure (a replica died, hung, or its user code raised) is a value: the failure
  policy (policies/decisions/failure.py) judges it; Fail -> Errored;
- Reconfiguring(plan, segment, pending): one carrier (orchestrator/control/reconfig/carrier.py) takes the same steps
  for every kind: pause -> membership -> passes -> ledger -> state -> regroup -> data -> lr ->
  reopen. A repair plan (orchestrator/control/reconfig/repair.py: failed replicas replaced or dropped, their
  partitions back to the pool, state to the newcomers; a shrink when the cluster has no room), a
  switch plan (orchestrator/control/reconfig/phase_switch.py: state consolidated, every replica's update rule
  changed in place) or a grow plan (orchestrator/control/reconfig/elastic.py: ready replicas join);
  -> Running(same segment, pending): the epoch goes on where it was;
- Finishing: final checkpoint and artifacts.

The controller owns the state and the loop, nothing else: every handler takes the run's
contexts (orchestrator/control/context.py: RunContext with its Fleet, Phase, Ledger and Policies)
and the state's payload, never the controller. What is pending beyond the epoch (a switch
decided, a switch on probation, a stop waiting for a rollback: states.Pending) travels in the
states, from Running to Reconfiguring and back. Who owns what: the replica group (orchestrator/fleet/replica_group.py) owns the actors, ranks and
generations; the PartitionServer is the one ledger of what each epoch served; the reporter
(orchestrator/reporting/reporter.py) owns MLflow, events and the display; the mode registry
(policies/rules/registry.py) says what differs between modes.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Optional

from orchestrator.control import failures

from orchestrator.control import finishing

from orchestrator.control.reconfig import carrier

from orchestrator.control.reconfig import repair

from orchestrator.control import running

from orchestrator.control import starting

from orchestrator.control.reconfig import evacuate, phase_switch
from orchestrator.control import checkpointing
from orchestrator.control.checkpointing import Written
from orchestrator.control import decide
from orchestrator.control.context import Policies, RunContext
from orchestrator.data.in_memory import Dataset
from orchestrator.config import JobConfig
from orchestrator.control.reconfig.elastic import Elasticity
from orchestrator.control.reconfig.grow import Grow
from orchestrator.control.epoch_end import ServerWatch
from orchestrator.errors import Interrupts, MemberLost
from orchestrator.reporting.progress import ProgressDisplay
from orchestrator.persistence.run_state import RunTotals
from orchestrator.control.states import (TERMINAL, Errored, EvacuationPlan, Finishing, Plan, Reconfiguring,
                                         Running, Starting, State, SwitchPlan, state_name)
from orchestrator.reporting.tracking import Tracker

__all__ = ["Controller", "Written"]

# what callers between steps (the trainer, tests, tools) read through the controller: name ->
# where it lives in the run's contexts (orchestrator/control/context.py)
VIEW = {
    "group": "fleet.group", "shard_group": "fleet.shard_group", "server": "fleet.server", "pause": "fleet.pause",
    "elastic": "fleet.elastic", "spec": "phase.spec", "strategy": "phase.strategy", "phases": "phase.phases",
    "totals": "ledger.totals", "consumed": "ledger.consumed",
    "redone": "ledger.redone", "steps_per_epoch": "ledger.steps_per_epoch", "progress": "ledger.progress",
    "signals": "ledger.signals",
    "stop_policy": "policies.stop", "failure_policy": "policies.failure", "switch_policy": "policies.switch",
    "cfg": "cfg", "dataset": "dataset", "report": "report", "metric": "metric", "tracker": "tracker",
    "replicas": "replicas", "shards": "shards", "last_state": "last_state",
    "finish_epochs": "finish_epochs", "halt": "halt",
    "shutdown": "shutdown",
}
SETTABLE = {"tracker", "stop_policy"}


class Controller:
    def __init__(self, config: JobConfig, dataset: Dataset, tracker: Optional[Tracker], t0: float,
                 display: Optional[ProgressDisplay] = None, trace_ids: bool = False,
                 resume: Optional[dict[str, Any]] = None, interrupts: Optional[Interrupts] = None,
                 policies: Optional[Policies] = None) -> None:
        """The arguments are the run context's (orchestrator/control/context.py: RunContext);
        `policies` (failure, stop, switch, best, chance) are passed in, else the config's."""
        self.context = ctx = RunContext(config, dataset, tracker, t0, display, trace_ids, resume, interrupts, policies)
        # growing and shrinking with the cluster
        ctx.fleet.elastic = Elasticity(config.scaling, config.data, ctx.fleet.group, ctx.fleet.pause, ctx.fleet.drains,
                                       ctx.report, ctx.ledger.progress)
        ctx.position.register("batch_size", ctx.fleet.elastic.batch)  # before the rate, which follows it
        ctx.position.register("lr_schedule", ctx.fleet.elastic)  # every resize's learning-rate segment
        # while the driver waits on replicas (a repair, a switch, an evaluation): a dead shard or
        # partition server is still noticed and rebuilt, so a replica waiting for one is not left
        # waiting; True when one was (a replica that waited on it was not hung meanwhile)
        ctx.fleet.group.on_wait = ServerWatch(ctx.fleet, ctx.report, ctx.checkpoints, ctx.ledger)
        self.state: State = decide.starting()
        self._reading: Optional[Any] = None  # the segment Running left only because what is pending changed

    def launch(self) -> None:
        """Ask Ray for the actors the mode needs and return at once (orchestrator/control/starting.py)."""
        starting.launch(self.context)

    # ---- the state machine ---------------------------------------------------------------
    def step(self) -> State:
        """Run the current state once; the next state. Its seconds count under its name
        (RunTotals.state_s), whether it ends in another state or an error."""
        state = self.state
        started = time.perf_counter()
        try:
            if isinstance(state, Starting):
                nxt = decide.running(starting.start(self.context), starting.resumed_pending(self.context.resumed))
            elif isinstance(state, Running):
                fresh = self._reading is not state.segment  # entered from another state, or a new epoch
                self._reading = None
                try:
                    nxt = running.run_segment(self.context, state.segment, state.pending, fresh=fresh)
                except MemberLost as lost:
                    nxt = failures.lost_meanwhile(self.context, state.segment, lost, decide.pending_at(lost, state))
                else:
                    if isinstance(nxt, Running) and nxt.segment is state.segment:
                        self._reading = state.segment  # only what is pending changed: the same epoch read on
            elif isinstance(state, Reconfiguring):
                nxt = self._reconfigure(state)
            elif isinstance(state, Finishing):
                finishing.finish(self.context)
                nxt = decide.finished()
            else:
                return state
        except BaseException as exc:  # what was pending stays readable (the interrupted checkpoint's probation)
            self._count(state, started)
            self.state = decide.errored(exc, decide.pending_at(exc, state))
            self.context.report.state(state, self.state)
            raise
        self._count(state, started)
        self.state = nxt
        self.context.report.state(state, nxt)
        if isinstance(nxt, Errored):
            raise nxt.error
        return nxt

    def _count(self, state: State, started: float) -> None:
        spent = self.context.ledger.totals.state_s
        name = state_name(state)
        spent[name] = round(spent.get(name, 0.0) + time.perf_counter() - started, 6)

    def _reconfigure(self, state: Reconfiguring) -> State:
        """Reconfiguring: the plan as the one carrier's steps (orchestrator/control/reconfig/carrier.py),
        then Running(segment, pending) goes on. A replica lost meanwhile is a failure of the
        segment: a repair folds it into its plan (`repair.reconfigure`); a switch stays pending
        and is carried out again after that repair, from the phase it recorded; a grow's
        newcomers are members by then and the repair sees to the lost one."""
        plan, seg, pending = state.plan, state.segment, state.pending
        gate = self.context.fleet.pause  # the change opened the gate: its pause is over (decide.normal)
        if isinstance(plan, Plan):
            seg = repair.reconfigure(self.context, plan, seg, pending.pause)
            return decide.running(seg, decide.normal(pending, gate.closed))
        if isinstance(plan, EvacuationPlan):  # members off drained nodes (a lost one: folded into a repair)
            seg = evacuate.carry_out(self.context, plan, seg, pending.pause)
            return decide.running(seg, decide.normal(replace(pending, evacuation=None), gate.closed))
        switching = isinstance(plan, SwitchPlan)
        change = phase_switch.Switching(plan, pending) if switching else Grow(plan, self.context.fleet.elastic)
        try:
            seg = carrier.carry_out(self.context, change, seg, pending.pause)
            return decide.running(seg, decide.normal(change.pending if switching else pending, gate.closed))
        except MemberLost as lost:
            # a switch stays pending (with what it measured before its commit point) and is carried
            # out again after the repair; its guard is pending from its commit point on
            after = replace(change.pending, switch=change.plan) if switching else pending
            return failures.lost_meanwhile(self.context, seg, lost, decide.normal(after, gate.closed))
        except BaseException as exc:
            if switching:
                decide.holding(exc, change.pending)  # past the commit point: on probation in the new mode
            raise

    def run(self) -> RunTotals:
        while not isinstance(self.step(), TERMINAL):
            pass
        return self.context.ledger.totals

    def run_epoch(self) -> State:
        """Step until one more epoch is done (or the run ends): the tests' and tools' unit."""
        target = self.context.ledger.totals.epochs + 1
        while not isinstance(self.step(), TERMINAL) and self.context.ledger.totals.epochs < target:
            pass
        return self.state

    # ---- the view for callers between steps -------------------------------------------------
    @property
    def pending_switch(self) -> Optional[SwitchPlan]:
        """The switch decided and not carried out yet (the state's), or None."""
        pending = getattr(self.state, "pending", None)
        return pending.switch if pending is not None else None

    @property
    def rolling_back(self) -> bool:
        """A rollback was decided and not carried out yet: the replicas hold the model it undoes."""
        switch = self.pending_switch
        return switch is not None and switch.rollback is not None

    @property
    def probation(self) -> Optional[dict[str, Any]]:
        """The switch guard still judging (the state's), as a checkpoint keeps it, or None."""
        pending = getattr(self.state, "pending", None)
        return pending.probation() if pending is not None else None

    def checkpoint(self, tag: str, timeout_s: float, named: Optional[str] = None,
                   probation: Optional[dict[str, Any]] = None) -> Written:
        """A checkpoint taken and stored now (orchestrator/control/checkpointing.py: take): the
        interrupted run's, a test's."""
        return checkpointing.take(self.context, tag, timeout_s, named, probation=probation)

    def __getattr__(self, name: str) -> Any:
        where = VIEW.get(name)
        if where is None:
            raise AttributeError(f"Controller has no {name!r}")
        obj = self.__dict__["context"]
        for part in where.split("."):
            obj = getattr(obj, part)
        return obj

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SETTABLE:
            head, _, last = VIEW[name].rpartition(".")
            obj = self.context
            for part in filter(None, head.split(".")):
                obj = getattr(obj, part)
            setattr(obj, last, value)
        else:
            object.__setattr__(self, name, value)
