"""Preemption notices acted on before the deadline. When a node holding members is being drained
(orchestrator/fleet/drains.py: DrainWatch), the Running loop closes the pause gate ("evacuate"):
every replica pauses at its next partition boundary (allreduce: all after the same step), so no
step is in flight. Then Reconfiguring(EvacuationPlan) carries out the move as a repair whose
replicas did not fail (`Evacuate`, through the one carrier): each member on a drained node is
stopped and its rank taken by a spare or a new actor (Ray places nothing new on a draining node)
with a survivor's state (or the shards'), its unserved partitions going to its successor; when
the cluster has no room elsewhere and the run may shrink, the member is dropped instead (a
planned shrink, its partitions to the others). No `replica_failed` event, no step lost, no
restart budget spent: one `replica_evacuated` event (or `resize` shrink) with the node, the
seconds left to its deadline and `evacuate_s` (from the notice until every member stepped).
Between epochs the move is made before the next epoch opens. A member whose node goes before
the move is done is a failure like any other (orchestrator/control/running.py)."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

from orchestrator.control.decide import Drained, repair_plan
from orchestrator.control.reconfig import carrier
from orchestrator.control.reconfig.repair import Repair, reconfigure, replan
from orchestrator.fleet.model_state import whole_state
from orchestrator.errors import MemberLost
from orchestrator.control.states import EpochSegment, EvacuationPlan, Pending
from orchestrator.fleet.drains import on_draining
from policies.decisions.failure import Drop, Replace, ReplicaFailure

if TYPE_CHECKING:
    from orchestrator.control.context import RunContext


def draining_members(run: "RunContext") -> Optional[Drained]:
    """The members on nodes being drained now (looked at every DRAIN_POLL_S), or None. Not those
    on the driver's own node: they end with the driver (mid_epoch.driver_drained checkpoints)."""
    draining = dict(run.fleet.drains.look())
    if not draining:
        return None
    if run.fleet.drains.driver_deadline() is not None:
        draining.pop(run.fleet.drains.driver_node)
    group = run.fleet.group
    nodes = on_draining(group.nodes, group.ranks, draining)
    if not nodes:
        return None
    seen = min(run.fleet.drains.first_seen.get(n, time.time()) for n in nodes.values())
    return Drained(tuple((r, n, draining[n]) for r, n in sorted(nodes.items())), seen)


def notice(run: "RunContext", seg: EpochSegment, pending: Pending) -> Pending:
    """Mid-epoch: members on a drained node -> the evacuation is pending and the gate closes, so
    every replica pauses at its next partition boundary. Not while failures wait for their
    decision or another reconfiguration holds the gate (it is looked at again each tick). What
    is pending after it."""
    if pending.evacuation is not None or pending.switch is not None or run.ledger.epoch.failures \
            or run.fleet.pause.closed:
        return pending
    drained = draining_members(run)
    if drained is None:
        return pending
    plan = drained.plan()
    pending = replace(pending, evacuation=plan).pause_for(run.fleet.pause, "evacuate")
    left = {r: round(d - time.time(), 1) if d else None for r, d in plan.deadlines.items()}
    run.report.say(f"node(s) {sorted({n[:8] for n in plan.nodes.values()})} being drained (seconds left: "
                   f"{left}): moving replica(s) {sorted(plan.nodes)} off at the next partition boundary")
    return pending


def decisions(run: "RunContext", plan: EvacuationPlan) -> list[Any]:
    """Each member on a drained node: its rank taken by a spare, or by a new actor when the other
    nodes have room for one, else dropped (a shrink) while the run stays at scaling.min_replicas
    or more; with neither, replaced anyway (the new actor waits for room: its demand is what an
    autoscaler sees; with no room within the 120 s a new actor may take to start, the move fails as
    a repair would)."""
    group, out = run.fleet.group, []
    spares = group.spare_pool.usable(plan.nodes.values())
    room = run.fleet.elastic.room_outside(set(plan.nodes.values()))
    members = len(group.members)
    for rank in sorted(plan.nodes):
        node = plan.nodes[rank][:8]
        if spares:
            spares -= 1
            out.append(Replace(rank, 0.0, f"node {node} is being drained: a spare takes replica {rank}'s place"))
        elif room > 0:
            room -= 1
            out.append(Replace(rank, 0.0, f"node {node} is being drained: replica {rank} moves to another node"))
        elif members - 1 >= run.cfg.scaling.min_replicas:
            members -= 1
            out.append(Drop(rank, f"SHRINK: node {node} is being drained and no other node has room for "
                                  f"replica {rank}", shrink=True))
        else:
            out.append(Replace(rank, 0.0, f"node {node} is being drained; no room elsewhere yet and "
                                          "scaling.min_replicas forbids a shrink: a new actor waits for room"))
    return out


