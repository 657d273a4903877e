"""The one carrier of every reconfiguration: a repair (or the shrink a repair can be), a phase
switch and a grow take the same steps in the same order, here; each kind says what each step
means for it (a `Change`: repair.Repair, phase_switch.Switching, grow.Grow).

    membership -> passes -> ledger -> state -> regroup -> data -> lr -> verify -> gate -> reopen -> event

- membership: who is in now (replacements, drops, replicas joining); `newcomers` hold no state yet;
- passes: the passes that ended before it go to the partition server's ledger
  (`report_finished_passes`: mid-epoch, and for a repair between epochs too);
- ledger: partitions handed back to the pool (a repair: the failed replicas' unfinished ones);
- state: the newcomers (and any member behind) take the model from a member, the shards or the
  last checkpoint; a switch consolidates state and changes every replica's update rule;
- regroup: the process group re-formed (a new generation) when the kind needs it;
- data: the newcomers get the partition server and their test slice; a new size re-cuts every
  member's test slice;
- lr: the learning rate follows the new size;
- verify: the reconfigured group is checked before it goes on (a switch evaluates its metric);
- gate: the pause gate (orchestrator/fleet/pause.py) opens if this kind closed it; a switch also says
  how the rest of the epoch is leased;
- reopen: mid-epoch, the members that go on get their streams back (`resume` unless a newcomer);
- event: the kind's event, with `reconfigure_s` and `reconfigure_parts_s` (seconds per step),
  logged once every member in `waiting` has stepped (with the seconds since the failure was
  seen or the change decided), or at once if nobody is waited for.

A replica lost during a step surfaces as `MemberLost` from the group call that found it; the
controller hands it to the failure policy (a repair folds it into its plan: repair.reconfigure).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from orchestrator.control.epoch_record import Recovery
from orchestrator.control.states import EpochSegment

if TYPE_CHECKING:
    from orchestrator.control.context import RunContext

STEPS = ("membership", "passes", "ledger", "state", "regroup", "data", "lr", "verify", "gate", "reopen")


class Change:
    """One reconfiguration's meaning of each step; the defaults do nothing."""

    kind = ""
    pause: Optional[str] = None  # the pause (Pending.pause) this kind closes the gate for, and so opens when done
    duration_key = "recovery_s"  # the event's name for the seconds until every member stepped
    passes_between_epochs = False  # report ended passes also when the epoch has not begun

    def __init__(self, t_wall: float) -> None:
        self.t_wall = t_wall  # when the failure was seen / the change decided
        self.newcomers: list[int] = []  # members that hold no state yet
        self.failed: set[int] = set()  # ranks whose ended passes are not reported
        self.resized = False  # the member count changed

    def membership(self, run: "RunContext", seg: EpochSegment) -> None: ...
    def ledger(self, run: "RunContext", seg: EpochSegment) -> None: ...
    def hand_off(self, run: "RunContext", seg: EpochSegment) -> None: ...
    def regroup(self, run: "RunContext") -> bool: return False
    def learning_rate(self, run: "RunContext") -> dict[str, Any]: return {}
    def verify(self, run: "RunContext", seg: EpochSegment) -> None: ...
    def share(self, seg: EpochSegment) -> Optional[bool]: return None  # how the rest of the epoch is leased
    def reopen(self, run: "RunContext", seg: EpochSegment) -> list[int]: return []
    def waiting(self, run: "RunContext", seg: EpochSegment, reopened: list[int]) -> list[int]: return reopened

    def event(self, run: "RunContext", seg: EpochSegment, lr: dict[str, Any],
              reopened: list[int]) -> Optional[dict[str, Any]]:
        return None


def carry_out(run: "RunContext", change: Change, seg: EpochSegment, paused: Optional[str] = None) -> EpochSegment:
    """Carry `change` out, step by step (module doc); the same epoch goes on. `paused`: why the
    replicas are pausing (the Running state's Pending.pause): the gate opens when it is this
    change's pause."""
    t0 = time.perf_counter()
    parts: dict[str, float] = {}

    def timed(name: str, fn: Callable[..., Any], *args: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - t

    timed("membership", change.membership, run, seg)
    if seg.begun or change.passes_between_epochs:
        timed("passes", report_finished_passes, run, seg, change.failed)
    timed("ledger", change.ledger, run, seg)
    timed("state", change.hand_off, run, seg)
    if change.regroup(run):
        timed("regroup", run.fleet.group.form)
    timed("data", give_data, run, change)
    lr = timed("lr", change.learning_rate, run)
    timed("verify", change.verify, run, seg)
    share = change.share(seg)
    if share is not None or (change.pause is not None and run.fleet.pause.closed and paused == change.pause):
        timed("gate", run.fleet.pause.open, share)
    reopened = change.reopen(run, seg) if seg.begun else []
    t = time.perf_counter()
    for rank in reopened:
        run.ledger.epoch.ended.pop(rank, None)
        run.open_stream(seg, rank, resume=rank not in change.newcomers, announce=True)
    if seg.begun:
        run.ledger.epoch.disturbed = True  # the end of the epoch asks the server's ledger whether it was served whole
    parts["reopen"] = time.perf_counter() - t
    event = change.event(run, seg, lr, reopened)
    if event is None:
        return seg
    event.update(reconfigure_s=round(time.perf_counter() - t0, 3),
                 reconfigure_parts_s={k: round(parts[k], 3) for k in STEPS if k in parts})
    waiting = change.waiting(run, seg, reopened)
    if waiting:
        run.ledger.epoch.recoveries.append(Recovery(event, change.t_wall, set(waiting), duration_key=change.duration_key))
    else:
        run.report.event(**event)
    return seg


def give_data(run: "RunContext", change: Change) -> None:
    if change.newcomers:
        run.give_data(change.newcomers)
    if change.resized:
        run.reslice_tests()


def report_finished_passes(run: "RunContext", seg: EpochSegment, failed: set[int]) -> None:
    """Survivors that had ended their pass before the failure: their last completions go to the
    ledger now (their next stream starts a new pass and would overwrite them)."""
    record = run.ledger.epoch
    run.fleet.reader.check_started(run.fleet.server, seg.epoch)
    done = {r: item.unreported for r, item in record.ended.items() if item.kind == "epoch" and r not in failed}
    # a failure seen after the pass closed (at the epoch's end): the completions it kept for the
    # next epoch's start go now, once (the same lists as the ended items': reported once)
    done.update(run.ledger.unreported)
    run.ledger.unreported = {}
    if done:
        run.fleet.server.call("finish", done)
    # survivors paused for a switch, a grow or an evacuation stay paused: the change still to
    # come reopens them (a replica reports what it trained since its last grant request itself
    # when it goes on); dropped here, nothing would ever reopen them
    record.ended = {r: item for r, item in record.ended.items() if item.kind == "paused" and r not in failed}
