"""The partition ledger: which partition each replica reads, so that every partition is served
exactly once per epoch whoever joins, dies or runs fast.

Pure state and decisions (the `PartitionServer` actor wraps it; tests use it directly):
- each epoch has an order of partitions, a reproducible shuffle of (seed, epoch);
- `shared` leasing (downpour, easgd): one queue, a fast replica simply leases more;
- `pinned` leasing (allreduce): replica r gets positions r, r + R, ... of the epoch's order
  (its queue is its own, so grants need no balancing; lock-step comes from the replicas' own
  flags, see policies/rules/allreduce.py);
- a grant hands out one or two partitions (shared: guided self-scheduling, a fair share of
  what is left up to the cap, `MAX_GRANT`; pinned: as many as the cap allows) and
  says when the queue is empty, so a replica makes about half as many server calls as it reads
  partitions; the cap bounds what a replica that dies holding a grant makes the others redo;
- the grants an epoch starts with are a pure function of the settings (`first_grants`): the
  driver hands them to the replicas with their epoch call while the server records the same;
- `release(rank)` (the controller saw the replica die) returns its unfinished leases to the
  front of the queue; they are served again and recorded as redone;
- `backups` (sandblaster, whose tasks count once whoever computes them): once the shared queue is
  empty, a replica that asks gets a backup copy of a partition another replica still holds (the
  newest lease of the replica that has completed fewest); whichever copy completes first counts,
  the other's completion changes nothing, and a dead holder's partition stays with its copy.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np


@dataclass(frozen=True)
class Lease:
    epoch: int
    partition: int
    seed: int  # in-partition shuffle seed for this epoch
    skip: int = 0  # rows of the partition's in-epoch order already trained before a restart (resume_epoch)
    backup: bool = False  # a backup copy of a partition another replica holds (`PartitionLedger.backups`)


MAX_GRANT = 2


@dataclass(frozen=True)
class Grant:
    leases: tuple[Lease, ...]  # empty: nothing left for this replica
    last: bool  # the queue was emptied: asking again this pass would get nothing
    drained: bool = False  # the shared queue is empty (with backups a replica still asks, for a backup copy)


def grant_size(queued: int, sharers: Optional[int], cap: int = MAX_GRANT) -> int:
    """How many partitions one grant takes from a queue of `queued` shared by `sharers`
    replicas: guided self-scheduling, a fair share of what is left (ceil(queued / sharers)),
    at most `cap`, so grants shrink to single partitions at the end (0 when the queue is
    empty). `sharers=None`: the queue is one replica's own (pinned), nothing to balance: `cap`."""
    if sharers is None:
        return min(queued, cap)
    return min(queued, cap, -(-queued // sharers))


@dataclass
class PartitionLedger:
    partitions: int
    replicas: int
    seed: int = 0
    pinned: bool = False
    shuffle: bool = True
    max_grant: int = MAX_GRANT  # 1 in runs that switch modes: a replica asks at every partition boundary
    epoch: int = 0
    queues: dict[int, deque] = field(default_factory=dict)  # rank (or -1 = shared) -> partitions to serve
    leased: dict[int, int] = field(default_factory=dict)  # partition -> rank holding it
    done: dict[int, int] = field(default_factory=dict)  # partition -> rank that completed it
    redone: list[dict] = field(default_factory=list)  # partitions released by a dead replica
    skips: dict[int, int] = field(default_factory=dict)  # partition -> rows trained before a restart (resume_epoch)
    backups: bool = False  # shared leasing only: backup copies once the queue is empty (module doc)
    copies: dict[int, int] = field(default_factory=dict)  # partition -> the rank computing its backup copy
    order: dict[int, int] = field(default_factory=dict)  # partition -> when it was leased (the epoch's count)

    def start_epoch(self, epoch: int, ranks: Optional[list[int]] = None) -> None:
        """Begin `epoch` over the replicas `ranks` (default 0..replicas-1): the membership may
        have changed since the last epoch (a replica dropped)."""
        if ranks:
            self.replicas = len(ranks)
        ranks = list(ranks) if ranks else list(range(self.replicas))
        if self.leased or (self.epoch and len(self.done) < self.partitions):
            raise RuntimeError(f"epoch {self.epoch} is not finished: {self.partitions - len(self.done)} partitions left")
        self.epoch = epoch
        order = (np.random.default_rng([self.seed, epoch]).permutation(self.partitions) if self.shuffle
                 else np.arange(self.partitions))
        if self.pinned:
            self.queues = {r: deque(int(p) for p in order[i :: len(ranks)]) for i, r in enumerate(ranks)}
        else:
            self.queues = {-1: deque(int(p) for p in order)}
        self.done, self.redone, self.skips = {}, [], {}
        self.copies, self.order = {}, {}

    def resume_epoch(self, epoch: int, ranks: list[int], done: list[int], skips: dict[int, int]) -> None:
        """Begin `epoch` again after a restart from a checkpoint taken inside it: the partitions
        in `done` were trained whole before it (recorded as done by rank -1, never served again);
        a partition in `skips` was trained up to that many rows of its in-epoch order and is
        served from there; every other partition is served in the epoch's order, as if the
        epoch had just begun."""
        self.start_epoch(epoch, ranks)
        bad = sorted(p for p in [*done, *skips] if not 0 <= int(p) < self.partitions)
        if bad:
            raise ValueError(f"epoch {epoch}: the checkpoint names partitions {bad[:5]} this run does not have "
                             f"({self.partitions} partitions)")
        gone = {int(p) for p in done}
        for key, queue in self.queues.items():
            self.queues[key] = deque(p for p in queue if p not in gone)
        self.done = {p: -1 for p in sorted(gone)}
        self.skips = {int(p): int(k) for p, k in skips.items() if int(p) not in gone and int(k) > 0}

    def lease(self, rank: int) -> Optional[Lease]:
        """The next partition for `rank`, or None when it has nothing left this epoch."""
        queue = self.queues.get(rank if self.pinned else -1)
        if not queue:
            return None
        p = queue.popleft()
        self.leased[p] = rank
        self.order[p] = len(self.order)
        return self._lease(p)

    def _lease(self, p: int, backup: bool = False) -> Lease:
        return Lease(self.epoch, p, int(np.random.default_rng([self.seed, self.epoch, p]).integers(2**31)),
                     self.skips.get(p, 0), backup)

    def grant(self, rank: int) -> Grant:
        """The next partitions for `rank` (see `grant_size`) and whether its queue is now empty;
        with `backups`, once it is, a backup copy (`backup_for`) while there is one to take."""
        queue = self.queues.get(rank if self.pinned else -1) or deque()
        n = grant_size(len(queue), None if self.pinned else self.replicas, self.max_grant)
        leases = tuple(self.lease(rank) for _ in range(n))
        if not (self.backups and not self.pinned):
            return Grant(leases, not queue, not queue)
        if not leases and not queue:
            p = self.backup_for(rank)
            if p is not None:
                self.copies[p] = rank
                return Grant((self._lease(p, backup=True),), False, True)
        return Grant(leases, not queue and self.backup_for(rank) is None, not queue)

    def backup_for(self, rank: int) -> Optional[int]:
        """The partition `rank` would back up: one another replica holds, with no copy yet, whose
        holder has completed no more partitions this epoch than `rank` (a slower replica does not
        back up a faster one), of the holder that has completed fewest (its newest lease: the one
        expected to end last); None if there is none."""
        completed = Counter(self.done.values())  # rank -> partitions it completed this epoch
        held = [p for p, r in self.leased.items()
                if r != rank and p not in self.copies and completed[r] <= completed[rank]]
        if not held:
            return None
        return max(held, key=lambda p: (-completed[self.leased[p]], self.order.get(p, -1)))

    def complete(self, rank: int, partition: int) -> None:
        """`rank` finished `partition` (its lease or its backup copy: the first of the two to
        complete counts); reported again (a call re-sent to a rebuilt server), or the second copy
        of a backed-up partition, nothing."""
        if partition in self.done and partition not in self.leased:
            if self.done[partition] == rank or self.backups:
                return
        if self.leased.get(partition) != rank and self.copies.get(partition) != rank:
            raise ValueError(f"replica {rank} completed partition {partition} it does not hold")
        del self.leased[partition]
        self.copies.pop(partition, None)
        self.done[partition] = rank

    def release(self, rank: int, survivors: Optional[list[int]] = None) -> list[int]:
        """A replica died: its leased partitions go back to be served again (to the front of the
        shared queue, or spread over the `survivors`' pinned queues; `survivors` [rank]: the
        replacement that takes the rank gets them, then the rest of the queue). Returns them."""
        for p in [p for p, r in self.copies.items() if r == rank]:  # its backup copies: the holders go on
            del self.copies[p]
        for p in [p for p, r in self.leased.items() if r == rank and p in self.copies]:
            self.leased[p] = self.copies.pop(p)  # its backup copy's replica holds it now
        back = sorted(p for p, r in self.leased.items() if r == rank)
        for p in back:
            del self.leased[p]
            self.redone.append({"epoch": self.epoch, "partition": p, "from_rank": rank})
        if self.pinned:
            rest = list(self.queues.pop(rank, deque()))
            alive = survivors or [r for r in self.queues]
            for i, p in enumerate(back + rest):  # survivors [rank]: its replacement takes the same queue
                self.queues.setdefault(alive[i % len(alive)], deque()).append(p)
        else:
            self.queues[-1].extendleft(reversed(back))
        return back

    def share_rest(self) -> None:
        """From now on this epoch, one shared queue: the replicas' pinned queues are merged (in
        the epoch's order, round by round) for an asynchronous mode after a phase switch."""
        if not self.pinned:
            return
        queues = [self.queues[r] for r in sorted(self.queues)]
        merged = deque(q[i] for i in range(max((len(q) for q in queues), default=0)) for q in queues if i < len(q))
        self.queues, self.pinned = {-1: merged}, False

    @property
    def epoch_complete(self) -> bool:
        return len(self.done) == self.partitions

    def remaining(self) -> int:
        return self.partitions - len(self.done)


def first_grants(partitions: int, replicas: int, seed: int, pinned: bool, shuffle: bool, epoch: int,
                 ranks: list[int], max_grant: int = MAX_GRANT, resume: Optional[dict[str, Any]] = None,
                 backups: bool = False) -> dict[int, Grant]:
    """The grants an epoch starts with, in `ranks` order: a pure function of the ledger's
    settings, so the driver hands them to the replicas while the server records the same ones
    (`PartitionLedger.start_epoch`, or `resume_epoch` given `resume` {"done", "skips"}, then
    `grant` for each rank in the same order)."""
    plan = PartitionLedger(partitions, replicas, seed, pinned, shuffle, max_grant, backups=backups)
    if resume is not None:
        plan.resume_epoch(epoch, ranks, resume["done"], resume["skips"])
    else:
        plan.start_epoch(epoch, ranks)
    return {rank: plan.grant(rank) for rank in ranks}


def grant_message(grant: Grant, rows: list[int]) -> dict[str, Any]:
    """A grant as it travels: {"leases": [{epoch, partition, seed, rows[, skip][, backup]}, ...]
    (empty: nothing left), "last": asking again gets nothing, "drained": the queue is empty}."""
    return {"leases": [{"epoch": x.epoch, "partition": x.partition, "seed": x.seed, "rows": rows[x.partition],
                        **({"skip": x.skip} if x.skip else {}), **({"backup": True} if x.backup else {})}
                       for x in grant.leases], "last": grant.last, "drained": grant.drained}


def first_grant_messages(rows: list[int], replicas: int, seed: int, pinned: bool, shuffle: bool, epoch: int,
                         ranks: list[int], max_grant: int = MAX_GRANT,
                         resume: Optional[dict[str, Any]] = None, backups: bool = False) -> dict[int, dict[str, Any]]:
    """What `PartitionServer.start_epoch(epoch, ranks[, resume])` grants, computed by the driver,
    which hands the grants to the replicas without waiting for the server."""
    plan = first_grants(len(rows), replicas, seed, pinned, shuffle, epoch, ranks, max_grant, resume, backups)
    return {rank: grant_message(g, rows) for rank, g in plan.items()}