def carry_out(run: "RunContext", plan: EvacuationPlan, seg: EpochSegment, paused: Optional[str] = None) -> EpochSegment:
    """The move (`Evacuate`); a member lost in its middle makes it a repair of everything: the
    gate opens and the plan, with the loss decided by the failure policy, is carried out again as
    one (repair.replan), so a successor never goes on without state."""
    change = Evacuate(run, plan)
    try:
        return carrier.carry_out(run, change, seg, paused)
    except MemberLost as lost:
        if paused == "evacuate":
            run.fleet.pause.open()
        return reconfigure(run, replan(run, change.plan, seg, lost), seg, paused)


class Evacuate(Repair):
    """A repair whose replicas did not fail: the carrier's steps (orchestrator/control/reconfig/carrier.py)
    with the members on drained nodes replaced or dropped (module doc)."""

    kind = "evacuate"
    pause = "evacuate"
    duration_key = "evacuate_s"
    counts_restart = False

    def __init__(self, run: "RunContext", plan: EvacuationPlan) -> None:
        failures = [ReplicaFailure(r, "preempted", f"its node {n[:8]} is being drained") for r, n in plan.nodes.items()]
        super().__init__(repair_plan(failures, decisions(run, plan), plan.t_notice_wall))
        self.evacuation = plan
        self.paused: list[int] = []

    def membership(self, run: "RunContext", seg: EpochSegment) -> None:
        if run.phase.spec.split_state:  # every member is paused and alive: the model whole before any is stopped
            self.whole = whole_state(run.fleet.group, run.fleet.group.ranks, "the whole model before the move",
                                     run.cfg.strategy.timeout_s)
        # what the leaving replicas trained since their last grant request, said with their pause
        # or their pass's end (read now: the passes step clears the segment's ended items)
        self.trained = {r: item.unreported for r, item in run.ledger.epoch.ended.items()
                        if r in self.failed and item.kind in ("paused", "epoch") and item.unreported}
        self.paused = [r for r in run.ledger.epoch.paused_ranks() if r not in self.failed]  # they go on after the move
        sg = run.fleet.shard_group
        if sg is not None:  # the leaving ranks' staleness clocks: a successor is welcomed at its step
            for rank in self.failed:
                sg.forget_replica(rank, wait=False)
        super().membership(run, seg)

    def ledger(self, run: "RunContext", seg: EpochSegment) -> None:
        """What the leaving replicas trained since their last grant request (said with their pause)
        goes to the server's ledger first; then their unserved partitions go to their successors."""
        if self.trained:
            run.fleet.server.call("finish", self.trained)
        super().ledger(run, seg)

    def event(self, run: "RunContext", seg: EpochSegment, lr: dict[str, Any],
              reopened: list[int]) -> dict[str, Any]:
        event = super().event(run, seg, lr, reopened)
        now = time.time()
        if event["kind"] == "replica_replaced":
            event["kind"] = "replica_evacuated"
        event.update(nodes={str(r): n for r, n in self.evacuation.nodes.items()},
                     deadline_left_s={str(r): (round(d - now, 3) if d else None)
                                      for r, d in self.evacuation.deadlines.items()},
                     mid_epoch=bool(seg.begun))
        if not self.waiting(run, seg, reopened):  # nobody steps again in this epoch: done now
            event[self.duration_key] = round(now - self.evacuation.t_notice_wall, 3)
        return event

    def reopen(self, run: "RunContext", seg: EpochSegment) -> list[int]:
        """Lock-step members all resume together; else the successors start and the members
        that paused for the move go on."""
        return run.fleet.group.ranks if run.phase.lock_step else self.newcomers + self.paused

    def waiting(self, run: "RunContext", seg: EpochSegment, reopened: list[int]) -> list[int]:
        return reopened if seg.begun else run.fleet.group.ranks
