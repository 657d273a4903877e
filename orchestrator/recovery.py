"""Running and Reconfiguring: reading the replicas' epoch streams, seeing failures, and carrying
out the failure policy's decisions.

Failures are seen here, within seconds:
- died: a stream's next item raises RayActorError (the process or its node is gone: ~0.05 s);
- error: it raises RayTaskError (the user's model or data raised; the replica left its process
  group first, so its peers fail at once);
- hung: no item from a replica for fault_tolerance.hang_timeout_s (lock-step modes: plus
  HANG_GRACE_S, since its peers wait for it in the collective until the same timeout and end
  their segments "interrupted"; the one still silent is the hung one). It is killed.
Each becomes a `ReplicaFailure` value; lock-step modes (allreduce, synchronous EASGD) first let
every other member end its segment (their step fails: a broken collective, an aborted round),
then the policy decides; in the asynchronous modes the survivors keep training while the
replacement joins.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence, Union

import ray

from orchestrator.errors import INTERRUPTED, MemberLost, TrainingError
from orchestrator import switching
from orchestrator.epoch import close_pass, report_finished_passes, watch_servers
from orchestrator.states import EpochSegment, Errored, Plan, Reconfiguring, Recovery, Running, State
from policies.failure import Drop, Fail, Replace, ReplicaFailure, error_detail
from policies.modes import Diverged

if TYPE_CHECKING:
    from orchestrator.controller import Controller

TICK_S = 0.5  # the loop's longest wait: shard snapshots, hang checks
HANG_GRACE_S = 5.0


def run_segment(ctl: "Controller", seg: EpochSegment) -> "State":
    """Read the epoch's streams until the epoch ends or a failure needs a decision."""
    if not seg.begun:
        if seg.failures:  # a replica died between epochs (e.g. during a switch): repaired first
            return judge(ctl, seg)
        if ctl.pending_switch is not None:  # decided at the last epoch's end: switch before this one opens
            return Reconfiguring(ctl.pending_switch, seg)
        ctl.elastic.join_ready(seg)  # replicas started for a grow join at the epoch boundary
        ctl.open_epoch(seg, frozenset(seg.awaiting_steps()))
    while True:
        if seg.failures and (not ctl.lock_step or not seg.streams):
            return judge(ctl, seg)
        if not seg.streams:
            paused = any(i["kind"] == "paused" for i in seg.ended.values())
            if ctl.pause.reason == "switch" and paused:
                return Reconfiguring(ctl.pending_switch, seg)
            if ctl.pause.reason == "grow" and paused:
                ctl.elastic.join_paused(seg)  # ready newcomers join; the epoch goes on
                continue
            nxt = close_pass(ctl, seg)
            if nxt is None:
                continue  # a further pass of the epoch started
            return nxt
        if INTERRUPTED.is_set():  # a SIGTERM whose KeyboardInterrupt was swallowed where it landed
            raise KeyboardInterrupt
        ready, _ = ray.wait(list(seg.streams.values()), num_returns=1, timeout=TICK_S)
        for rank, stream in list(seg.streams.items()):
            if stream in ready:
                read_item(ctl, seg, rank, stream)
        watch_servers(ctl, seg.epoch)
        if ctl.group.check_spares():
            ctl.report.event("spare_replaced", epoch=seg.epoch, spares=len(ctl.group.spares))
        check_hangs(ctl, seg)
        ctl.elastic.tick(seg)
        if seg.fresh_signals or ctl.switch_policy.plan[ctl.switch_policy.current]["until"] is not None:
            seg.fresh_signals = False
            switching.consider(ctl, seg)
        if seg.failures and ctl.lock_step and ctl.shard_group is not None:
            ctl.shard_group.abort_rounds()  # again each tick: a survivor may reach the round after an abort


def read_item(ctl: "Controller", seg: EpochSegment, rank: int, stream: Any) -> None:
    try:
        item = ray.get(next(stream), timeout=ctl.cfg.strategy.timeout_s)
    except StopIteration:
        del seg.streams[rank]
        return
    except ray.exceptions.RayActorError as exc:
        fail(ctl, seg, ReplicaFailure(rank, "died", f"{type(exc).__name__}: the replica's process is gone",
                                      replacement=rank in ctl.group.replacements))
        return
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        if isinstance(cause, Diverged):  # not a fault of this replica: every replica would diverge
            raise TrainingError(f"replica {rank} epoch {seg.epoch}: {cause}") from None
        tb = str(exc)  # the replica's own traceback, as Ray carried it back
        fail(ctl, seg, ReplicaFailure(rank, "error", error_detail(type(cause).__name__, str(cause)), tb,
                                      replacement=rank in ctl.group.replacements))
        return
    seg.heard[rank] = time.perf_counter()
    kind = item["kind"]
    if kind == "stepping":
        stepped(ctl, seg, rank, item["t_wall"])
        return
    if kind == "paused" and not ctl.pause.closed:
        # a stale pause: the replica's grant request was answered while the last switch was
        # being decided, and it heard it only after resuming: it goes on at once
        seg.items.append(item)
        ctl.open_stream(seg, rank, resume=True)
    elif kind in ("epoch", "interrupted", "paused"):
        seg.items.append(item)
        seg.ended[rank] = item
        ctl.progress[rank] = item["step"]
    rows = item["progress"] if kind != "progress" else item["rows"]
    if rows:
        ctl.progress[rank] = max(ctl.progress.get(rank, 0), rows[-1]["step"])
        ctl.signals[rank] = rows[-1]
        seg.fresh_signals = True
    if rank == min(ctl.group.members, default=rank) and rows:
        seg.progress += rows
        last = rows[-1]
        ctl.report.steps(seg.epoch, last["step_in_epoch"], last["loss"], ctl.steps_per_epoch)


