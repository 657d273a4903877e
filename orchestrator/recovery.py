"""Reconfiguring after failures: the failure policy's decisions carried out. Failed replicas
are replaced (a spare or a new actor) or dropped, their partitions go back to the pool, state
goes to the newcomers (from a survivor, the shards or the last checkpoint), the process group
is re-formed, and the same epoch goes on. A replica lost during a repair is decided like any
failure and folded into the plan (`replan`). How failures are seen: orchestrator/running.py."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence, Union

from orchestrator.epoch import report_finished_passes
from orchestrator.errors import MemberLost, TrainingError
from orchestrator.states import EpochSegment, Plan, Recovery
from policies.failure import DETECTED_BY, Drop, Fail, Replace, ReplicaFailure

if TYPE_CHECKING:
    from orchestrator.controller import Controller


def decide(ctl: "Controller", failures: list[ReplicaFailure], failed: set[int],
           decided: Sequence[Any] = ()) -> Union[list, Fail]:
    """The failure policy's decision for each failure (an event each), given `decided` ones
    already being carried out; the first Fail instead, if any."""
    decisions: list = []
    room = ctl.elastic.placeable(failures)  # replicas that died with their node: is there room elsewhere?
    joining = len(ctl.group.joining)  # started for a grow: they become members if nobody else is left
    for f in failures:
        survivors = joining + len([r for r in ctl.group.members if r not in failed]) + sum(
            isinstance(d, Replace) for d in [*decided, *decisions])
        placeable, note = room.get(f.rank, (True, ""))
        decision = ctl.failure_policy.decide(f, survivors, placeable, note)
        ctl.report.event("failure_decision", rank=f.rank, decision=type(decision).__name__.lower(),
                         reason=decision.reason.splitlines()[0])
        if isinstance(decision, Fail):
            return decision
        decisions.append(decision)
    return decisions


MAX_REPLANS = 5  # deaths during one repair that are folded into it before the run gives up


def reconfigure(ctl: "Controller", plan: Plan, seg: EpochSegment) -> EpochSegment:
    """Carry the plan out and return the same epoch, going on. A replica that dies meanwhile
    (a survivor, the donor or a newcomer: MemberLost) is decided by the failure policy like any
    failure and folded into the plan, which is carried out again from the top."""
    for _ in range(MAX_REPLANS):
        try:
            return carry_out(ctl, plan, seg)
        except MemberLost as lost:
            plan = replan(ctl, plan, seg, lost)
    return carry_out(ctl, plan, seg)


def replan(ctl: "Controller", plan: Plan, seg: EpochSegment, lost: MemberLost) -> Plan:
    """The plan with the replicas lost during it added (a failure event and a decision each); a
    newcomer that died is replaced again, within the restart budget."""
    now = time.time()
    new = []
    for rank in lost.ranks:
        failure = ReplicaFailure(rank, lost.cause, f"{lost.cause} during a repair ({lost.what})",
                                 replacement=rank in ctl.group.replacements)
        ctl.report.event("replica_failed", rank=rank, epoch=seg.epoch, cause=lost.cause,
                         detected_by=DETECTED_BY[lost.cause], detail=failure.detail, t_wall=round(now, 3),
                         during="repair")
        ctl.report.say(f"replica {rank} {lost.cause} during the repair ({lost.what})")
        new.append(failure)
    kept = [d for d in plan.decisions if d.rank not in lost.ranks]
    decisions = decide(ctl, new, set(lost.ranks) | {f.rank for f in plan.failures}, kept)
    if isinstance(decisions, Fail):
        raise TrainingError(f"epoch {seg.epoch}: {decisions.reason}")
    failures = [f for f in plan.failures if f.rank not in lost.ranks] + new
    steps = {r: s for r, s in plan.steps_at_interrupt.items() if r not in lost.ranks}
    return Plan(failures, kept + decisions, plan.t_detect_wall, steps)


def carry_out(ctl: "Controller", plan: Plan, seg: EpochSegment) -> EpochSegment:
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    group, lock = ctl.group, ctl.lock_step
    replaced, dropped, how = [], [], {}
    old_size = len(set(group.members) | {f.rank for f in plan.failures})
    shrink = [d for d in plan.decisions if isinstance(d, Drop) and d.shrink]
    for d in plan.decisions:
        group.remove(d.rank)  # a dead actor: a no-op; ensures nothing of it is left
        if isinstance(d, Replace):
            if d.backoff_s:
                time.sleep(d.backoff_s)
            how[d.rank], _ = group.replace(d.rank)
            replaced.append(d.rank)
        elif isinstance(d, Drop):
            dropped.append(d.rank)
    survivors = [r for r in group.ranks if r not in replaced]
    # every member gone, none replaced, replicas on their way for a grow: they are the run now
    joined = ctl.elastic.promote_joining() if not survivors and not replaced else []
    newcomers = replaced + joined
    timings["replace"] = time.perf_counter() - t0
    members = group.ranks
    report_finished_passes(ctl, seg, {f.rank for f in plan.failures})
    if not survivors and not newcomers:
        raise TrainingError(f"epoch {seg.epoch}: no replica left")
    # the ledger: the failed replicas' unfinished partitions are served again
    back = {}
    for rank in replaced + dropped:
        to = [rank] if rank in replaced and ctl.spec.pinned else (survivors or newcomers)
        back[rank] = ctl.server.call("release", rank, to)
    # state: newcomers (and any survivor that applied a step the others did not) copy a survivor
    t1 = time.perf_counter()
    timings["ledger"] = t1 - t0 - timings["replace"]
    donor, donor_step = pick_donor(ctl, plan, survivors)
    from_checkpoint = None
    if donor is None and newcomers and not ctl.spec.sharded:  # allreduce's state lived only in the replicas
        if ctl.last_state is None:
            raise TrainingError(f"epoch {seg.epoch}: every replica holding the model died at once (replicas "
                                f"{sorted(newcomers)}) and the run has no checkpoint to go on from "
                                "(checkpoint.every_epochs)")
        from_checkpoint = ctl.last_state["step"]
        donor_step = group.call(newcomers, "load_state", ctl.last_state, what="state from the last checkpoint")[0]
        ctl.report.say(f"every replica holding the model died: going on from the last checkpoint "
                       f"(replica step {from_checkpoint}); the steps since are lost")
    if ctl.spec.sharded:
        if newcomers:
            group.call(newcomers, "sync_from_shards", donor_step, what="state from the shards")
            for r in newcomers:
                ctl.shard_group.welcome_replica(r, donor_step)
    elif donor is not None:
        behind = [r for r in survivors if plan.steps_at_interrupt.get(r, donor_step) != donor_step]
        group.transfer_state(donor, replaced + behind)
    t2 = time.perf_counter()
    timings["state"] = t2 - t1
    if lock or ctl.spec.process_group or dropped:  # a smaller group: EASGD's rounds and alpha follow it
        group.form()
    t3 = time.perf_counter()
    timings["group"] = t3 - t2
    if newcomers:
        ctl.give_data(newcomers)
    if dropped:
        ctl.reslice_tests()
    timings["data"] = time.perf_counter() - t3
    lr = ctl.elastic.follow(donor_step, len(members)) if dropped else {}  # the rate follows the smaller batch
    if replaced and not dropped:
        ctl.elastic.send_lr(replaced)  # a newcomer steps at the rate the others do
    ctl.totals.replica_restarts += len(replaced)
    ctl.report.metrics([("replicas_alive", len(members), ctl.totals.steps),
                        ("replica_restarts", ctl.totals.replica_restarts, ctl.totals.steps)])
    # the epoch goes on: lock-step members all resume together; else only the newcomers start
    # (between epochs nobody does: every member starts when the next epoch opens)
    restart = (members if lock else newcomers) if seg.begun else []
    for rank in restart:
        ctl.open_stream(seg, rank, resume=rank in survivors, announce=True)
    seg.disturbed = True
    steps_lost = (1 + max(plan.steps_at_interrupt.values()) - donor_step) if (lock and plan.steps_at_interrupt) else 0
    if from_checkpoint is not None:
        steps_lost = max(ctl.progress.values(), default=from_checkpoint) - from_checkpoint
    event = {"kind": "replica_replaced" if replaced else "replica_dropped", "epoch": seg.epoch,
             "ranks": replaced or dropped, "how": {str(r): how[r] for r in replaced}, "dropped": dropped,
             "causes": {str(f.rank): f.cause for f in plan.failures}, "generation": group.generation,
             "survivors_kept": survivors, **({"joined": joined} if joined else {}), "steps_lost": steps_lost, "resumed_from_step": donor_step,
             "partitions_served_again": sorted(p for ps in back.values() for p in ps),
             "reconfigure_s": round(time.perf_counter() - t0, 3),
             "reconfigure_parts_s": {k: round(v, 3) for k, v in timings.items()}, **lr,
             **({"state_from": "checkpoint"} if from_checkpoint is not None else {})}
    if shrink:  # the cluster could not hold a replacement: the run shrank
        event.update(kind="resize", direction="shrink", reason=shrink[0].reason.splitlines()[0], old_size=old_size,
                     new_size=len(members))
    if restart:
        seg.recoveries.append(Recovery(event, plan.t_detect_wall, set(restart),
                                       duration_key="resize_s" if shrink else "recovery_s"))
    else:  # asynchronous survivors never stopped: the resize is done once they know the new size
        if shrink:
            event["resize_s"] = round(time.time() - plan.t_detect_wall, 3)
        ctl.report.event(event.pop("kind"), **event)
    ctl.report.say(f"{'replaced' if replaced else 'dropped'} replica(s) {replaced or dropped} "
                   f"({', '.join(how.values()) or 'no replacement'}); generation {group.generation}")
    return seg


def pick_donor(ctl: "Controller", plan: Plan, survivors: list[int]) -> tuple[Any, int]:
    """The survivor every newcomer copies: in lock-step modes the one with the fewest steps
    applied, so a step that some survivor applied and another did not is dropped everywhere."""
    if not survivors:
        return None, max(ctl.progress.values(), default=0)
    steps = {r: s for r, s in plan.steps_at_interrupt.items() if r in survivors}
    if steps:
        donor = min(steps, key=lambda r: (steps[r], r))
        return donor, steps[donor]
    step = min(ctl.progress.get(r, 0) for r in survivors)
    return survivors[0], step


