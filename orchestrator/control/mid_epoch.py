"""Checkpoints inside an epoch (checkpoint.every_steps, checkpoint.every_s), so a restarted run
goes on inside the epoch instead of redoing it.

When one is due (policies/decisions/checkpointing.py: due_inside), the Running loop closes the
pause gate ("checkpoint"): every replica pauses at its next partition boundary (allreduce: all
after the same step, some of them part way through a partition). Once every stream has ended,
`take` writes the checkpoint with the run's place in the epoch (the "in_epoch" part,
orchestrator/persistence/run_state.py: InEpoch): the partitions trained whole (the server's
ledger, with the completions the paused replicas had not reported yet) and, for each partition
begun, how many rows of its in-epoch order were trained (each replica's reader counts them:
actors/partitions/reader.py `position`). Then the gate opens and the paused replicas go on where
they stopped. A run started again from that checkpoint opens the epoch with that place
(`PartitionLedger.resume_epoch`): the partitions done are not served again, a partition begun is
served from the row it had reached, so every row of the epoch is trained once across the
restart. A failure while the gate is closed gives the checkpoint up (`abandon`: the gate opens,
the asynchronous replicas that paused go on) before it is repaired; the next one comes when due.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from orchestrator.control import checkpointing
from orchestrator.control.failures import lost_meanwhile
from orchestrator.control.states import CheckpointPause, EpochSegment, Pending
from orchestrator.errors import MemberLost, TrainingError
from policies.decisions.checkpointing import due_for_drain, due_inside
from orchestrator.reporting.reporter import Action
from policies.messages import InEpochPlace

if TYPE_CHECKING:
    from orchestrator.control.context import RunContext
    from orchestrator.fleet.drains import DrainWatch
    from orchestrator.reporting.reporter import Reporter

PAUSE = "checkpoint"  # Pending.pause while the replicas pause for one


def consider(run: "RunContext", seg: EpochSegment, pending: Pending) -> Pending:
    """A checkpoint inside the epoch when one is due, or when the driver's own node is being
    drained (`driver_drained`): the gate closes. Not while another reconfiguration holds the gate
    or waits, failures wait for their decision, or a member has ended its pass (the epoch is
    closing: its end checkpoints); never in sandblaster (a pass's task sums are in no checkpoint:
    a run goes on from its last epoch end, the whole pass again)."""
    ck = run.cfg.checkpoint
    drained = driver_drained(run.fleet.drains, run.report, seg.epoch)
    asked = run.report.requests.checkpoint  # who asked, through a callback's Action.CHECKPOINT
    if run.phase.spec.coordinated:
        return pending
    if not (ck.every_steps or ck.every_s or drained or asked) or not seg.begun or run.ledger.epoch.failures \
            or run.fleet.pause.closed:
        return pending
    if pending.switch is not None or pending.evacuation is not None or pending.stopping:
        return pending
    if set(run.fleet.reader.streams) != set(run.fleet.group.members) or run.ledger.epoch.ended:
        return pending
    steps = max(run.ledger.progress.values(), default=0) - run.checkpoints.last_step
    seconds = time.perf_counter() - max(run.checkpoints.last_s, run.ledger.train_started)
    if drained or asked or due_inside(steps, seconds, ck.every_steps, ck.every_s):
        why = CheckpointPause(drained, run.report.requests.take(Action.CHECKPOINT))  # its event says what it was for
        return pending.pause_for(run.fleet.pause, PAUSE, why)
    return pending


def driver_drained(drains: "DrainWatch", report: "Reporter", epoch: int) -> bool:
    """The node this driver (and the partition server and the shards beside it) runs on is being
    drained: nothing of the run can move off it, and the driver ends with it. A checkpoint inside
    the epoch is due at once and again shortly before the deadline
    (policies/decisions/checkpointing.py: due_for_drain): the same command or job started again
    goes on from it, inside the epoch. Reported once (`driver_node_draining`)."""
    drains.look()
    deadline = drains.driver_deadline()
    if deadline is None:
        return False
    if not drains.driver_seen:
        drains.driver_seen = True
        left = round(deadline - time.time(), 1) if deadline else None
        report.event("driver_node_draining", epoch=epoch, node=drains.driver_node, deadline_left_s=left)
        report.say(f"the driver's node {drains.driver_node[:8]} is being drained (seconds left: {left}): a "
                       "checkpoint inside the epoch now and shortly before the deadline; the same command (or "
                       "job, with the same --name) started again goes on from it")
    return due_for_drain(deadline, time.time(), drains.driver_checkpoints)


def take(run: "RunContext", seg: EpochSegment, pending: Pending) -> None:
    """Every stream has ended with the gate closed for a checkpoint: write it with the epoch's
    place, open the gate, and let the paused replicas go on (module doc)."""
    why = pending.checkpoint or CheckpointPause()
    record = run.ledger.epoch
    run.fleet.reader.check_started(run.fleet.server, seg.epoch)
    ended = {r: item for r, item in record.ended.items() if item.kind in ("paused", "epoch")}
    paused = [r for r, item in ended.items() if item.kind == "paused"]
    # the completions said with a pause or a pass's end go to the ledger now (reported again
    # later by the replica or the epoch's end, they change nothing)
    status = run.fleet.server.call("finish", {r: item.unreported for r, item in ended.items() if item.unreported})
    done = {int(p) for p in status.done}
    skips: dict[int, int] = {}
    for item in ended.values():
        if item.position is not None:
            done.update(int(p) for p in item.position.full)
            skips.update({int(p): int(n) for p, n in item.position.partial.items()})
    place = InEpochPlace(seg.epoch, sorted(done), {p: n for p, n in skips.items() if p not in done}, record.counts(),
                         {r: item.step for r, item in ended.items()})
    run.ledger.in_epoch.taking = place
    details = {"in_epoch": {"epoch": seg.epoch, "partitions_done": len(place.done),
                            "partitions_begun": len(place.skips), "rows_trained": place.counts.samples,
                            "pause_s": round(time.perf_counter() - run.fleet.pause.closed_at, 4),
                            **({"for": "driver_node_draining"} if why.for_drain else
                               {"for": f"callback {why.asked_by}"} if why.asked_by else {})}}
    run.fleet.drains.driver_checkpoints += why.for_drain  # counted once taken
    try:  # one for the driver's drained node is stored before the replicas go on: the node is going, and a
        # newer checkpoint must not replace it in the background before it was written
        written = checkpointing.take(run, f"in_epoch_{seg.epoch:04d}", run.cfg.strategy.timeout_s,
                                     step=run.ledger.totals.steps + place.counts.steps, details=details, wait=why.for_drain,
                                     probation=pending.probation())
        run.ledger.totals.checkpoint = written.path
        for exc in written.lost:
            lost_meanwhile(run, seg, exc, pending)
    except TrainingError as exc:  # every member stopped or died meanwhile, or the store failed
        if isinstance(exc, MemberLost):
            lost_meanwhile(run, seg, exc, pending)
        run.report.event("checkpoint_failed", epoch=seg.epoch, reason=str(exc))
        run.report.say(f"checkpoint inside epoch {seg.epoch} not written ({exc}); the previous one is kept")
    finally:
        run.ledger.in_epoch.taking = None
    run.fleet.pause.open()
    for rank in paused:
        if rank in run.fleet.group.members and not any(f.rank == rank for f in record.failures):
            del record.ended[rank]
            run.open_stream(seg, rank, resume=True)


def give_up(run: "RunContext", pending: Pending) -> None:
    """The gate opens without the checkpoint it was closed for (every replica ended its pass
    first, or one failed): one due for the driver's drained node is due again (not counted), a
    callback's is asked again, for the next pause (Running's next turn drops the pause's reasons
    from what is pending: decide.normal)."""
    run.fleet.pause.open()
    asked_by = pending.checkpoint.asked_by if pending.checkpoint is not None else None
    if asked_by:
        run.report.requests.ask(Action.CHECKPOINT, asked_by)


def abandon(run: "RunContext", seg: EpochSegment, pending: Pending) -> None:
    """A failure while the gate is closed for a checkpoint: the checkpoint is given up and the
    gate opens before the repair. In the asynchronous modes the replicas that paused go on now
    (each reports what it trained with its next grant request); in the lock-step modes the
    repair reopens every member."""
    give_up(run, pending)
    why = "a replica failed while the replicas paused for it: given up, the next one comes when due"
    run.report.event("checkpoint_failed", epoch=seg.epoch, reason=why)
    run.report.say(f"checkpoint inside epoch {seg.epoch}: {why}")
    if run.phase.lock_step:
        return
    record = run.ledger.epoch
    failed = {f.rank for f in record.failures}
    for rank in record.paused_ranks():
        if rank in run.fleet.group.members and rank not in failed:
            del record.ended[rank]
            run.open_stream(seg, rank, resume=True)
