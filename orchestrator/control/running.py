"""Running: one epoch read from the replicas' streams until it ends (the epoch's bookkeeping,
orchestrator/control/epoch_end.py: end_epoch), or a reconfiguration is due (the next state:
Reconfiguring, carried out by orchestrator/control/reconfig/carrier.py): a failure needing a decision (the
failure policy's decisions, orchestrator/control/reconfig/repair.py), a phase switch, or a grow whose replicas
are ready.

Failures are seen here, within seconds:
- died: a stream's next item raises RayActorError (the process or its node is gone: ~0.05 s);
  ActorUnavailableError (unreachable: its node removed or cut off) reads the same, here as in
  every call (orchestrator/fleet/outcomes.py: outcome_of);
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
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

import ray

from orchestrator.control import mid_epoch
from orchestrator.control.reconfig import evacuate, phase_switch
from orchestrator.control.epoch_end import close_pass, interval_evaluation, watch_servers
from orchestrator.errors import TrainingError
from orchestrator.control.failures import fail
from orchestrator.fleet.outcomes import replica_failure
from orchestrator.control.reconfig import repair
from orchestrator.control.decide import (LEAVING, ClosePass, Exit, Grow, Interrupt, Judge, Observation, OpenEpoch,
                                         RankView, TakeCheckpoint, decide, enter, judged, normal, running)
from orchestrator.control.epoch_record import Recovery
from orchestrator.control.states import EpochSegment, Pending, State
from policies.messages import Evaluation, Progress, ProgressRow, SegmentEnd, Stepping
from policies.decisions.failure import ReplicaFailure, error_detail
from policies.rules.modes import Diverged

if TYPE_CHECKING:
    from orchestrator.control.context import RunContext
    from orchestrator.fleet.shard_group import ShardGroup
    from orchestrator.reporting.reporter import Reporter

TICK_S = 0.5  # the loop's longest wait: shard snapshots, hang checks
HANG_GRACE_S = 5.0


def run_segment(run: "RunContext", seg: EpochSegment, pending: Pending, fresh: bool = True) -> "State":
    """Running(seg, pending): observe -> decide -> act, until the epoch ends or a failure, a
    switch, a grow or an evacuation needs a reconfiguration (each state after this carries
    `pending` on), or what is pending changed (a switch decided, a pause begun or ended): then
    Running(seg, the new pending), so the controller's state is what is pending (an interrupt's
    checkpoint and the fault injector read it there). `decide` (orchestrator/control/decide.py)
    is pure: it names the exit; the actions below carry it out. Every replica's hang clock
    starts again on entry from another state (`fresh`): while that state worked (a repair, its
    restart backoff, a switch) nobody read the survivors' streams, and what they sent meanwhile
    waits unread; silence is measured from now."""
    if fresh:
        run.fleet.reader.restart_clocks()
    while True:
        now = normal(pending, run.fleet.pause.closed)  # the gate opened: the pause is over
        if now != pending:
            return running(seg, now)
        obs = observe(run, seg, pending)
        exit_ = decide(obs)
        run.ledger.decisions.note(obs, exit_)
        nxt = act(run, seg, pending, exit_)
        if nxt is not None:
            return nxt


def observe(run: "RunContext", seg: EpochSegment, pending: Pending) -> Observation:
    """One observation of the epoch for `decide`. Before the epoch opens it also looks at the
    drains (members on a drained node move first) and at a grow's replicas (ready: they join);
    while it runs, the streams' items are read by the Read action, not here."""
    record = run.ledger.epoch
    boundary = not seg.begun and not record.failures and pending.switch is None and not pending.stopping
    drained = evacuate.draining_members(run) if boundary else None
    return Observation(begun=seg.begun, failures=len(record.failures), lock_step=run.phase.lock_step,
                       open_streams=len(run.fleet.reader.streams), paused=bool(record.paused_ranks()),
                       gate=pending.pause if run.fleet.pause.closed else None,
                       switch_pending=pending.switch is not None, evacuation_pending=pending.evacuation is not None,
                       stopping=pending.stopping, drained=drained,
                       grow_ready=boundary and drained is None and run.fleet.elastic.ready_to_join(),
                       interrupted=run.fleet.interrupts.seen.is_set(),
                       ranks=rank_views(run.fleet.group.members, run.ledger.progress, run.ledger.signals))


