"""Reconfiguring after failures: the failure policy's decisions carried out. Failed replicas
are replaced (a spare or a new actor) or dropped, their partitions go back to the pool, state
goes to the newcomers (from a survivor, the shards or the last checkpoint), the process group
is re-formed, and the same epoch goes on. A replica lost during a repair is decided like any
failure and folded into the plan (`replan`). How failures are seen: orchestrator/control/running.py."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from orchestrator.errors import MemberLost, TrainingError
from orchestrator.control.decide import repair_plan
from orchestrator.control.reconfig.carrier import Change, carry_out as carry
from orchestrator.control.states import EpochSegment, Plan
from orchestrator.fleet.model_state import for_loading
from policies.decisions.failure import DETECTED_BY, Drop, Fail, Replace, ReplicaFailure
from policies.messages import SavedState

if TYPE_CHECKING:
    from orchestrator.control.context import RunContext


def decide(run: "RunContext", failures: list[ReplicaFailure], failed: set[int],
           decided: Sequence[Any] = ()) -> Union[list, Fail]:
    """The failure policy's decision for each failure (an event each), given `decided` ones
    already being carried out; the first Fail instead, if any."""
    decisions: list = []
    room = run.fleet.elastic.placeable(failures)  # replicas that died with their node: is there room elsewhere?
    joining = len(run.fleet.group.joining)  # started for a grow: they become members if nobody else is left
    for f in failures:
        survivors = joining + len([r for r in run.fleet.group.members if r not in failed]) + sum(
            isinstance(d, Replace) for d in [*decided, *decisions])
        placeable, note = room.get(f.rank, (True, ""))
        decision = run.policies.failure.decide(f, survivors, placeable, note)
        run.report.event("failure_decision", rank=f.rank, decision=type(decision).__name__.lower(),
                         reason=decision.reason.splitlines()[0])
        if isinstance(decision, Fail):
            return decision
        decisions.append(decision)
    return decisions


MAX_REPLANS = 5  # deaths during one repair that are folded into it before the run gives up


def reconfigure(run: "RunContext", plan: Plan, seg: EpochSegment, paused: Optional[str] = None) -> EpochSegment:
    """Carry the plan out and return the same epoch, going on. A replica that dies meanwhile
    (a survivor, the donor or a newcomer: MemberLost) is decided by the failure policy like any
    failure and folded into the plan, which is carried out again from the top. `paused`: why
    the replicas were pausing (Pending.pause: a grow's pause is lifted if its newcomers become
    the members)."""
    for _ in range(MAX_REPLANS):
        repair = Repair(plan, paused)
        try:
            return carry(run, repair, seg)
        except MemberLost as lost:
            plan = replan(run, plan, seg, lost, made={r: repair.how[r] for r in repair.replaced if r not in lost.ranks})
    return carry_out(run, plan, seg, paused)


def replan(run: "RunContext", plan: Plan, seg: EpochSegment, lost: MemberLost,
           made: Optional[dict[int, str]] = None) -> Plan:
    """The plan with the replicas lost during it added (a failure event and a decision each); a
    newcomer that died is replaced again, within the restart budget. `made`: the replacements
    the try made that are alive (rank -> how): members already, kept by the next try."""
    now = time.time()
    new = []
    for rank in lost.ranks:
        cause = lost.causes[rank]
        detail, tb = lost.errors.get(rank, (f"{cause} during a repair ({lost.what})", ""))
        failure = ReplicaFailure(rank, cause, detail, tb, replacement=rank in run.fleet.group.replacements)
        run.report.event("replica_failed", rank=rank, epoch=seg.epoch, cause=cause,
                         detected_by=DETECTED_BY[cause], detail=failure.detail, t_wall=round(now, 3),
                         during="repair")
        run.report.say(f"replica {rank} {cause} during the repair ({lost.what})")
        new.append(failure)
    kept = [d for d in plan.decisions if d.rank not in lost.ranks]
    decisions = decide(run, new, set(lost.ranks) | {f.rank for f in plan.failures}, kept)
    if isinstance(decisions, Fail):
        raise TrainingError(f"epoch {seg.epoch}: {decisions.reason}")
    failures = [f for f in plan.failures if f.rank not in lost.ranks] + new
    steps = {r: s for r, s in plan.steps_at_interrupt.items() if r not in lost.ranks}
    alive = {r: how for r, how in {**plan.made, **(made or {})}.items() if r not in lost.ranks}
    return repair_plan(failures, kept + decisions, plan.t_detect_wall, steps, made=alive)


def carry_out(run: "RunContext", plan: Plan, seg: EpochSegment, paused: Optional[str] = None) -> EpochSegment:
    return carry(run, Repair(plan, paused), seg)


class Repair(Change):
    """The failure policy's decisions as the carrier's steps (orchestrator/control/reconfig/carrier.py): the
    failed replicas replaced or dropped, their partitions served again, state from a survivor,
    the shards or the last checkpoint, the group re-formed, the epoch going on."""

    kind = "repair"
    passes_between_epochs = True  # a failure seen after the pass closed: its completions go now
    counts_restart = True  # a replaced replica is a restart (an evacuation's move is not)

    def __init__(self, plan: Plan, pausing: Optional[str] = None) -> None:
        super().__init__(plan.t_detect_wall)
        self.plan, self.pausing = plan, pausing
        self.failed = {f.rank for f in plan.failures}
        self.replaced: list[int] = []
        self.dropped: list[int] = []
        self.joined: list[int] = []
        self.survivors: list[int] = []
        self.how: dict[int, str] = {}
        self.back: dict[int, list[int]] = {}
        self.shrink = [d for d in plan.decisions if isinstance(d, Drop) and d.shrink]
        self.donor_step = 0
        self.from_checkpoint: Optional[int] = None
        self.whole: Optional[dict[str, Any]] = None  # split state (fsdp): gathered before a planned move

    def membership(self, run: "RunContext", seg: EpochSegment) -> None:
        group = run.fleet.group
        self.old_size = len(set(group.members) | self.failed)
        for d in self.plan.decisions:
            if isinstance(d, Replace) and d.rank in self.plan.made and d.rank in group.members:
                self.how[d.rank] = self.plan.made[d.rank]  # made by an earlier try, alive: kept, not started again
                self.replaced.append(d.rank)
                continue
            group.remove(d.rank)  # a dead actor: a no-op; ensures nothing of it is left
            if isinstance(d, Replace):
                if d.backoff_s:
                    time.sleep(d.backoff_s)
                self.how[d.rank], _ = group.replace(d.rank, tuple(run.fleet.drains.draining))
                self.replaced.append(d.rank)
            elif isinstance(d, Drop):
                self.dropped.append(d.rank)
        self.survivors = [r for r in group.ranks if r not in self.replaced]
        # every member gone, none replaced, replicas on their way for a grow: they are the run now
        if not self.survivors and not self.replaced:
            self.joined = run.fleet.elastic.promote_joining(self.pausing)
        self.newcomers = self.replaced + self.joined
        self.resized = bool(self.dropped)
        if not self.survivors and not self.newcomers:
            raise TrainingError(f"epoch {seg.epoch}: no replica left")

    def ledger(self, run: "RunContext", seg: EpochSegment) -> None:
        """The failed replicas' unfinished partitions are served again."""
        for rank in self.replaced + self.dropped:
            to = [rank] if rank in self.replaced and run.phase.pinned else (self.survivors or self.newcomers)
            self.back[rank] = run.fleet.server.call("release", rank, to)
        run.ledger.epoch.disturbed = True

    def hand_off(self, run: "RunContext", seg: EpochSegment) -> None:
        """Newcomers (and any survivor that applied a step the others did not) copy a survivor."""
        group, newcomers = run.fleet.group, self.newcomers
        if run.phase.spec.split_state:
            self.split_hand_off(run, seg)
            return
        donor, self.donor_step = pick_donor(run.ledger.progress, self.plan, self.survivors)
        if donor is None and newcomers and not run.phase.spec.sharded:  # allreduce's state lived only in the replicas
            if run.last_state is None:
                raise TrainingError(f"epoch {seg.epoch}: every replica holding the model died at once (replicas "
                                    f"{sorted(newcomers)}) and the run has no checkpoint to go on from "
                                    "(checkpoint.every_epochs)")
            self.from_checkpoint = run.last_saved.step
            self.donor_step = group.call(newcomers, "load_state", run.last_state,
                                         what="state from the last checkpoint", peers=False)[0]
            run.report.say(f"every replica holding the model died: going on from the last checkpoint "
                           f"(replica step {self.from_checkpoint}); the steps since are lost")
        if run.phase.spec.sharded:
            if newcomers:
                group.call(newcomers, "sync_from_shards", self.donor_step, what="state from the shards", peers=False)
                for r in newcomers:
                    run.fleet.shard_group.welcome_replica(r, self.donor_step)
        elif donor is not None:
            behind = [] if run.phase.spec.survivors_keep_state else \
                [r for r in self.survivors if self.plan.steps_at_interrupt.get(r, self.donor_step) != self.donor_step]
            group.transfer_state(donor, self.replaced + behind)

    def split_hand_off(self, run: "RunContext", seg: EpochSegment) -> None:
        """Split state (fsdp): every member, survivors too, loads one whole state and re-shards it
        over the new group: the one gathered before a planned move, else the last checkpoint's (a
        failure took a slice that exists nowhere else; none yet: the initial model)."""
        state = self.whole if self.whole is not None else run.last_state
        if self.whole is None:
            self.from_checkpoint = SavedState.of(state).step if state is not None else 0
            run.report.say(f"a replica holding a slice of the model is gone: every replica goes on from the "
                           f"{'last checkpoint' if state is not None else 'initial model'} (replica step "
                           f"{self.from_checkpoint}); the steps since are lost")
        self.donor_step = run.fleet.group.call(run.fleet.group.ranks, "load_state", for_loading(state, run.phase.spec.split_state),
                                               what="the whole model's state", peers=False)[0]

    def regroup(self, run: "RunContext") -> bool:
        # a smaller group too: EASGD's rounds and alpha follow it
        return run.phase.lock_step or run.phase.spec.process_group or bool(self.dropped)

    def learning_rate(self, run: "RunContext") -> dict[str, Any]:
        members = run.fleet.group.ranks
        lr = run.fleet.elastic.follow(self.donor_step, len(members), run.rate_base()) if self.dropped else {}  # the rate follows the batch
        if self.replaced and not self.dropped:
            run.fleet.elastic.send_lr(self.replaced)  # a newcomer steps at the rate the others do
        return lr

    def reopen(self, run: "RunContext", seg: EpochSegment) -> list[int]:
        """Lock-step members all resume together; else only the newcomers start (between epochs
        nobody does: every member starts when the next epoch opens)."""
        return run.fleet.group.ranks if run.phase.lock_step else self.newcomers

    def event(self, run: "RunContext", seg: EpochSegment, lr: dict[str, Any],
              reopened: list[int]) -> dict[str, Any]:
        plan, replaced, dropped = self.plan, self.replaced, self.dropped
        if self.counts_restart:
            run.ledger.totals.replica_restarts += len(replaced)
        run.report.metrics([("replicas_alive", len(run.fleet.group.ranks), run.ledger.totals.steps),
                            ("replica_restarts", run.ledger.totals.replica_restarts, run.ledger.totals.steps)])
        steps = plan.steps_at_interrupt
        steps_lost = (1 + max(steps.values()) - self.donor_step) if (run.phase.lock_step and steps) else 0
        if self.from_checkpoint is not None:
            steps_lost = max(run.ledger.progress.values(), default=self.from_checkpoint) - self.from_checkpoint
        event = {"kind": "replica_replaced" if replaced else "replica_dropped", "epoch": seg.epoch,
                 "ranks": replaced or dropped, "how": {str(r): self.how[r] for r in replaced}, "dropped": dropped,
                 "causes": {str(f.rank): f.cause for f in plan.failures}, "generation": run.fleet.group.generation,
                 "survivors_kept": self.survivors, **({"joined": self.joined} if self.joined else {}),
                 "steps_lost": steps_lost, "resumed_from_step": self.donor_step,
                 "partitions_served_again": sorted(p for ps in self.back.values() for p in ps), **lr,
                 **({"state_from": "checkpoint"} if self.from_checkpoint is not None else {})}
        if self.shrink:  # the cluster could not hold a replacement: the run shrank
            event.update(kind="resize", direction="shrink", reason=self.shrink[0].reason.splitlines()[0],
                         old_size=self.old_size, new_size=len(run.fleet.group.ranks))
            self.duration_key = "resize_s"
            if not reopened:  # asynchronous survivors never stopped: done once they know the new size
                event["resize_s"] = round(time.time() - plan.t_detect_wall, 3)
        run.report.say(f"{'replaced' if replaced else 'dropped'} replica(s) {replaced or dropped} "
                       f"({', '.join(self.how.values()) or 'no replacement'}); generation {run.fleet.group.generation}")
        return event


def pick_donor(progress: dict[int, int], plan: Plan, survivors: list[int]) -> tuple[Any, int]:
    """The survivor every newcomer copies: in lock-step modes the one with the fewest steps
    applied, so a step that some survivor applied and another did not is dropped everywhere
    (`progress`: each member's last step reported)."""
    if not survivors:
        return None, max(progress.values(), default=0)
    steps = {r: s for r, s in plan.steps_at_interrupt.items() if r in survivors}
    if steps:
        donor = min(steps, key=lambda r: (steps[r], r))
        return donor, steps[donor]
    step = min(progress.get(r, 0) for r in survivors)
    return survivors[0], step