def fail(ctl: "Controller", seg: EpochSegment, failure: ReplicaFailure) -> None:
    """A failure seen: stop reading the replica, record it, and make sure nobody waits for it."""
    seg.streams.pop(failure.rank, None)
    seg.heard.pop(failure.rank, None)
    now = time.time()
    if seg.t_first_failure is None:
        seg.t_first_failure = now
    seg.failures.append(failure)
    seg.had_failure = True
    for rec in seg.recoveries:
        rec.waiting.discard(failure.rank)
    ctl.report.event("replica_failed", rank=failure.rank, epoch=seg.epoch, cause=failure.cause,
                     detected_by=DETECTED_BY[failure.cause], detail=failure.detail, t_wall=round(now, 3),
                     **({"traceback": failure.traceback} if failure.traceback else {}))
    ctl.report.say(f"replica {failure.rank} {failure.cause} in epoch {seg.epoch}: {failure.detail}")
    if failure.cause != "died":  # a hung or raising replica's process is stopped now (its sockets close)
        ctl.group.remove(failure.rank)
    sg = ctl.shard_group
    if sg is not None:
        sg.forget_replica(failure.rank)  # the survivors' slowest-replica clock (SSP) must not wait for it
        if ctl.lock_step:
            sg.abort_rounds()  # synchronous EASGD: the survivors' pending round ends now


DETECTED_BY = {"died": "actor died (its epoch stream failed)", "error": "exception raised in the replica",
               "hung": "no progress for fault_tolerance.hang_timeout_s"}


def check_hangs(ctl: "Controller", seg: EpochSegment) -> None:
    limit = ctl.cfg.fault_tolerance.hang_timeout_s + (HANG_GRACE_S if ctl.lock_step else 0.0)
    now = time.perf_counter()
    for rank in [r for r, t in seg.heard.items() if now - t > limit and r in seg.streams]:
        fail(ctl, seg, ReplicaFailure(rank, "hung", f"no progress for {now - seg.heard.get(rank, now):.0f}s",
                                      replacement=rank in ctl.group.replacements))


def stepped(ctl: "Controller", seg: EpochSegment, rank: int, t_wall: float) -> None:
    """A member took its first step after a reconfiguration; the recovery's event once all have."""
    for rec in list(seg.recoveries):
        if rank in rec.waiting:
            rec.waiting.discard(rank)
            rec.stepping_at = max(rec.stepping_at, t_wall)
            if not rec.waiting:
                seg.recoveries.remove(rec)
                took = rec.stepping_at - rec.t_detect_wall
                ctl.report.event(rec.event.pop("kind"), **rec.event, stepping_at=round(rec.stepping_at, 3),
                                 **{rec.duration_key: round(took, 3)})
                what = {"recovery_s": "the failure was seen", "switch_s": "the switch was decided",
                        "resize_s": "the resize was decided"}[rec.duration_key]
                ctl.report.say(f"every replica stepping {took:.2f}s after {what}")


def judge(ctl: "Controller", seg: EpochSegment) -> "State":
    """The failure policy decides each failure; Fail ends the run, else Reconfiguring."""

    failures, seg.failures = seg.failures, []
    failed = {f.rank for f in failures}
    decisions = decide(ctl, failures, failed)
    if isinstance(decisions, Fail):
        return Errored(TrainingError(f"epoch {seg.epoch}: {decisions.reason}"))
    steps = {r: item["step"] for r, item in seg.ended.items()
             if r not in failed and item["kind"] == "interrupted"}
    plan = Plan(failures, decisions, seg.t_first_failure or time.time(), steps)
    seg.t_first_failure = None
    return Reconfiguring(plan, seg)


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


def lost_meanwhile(ctl: "Controller", seg: EpochSegment, lost: MemberLost) -> "State":
    """Replicas that died while the driver waited on them outside a repair (a switch, the
    epoch's evaluation, a checkpoint): failures of the segment, judged like any other."""

    now = time.time()
    for rank in lost.ranks:
        if rank in seg.streams or any(f.rank == rank for f in seg.failures):
            continue  # its stream will say so, or it is already known
        fail(ctl, seg, ReplicaFailure(rank, lost.cause, f"{lost.cause} while the driver waited on it ({lost.what})",
                                      replacement=rank in ctl.group.replacements))
    seg.t_first_failure = seg.t_first_failure or now
    return Running(seg)


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