def rank_views(members: Any, progress: dict[int, int], signals: dict[int, ProgressRow]) -> tuple[RankView, ...]:
    """Each member's update index and seconds per step (compute and communication, to the
    millisecond), from its latest report."""
    def step_s(row: Optional[ProgressRow]) -> Optional[float]:
        return None if row is None or row.compute_s is None else round(row.compute_s + (row.comm_s or 0.0), 3)
    return tuple(RankView(r, progress.get(r, 0), step_s(signals.get(r))) for r in sorted(members))


def act(run: "RunContext", seg: EpochSegment, pending: Pending, exit_: Exit) -> "Optional[State]":
    """Carry out one exit; the next state, or None to observe again."""
    if isinstance(exit_, Judge):
        if exit_.abandon_checkpoint:
            mid_epoch.abandon(run, seg, pending)  # a checkpoint inside the epoch waiting for the pause: given up
        return judge(run, seg, pending)
    if isinstance(exit_, OpenEpoch) or exit_ == Grow(mid_epoch=False):
        run.fleet.elastic.stop_pausing(pending.pause)  # an epoch boundary: a grow's pause nobody reached
    if isinstance(exit_, LEAVING):
        return enter(exit_, seg, pending)
    if isinstance(exit_, OpenEpoch):
        return running(run.open_epoch(seg, frozenset(run.ledger.epoch.awaiting_steps())), pending)
    if isinstance(exit_, TakeCheckpoint):
        mid_epoch.take(run, seg, pending)  # a checkpoint inside the epoch; then the paused replicas go on
    elif isinstance(exit_, ClosePass):
        if exit_.give_up_checkpoint:
            mid_epoch.give_up(run, pending)  # every replica ended its pass first: the epoch's end checkpoints
        return close_pass(run, seg, pending)  # Running: a further pass of the epoch started
    elif isinstance(exit_, Interrupt):
        raise KeyboardInterrupt
    else:
        now = read(run, seg, pending)
        if now != pending:
            return running(seg, now)  # a switch decided, a pause begun: the controller's state says so
    return None


def read(run: "RunContext", seg: EpochSegment, pending: Pending) -> Pending:
    """One tick: the items every ready stream sent, the servers and shards, the spares, the hang
    clocks, a grow, a drain notice, a switch and a checkpoint due (each may close the gate);
    what is pending after it."""
    record = run.ledger.epoch
    for rank, stream in run.fleet.reader.ready(TICK_S):
        read_item(run, seg, rank, stream)
    if watch_servers(run, seg.epoch) or shards_unconfirmed(run.fleet.shard_group):  # time spent waiting on a server or
        run.fleet.reader.restart_clocks()  # shard being rebuilt, or not yet known to be stopped, is no hang
    look_after_spares(run, seg.epoch)
    check_hangs(run, seg)
    if run.fleet.elastic.tick(seg.begun, judging=bool(record.failures), switching=pending.switch is not None):
        pending = replace(pending, pause="grow")  # a grow's replicas are ready: every replica pauses, then they join
    pending = evacuate.notice(run, seg, pending)  # a preemption notice: pause, then move off the node
    if record.fresh_signals or run.policies.switch.until is not None:
        record.fresh_signals = False
        pending = phase_switch.consider(run, seg, pending)  # before a checkpoint: one due at every tick never starves it
    pending = mid_epoch.consider(run, seg, pending)  # checkpoint.every_steps / every_s: pause, checkpoint, go on
    if record.failures and run.phase.lock_step and run.fleet.shard_group is not None:
        run.fleet.shard_group.abort_rounds(timeout_s=TICK_S)  # each tick: a survivor may reach the round after an abort
    return pending


