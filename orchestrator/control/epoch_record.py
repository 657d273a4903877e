"""What the epoch's streams said, as the driver reads them (orchestrator/control/running.py):
each member's segment ends and progress rows, failures seen and not yet judged, evaluations
waiting for every member's sums, and recoveries waiting for every member to step again. One
record per epoch (the run's ledger holds the current one: RunContext.fresh_epoch makes the next,
carrying on a recovery still being timed). It holds no copy of which partitions were served:
the PartitionServer is the one ledger of that; nor the streams themselves, which are the
fleet's reader's (orchestrator/fleet/epoch_reader.py)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from policies.decisions.failure import ReplicaFailure
from policies.messages import EpochCounts, ProgressRow, SegmentEnd

COUNTED = ("dropped_steps", "dropped_rows", "tasks_pushed", "tasks_counted", "tasks_superseded", "tasks_backup")  # mode figures that are counts: summed over an epoch's segments


@dataclass
class Recovery:
    """A reconfiguration (a recovery or a phase switch) waiting for its members' first steps (to
    time it)."""

    event: dict[str, Any]  # the replica_replaced / replica_dropped event's fields so far
    t_detect_wall: float  # when the first failure of the plan was seen
    waiting: set[int]  # ranks that have not stepped since
    stepping_at: float = 0.0
    duration_key: str = "recovery_s"  # the event's name for the time until every member stepped


@dataclass
class EpochRecord:
    """The current epoch's (module doc): changed in place as the streams are read, replaced whole
    when the next epoch's segment is made."""

    items: list[SegmentEnd] = field(default_factory=list)  # segment ends: "epoch" / "interrupted" / "paused"
    ended: dict[int, SegmentEnd] = field(default_factory=dict)  # rank -> its last segment end this pass
    progress: list[ProgressRow] = field(default_factory=list)  # the lowest rank's progress rows
    all_progress: list[ProgressRow] = field(default_factory=list)  # every rank's (per-replica step figures)
    failures: list[ReplicaFailure] = field(default_factory=list)  # seen, not yet judged
    t_first_failure: Optional[float] = None
    recoveries: list[Recovery] = field(default_factory=list)
    disturbed: bool = False  # the membership changed: the end of the epoch asks the server's ledger
    had_failure: bool = False
    fresh_signals: bool = False  # progress rows arrived since the switch policy last looked
    evaluations: dict[int, dict[int, Any]] = field(default_factory=dict)  # eval.every_steps: step -> rank -> sums
    carried: EpochCounts = field(default_factory=EpochCounts)  # what was trained before a restart inside it

    def merged(self) -> list[SegmentEnd]:
        """One totals row per rank (a rank runs several segments when the epoch was interrupted
        or needed a second pass); evaluation, loss and mode figures from its last epoch end,
        the mode's counts (`COUNTED`: backup replicas' drops) summed over the segments of
        that mode (a segment paused for a grow reported its own)."""
        merged: dict[int, SegmentEnd] = {}
        counts: dict[int, dict[tuple[str, str], int]] = {}
        for s in self.items:
            for key in COUNTED:
                if s.mode and key in s.mode:
                    c = counts.setdefault(s.rank, {})
                    c[(s.mode_name, key)] = c.get((s.mode_name, key), 0) + s.mode[key]
            merged[s.rank] = merged[s.rank].then(s) if s.rank in merged else s
        for rank, m in merged.items():
            mine = {key: v for (name, key), v in counts.get(rank, {}).items() if name == m.mode_name}
            if m.mode is not None and mine:
                merged[rank] = replace(m, mode={**m.mode, **mine})
        return [merged[r] for r in sorted(merged)]

    def counts(self, stats: Optional[list[SegmentEnd]] = None) -> EpochCounts:
        """The epoch's counts so far: steps (the furthest rank's), samples (all ranks'), train_s
        and comm_s (the slowest rank's), over its segments (`stats`, default `merged()`) plus what
        was trained before a restart inside it (`carried`)."""
        stats = self.merged() if stats is None else stats
        c = self.carried
        return EpochCounts(c.steps + max((s.steps for s in stats), default=0),
                           c.samples + sum(s.samples for s in stats),
                           c.train_s + max((s.train_s for s in stats), default=0.0),
                           c.comm_s + max((s.comm_s for s in stats), default=0.0))

    def consumed(self) -> dict[int, list[list[int]]]:
        out: dict[int, list[list[int]]] = {}
        for s in self.items:
            out.setdefault(s.rank, []).extend(s.consumed)
        return out

    def paused_ranks(self) -> list[int]:
        """The replicas whose segment ended paused (for a switch or a grow) this pass."""
        return [r for r, item in self.ended.items() if item.kind == "paused"]

    def awaiting_steps(self) -> set[int]:
        return set().union(*(r.waiting for r in self.recoveries)) if self.recoveries else set()
