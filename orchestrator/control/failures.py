"""A failure seen, recorded in the epoch's record: the stream stops being read, the event is reported,
nobody waits for the replica any more; the failure policy decides when Running judges the
segment (orchestrator/control/running.py). Replicas lost while the driver waited on them outside a
repair (a switch, an evaluation, a checkpoint) become failures the same way."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from orchestrator.errors import MemberLost
from orchestrator.control.decide import running
from orchestrator.control.states import EpochSegment, Pending, State
from policies.decisions.failure import DETECTED_BY, ReplicaFailure

if TYPE_CHECKING:
    from orchestrator.control.context import RunContext


def fail(run: "RunContext", seg: EpochSegment, failure: ReplicaFailure) -> None:
    """A failure seen: stop reading the replica, record it, and make sure nobody waits for it."""
    run.fleet.reader.lost(failure.rank)
    record = run.ledger.epoch
    now = time.time()
    if record.t_first_failure is None:
        record.t_first_failure = now
    record.failures.append(failure)
    record.had_failure = True
    for rec in record.recoveries:
        rec.waiting.discard(failure.rank)
    run.report.event("replica_failed", rank=failure.rank, epoch=seg.epoch, cause=failure.cause,
                     detected_by=DETECTED_BY[failure.cause], detail=failure.detail, t_wall=round(now, 3),
                     **({"traceback": failure.traceback} if failure.traceback else {}))
    run.report.say(f"replica {failure.rank} {failure.cause} in epoch {seg.epoch}: {failure.detail}")
    if failure.cause != "died":  # a hung or raising replica's process is stopped now (its sockets close)
        run.fleet.group.remove(failure.rank)
    sg = run.fleet.shard_group
    if sg is not None:
        sg.forget_replica(failure.rank)  # the survivors' slowest-replica clock (SSP) must not wait for it
        if run.phase.lock_step:
            sg.abort_rounds()  # synchronous EASGD: the survivors' pending round ends now


def lost_meanwhile(run: "RunContext", seg: EpochSegment, lost: MemberLost, pending: Pending) -> "State":
    """Replicas that died while the driver waited on them outside a repair (a switch, the
    epoch's evaluation, a checkpoint): failures of the segment, judged like any other when
    Running(seg, pending) next runs."""

    now, record = time.time(), run.ledger.epoch
    for rank in lost.ranks:
        if rank in run.fleet.reader.streams or any(f.rank == rank for f in record.failures):
            continue  # its stream will say so, or it is already known
        cause = lost.causes[rank]
        detail, tb = lost.errors.get(rank, (f"{cause} while the driver waited on it ({lost.what})", ""))
        fail(run, seg, ReplicaFailure(rank, cause, detail, tb, replacement=rank in run.fleet.group.replacements))
    record.t_first_failure = record.t_first_failure or now
    return running(seg, pending)