def look_after_spares(run: "RunContext", epoch: int) -> None:
    """Spares found dead are replaced (`spare_replaced`), those on a node being drained are moved
    off it (`spare_evacuated`, with the node): a spare left there would die with it. Each spare
    that became ready is an event (`spare_ready`: the pool back at strength, and what it cost).
    The checkpoint keeper (checkpoint.in_memory) on a node being drained moves too
    (`keeper_evacuated`, or `keeper_evacuation_failed` with why)."""
    pool = run.fleet.group.spare_pool
    for node in pool.move_off(run.fleet.drains.look()):
        run.report.event("spare_evacuated", epoch=epoch, node=node, spares=len(pool.actors))
        run.report.say(f"node {node[:8]} is being drained: its spare moves to another node")
    if pool.check():
        run.report.event("spare_replaced", epoch=epoch, spares=len(pool.actors))
    for figures in pool.ready():
        run.report.event("spare_ready", epoch=epoch, **{k: round(v, 3) for k, v in figures.items()})
    for moved in run.checkpoints.move_keeper_off(run.fleet.drains.draining):  # checkpoint.in_memory's keeper
        if moved.failed is not None:
            run.report.event("keeper_evacuation_failed", epoch=epoch, node=moved.node, reason=moved.failed)
            run.report.say(f"node {moved.node[:8]} is being drained: the checkpoint kept in memory there "
                           f"could not move ({moved.failed}); the next checkpoint is kept on another node")
        else:
            run.report.event("keeper_evacuated", epoch=epoch, node=moved.node, to=moved.to,
                             move_s=moved.move_s, bytes=moved.bytes, done_wall=moved.done_wall)


def read_item(run: "RunContext", seg: EpochSegment, rank: int, stream: Any) -> None:
    try:
        item = ray.get(next(stream), timeout=run.cfg.strategy.timeout_s)
    except StopIteration:
        run.fleet.reader.ended(rank)
        return
    except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:  # gone, or unreachable
        fail(run, seg, replica_failure(rank, exc, replacement=rank in run.fleet.group.replacements))
        return
    except ray.exceptions.GetTimeoutError:
        fail(run, seg, ReplicaFailure(rank, "hung", f"its next item did not arrive within strategy.timeout_s "
                                      f"({run.cfg.strategy.timeout_s:g}s)", replacement=rank in run.fleet.group.replacements))
        return
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        if isinstance(cause, Diverged):  # not a fault of this replica: every replica would diverge
            raise TrainingError(f"replica {rank} epoch {seg.epoch}: {cause}") from None
        tb = str(exc)  # the replica's own traceback, as Ray carried it back
        fail(run, seg, ReplicaFailure(rank, "error", error_detail(type(cause).__name__, str(cause)), tb,
                                      replacement=rank in run.fleet.group.replacements))
        return
    run.fleet.reader.hear(rank)
    record = run.ledger.epoch
    if isinstance(item, Stepping):
        stepped(run.report, record.recoveries, rank, item.t_wall)
        return
    if isinstance(item, Evaluation):
        interval_evaluation(run, seg, rank, item)
        return
    if isinstance(item, SegmentEnd) and item.kind == "paused" and not run.fleet.pause.closed:
        # a stale pause: the replica's grant request was answered while the last switch was
        # being decided, and it heard it only after resuming: it goes on at once
        record.items.append(item)
        run.open_stream(seg, rank, resume=True)
    elif isinstance(item, SegmentEnd):
        record.items.append(item)
        record.ended[rank] = item
        run.ledger.progress[rank] = item.step
    rows = item.rows if isinstance(item, Progress) else item.progress
    if rows:
        record.all_progress += rows
        run.ledger.progress[rank] = max(run.ledger.progress.get(rank, 0), rows[-1].step)
        run.ledger.signals[rank] = rows[-1]
        record.fresh_signals = True
        note_balance(run, seg)
    if rank == min(run.fleet.group.members, default=rank) and rows:
        record.progress += rows
        last = rows[-1]
        run.report.steps(seg.epoch, last.step_in_epoch, last.loss, run.ledger.steps_per_epoch)


