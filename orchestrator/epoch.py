"""One epoch's bookkeeping with the partition server and the shards, shared by the running
epoch (orchestrator/running.py), a repair (orchestrator/recovery.py), a switch (orchestrator/switching.py) and a grow
(orchestrator/elastic.py): closing a pass over the partitions, reporting the passes that ended
before a reconfiguration, and noticing a rebuilt server or shard."""
from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.errors import TrainingError
from orchestrator.states import EpochSegment

if TYPE_CHECKING:
    from orchestrator.controller import Controller

MAX_PASSES = 8  # further passes over an epoch's unserved partitions before the run gives up


def watch_servers(ctl: "Controller", epoch: int) -> None:
    """The shards and the partition server: a dead (or stopped) one is rebuilt, whatever else
    the driver is doing (never waits)."""
    if ctl.server is not None:
        for event in ctl.server.poll():
            ctl.report.event(event.pop("kind"), **event)
            ctl.report.say(f"partition server died ({event['detected_by']}); rebuilt from its journal in "
                           f"{event['recovery_s']:.2f}s, epoch {event['epoch']} with {event['partitions_done']} "
                           f"partitions served kept")
    if ctl.shard_group is not None:
        report_shard_events(ctl, ctl.shard_group.poll(), epoch)


def report_shard_events(ctl: "Controller", events: list[dict], epoch: int) -> None:
    for event in events:
        kind = event.pop("kind", "shard_rebuilt")
        ctl.report.event(kind, epoch=epoch, **event)
        ctl.report.say(f"shard {event.get('shard')} died and was rebuilt from its snapshot "
                       f"({event.get('lost_updates')} acknowledged updates lost)")


def report_finished_passes(ctl: "Controller", seg: EpochSegment, failed: set[int]) -> None:
    """Survivors that had ended their pass before the failure: their last completions go to the
    ledger now (their next stream starts a new pass and would overwrite them)."""
    if seg.started is not None:
        ctl.server.result(seg.started, f"partition server, start of epoch {seg.epoch}")
        seg.started = None
    done = {r: item["unreported"] for r, item in seg.ended.items() if item["kind"] == "epoch" and r not in failed}
    # a failure seen after the pass closed (at the epoch's end): the completions it kept for the
    # next epoch's start go now, once (the same lists as the ended items': reported once)
    done.update(ctl.unreported)
    ctl.unreported = {}
    if done:
        ctl.server.call("finish", done)
    seg.ended = {}


def close_pass(ctl: "Controller", seg: EpochSegment):
    """Every stream ended with no failure pending. An undisturbed epoch ends here (its last
    completions are reported with the next start_epoch); else ask the server's ledger whether
    every partition was served, and start a further pass over what is left if not."""
    if seg.started is not None:
        ctl.server.result(seg.started, f"partition server, start of epoch {seg.epoch}")
        seg.started = None
    completed = {r: item["unreported"] for r, item in seg.ended.items() if item["kind"] == "epoch"}
    if not seg.disturbed:
        ctl.unreported = completed
        return ctl.end_epoch(seg)
    status = ctl.server.call("finish", completed)
    seg.ended = {}
    if status["complete"]:
        ctl.redone += status["redone"]
        return ctl.end_epoch(seg)
    seg.passes += 1
    if seg.passes > MAX_PASSES:
        raise TrainingError(f"epoch {seg.epoch}: {status['remaining']} partitions were never served")
    for rank in ctl.group.ranks:  # a further pass: every member asks the server for what is left
        ctl.open_stream(seg, rank, announce=rank in seg.awaiting_steps())
    return None