def shards_unconfirmed(group: "Optional[ShardGroup]") -> bool:
    """A shard has not answered a recent ping (ShardGroup.unconfirmed): after the driver was busy
    for seconds (a repair's membership step), a replica blocked on a stopped shard must not be
    taken for hung before the shard's own pings say it is stopped."""
    return group is not None and group.unconfirmed()


def check_hangs(run: "RunContext", seg: EpochSegment) -> None:
    limit = run.cfg.fault_tolerance.hang_timeout_s + (HANG_GRACE_S if run.phase.lock_step else 0.0)
    for rank, silent_s in run.fleet.reader.silent(limit):
        fail(run, seg, ReplicaFailure(rank, "hung", f"no progress for {silent_s:.0f}s",
                                      replacement=rank in run.fleet.group.replacements))


def stepped(report: "Reporter", recoveries: list[Recovery], rank: int, t_wall: float) -> None:
    """A member took its first step after a reconfiguration; the recovery's event once all have."""
    for rec in list(recoveries):
        if rank in rec.waiting:
            rec.waiting.discard(rank)
            rec.stepping_at = max(rec.stepping_at, t_wall)
            if not rec.waiting:
                recoveries.remove(rec)
                took = rec.stepping_at - rec.t_detect_wall
                report.event(**rec.event, stepping_at=round(rec.stepping_at, 3),
                                 **{rec.duration_key: round(took, 3)})
                what = {"recovery_s": "the failure was seen", "switch_s": "the switch was decided",
                        "resize_s": "the resize was decided", "evacuate_s": "the drain was seen"}[rec.duration_key]
                report.say(f"every replica stepping {took:.2f}s after {what}")


def judge(run: "RunContext", seg: EpochSegment, pending: Pending) -> "State":
    """The failure policy decides each failure; Fail ends the run, else Reconfiguring (the state
    built by decide.judged)."""
    record = run.ledger.epoch
    failures, record.failures = record.failures, []
    decisions = repair.decide(run, failures, {f.rank for f in failures})
    interrupted = {r: item.step for r, item in record.ended.items() if item.kind == "interrupted"}
    nxt = judged(seg, pending, failures, decisions, record.t_first_failure or time.time(), interrupted)
    record.t_first_failure = None
    return nxt


def note_balance(run: "RunContext", seg: EpochSegment) -> None:
    """strategy.balance: when the replicas' latest rows show a new split of the batch (every
    member's share known, summing to the global batch: rows of the same window), or of local
    SGD's round (every member's period, summing to members x strategy.period), a
    `batch_rebalanced` event with the shares and the compute seconds per step behind them; an
    uneven split during an epoch leased pinned leases the rest of it from one shared queue (the
    next epochs too, while it stays uneven)."""
    if not run.phase.strategy.get("balance"):
        return
    members = sorted(run.fleet.group.members)
    rows = [run.ledger.signals.get(r) for r in members]
    # what is split: the batch (rows a step), or local SGD's periods (steps a round)
    key = run.phase.spec.balanced_share
    unit, even = ("steps", run.phase.strategy["period"]) if key == "period" else ("rows", run.cfg.data.batch_size)
    shares = [row.figure(key) if row is not None else None for row in rows]
    if len(members) < 2 or None in shares or sum(shares) != len(members) * even:
        return
    if shares == run.phase.batch_shares:
        return
    before = run.phase.batch_shares if run.phase.batch_shares and len(run.phase.batch_shares) == len(shares) else [even] * len(members)
    run.phase.batch_shares = shares
    if shares == before:
        return
    if run.phase.pinned and len(set(shares)) > 1 and seg.begun and not run.fleet.pause.closed:
        run.fleet.server.call("pause", False, share=True)  # uneven shares: the rest of the epoch from one queue
        run.phase.pinned = False
    run.report.event("batch_rebalanced", epoch=seg.epoch, step=max(row.step for row in rows), unit=unit,
                     shares={str(r): s for r, s in zip(members, shares)},
                     shares_before={str(r): s for r, s in zip(members, before)},
                     compute_s_by_rank={str(r): row.compute_s for r, row in zip(members, rows)},
                     wait_s_by_rank={str(r): row.wait_s for r, row in zip(members, rows)})
