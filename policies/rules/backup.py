"""Backup replicas for allreduce (`strategy.backup_replicas: b`, Chen et al. 2016, "Revisiting
distributed synchronous SGD"): each step applies the gradients of the first q = h - b replicas
to finish their backward pass (h: the replicas holding a batch that step; at least 1), summed
and divided by their rows; the others' gradients are dropped, so nobody waits for a straggler.

A collective all-reduce still needs every member, so a late replica joins it with a zero
gradient and zero rows (it still votes "another batch" and "pause"): every replica applies the
same summed gradient and stays identical. What makes it pay is that a late replica stops
computing as soon as it knows it is late, rather than finishing a gradient nobody will use.

Who is in time is decided in the group's rendezvous store, one counter per step:
- a replica that has its gradient adds 1 to the step's counter; the value it gets back is its
  place: at most q, in time; above q, late (its gradient is dropped);
- before its forward pass, before its backward pass, and during a deliberate straggler's delay
  (`faults.slow_replicas`), a replica reads the counter: q already there, it is late and stops.
Exactly q gradients are applied each step (fewer only if fewer than q replicas held a batch).

Replicas agree on the counter's name without a message: every member takes the same steps in
a lock-step group, so each counts its steps from the moment it (re)started the gate, and the
gate's round number comes from one shared counter every member adds 1 to once when it
starts: the p members of a group get p consecutive values, the same `(value - 1) // p`.
h is the "another batch" sum of the step before (every member sees the same), the group's
size at a gate's first step.

A dropped batch's rows are not trained on (Chen et al. drop them too): the replica counts
them, and the epoch's metrics and its `backup_drops` event report them.
"""
from __future__ import annotations

import threading
from typing import Optional, Protocol


class Arrivals(Protocol):
    """A counter per key, shared by a group's members (the rendezvous store)."""

    def add(self, key: str, amount: int) -> int:
        """Add `amount` to `key`'s counter (created at 0) and return its new value."""

    def delete(self, key: str) -> None:
        """Forget `key`'s counter."""


class LocalArrivals:
    """`Arrivals` for replicas that are threads of one process (tests, one-process runs)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + amount
            return self.counts[key]

    def delete(self, key: str) -> None:
        with self.lock:
            self.counts.pop(key, None)


def quorum(holding: int, backups: int) -> int:
    """Gradients a step applies: the first `holding - backups` to arrive, at least one."""
    return max(1, holding - backups)


def backup_rows_per_s(speeds: list[float], backups: int) -> float:
    """Rows trained per second with `backups` backup replicas, every replica reading a batch of
    the same rows at its own speed (rows/s): a step ends when the q-th fastest is done and
    trains q batches, so q x the q-th fastest speed (q = quorum)."""
    q = quorum(len(speeds), backups)
    return q * sorted(speeds, reverse=True)[q - 1]


class BackupGate:
    """One replica's side of the backups: which step it is in, whether it is already late,
    and its place when its gradient is ready."""

    def __init__(self, backups: int, arrivals: Arrivals, world: int, rank: int) -> None:
        self.backups, self.arrivals, self.world, self.rank = backups, arrivals, world, rank
        self.round = (arrivals.add("backup-rounds", 1) - 1) // world
        self.step = 0
        self.holding = world  # replicas with a batch this step (the last step's "another batch" sum)
        self.key = ""
        self.need = quorum(world, backups)
        self.dropped_steps = 0
        self.dropped_rows = 0

    def begin(self) -> None:
        """A new step: its counter's name and how many gradients it takes."""
        self.step += 1
        self.key = f"backup/{self.round}/{self.step}"
        self.need = quorum(self.holding, self.backups)
        if self.rank == 0 and self.step > 2:  # every member is past step - 2: its counter is done with
            self.arrivals.delete(f"backup/{self.round}/{self.step - 2}")

    def late(self) -> bool:
        """The step already has its gradients without this replica's."""
        return self.arrivals.add(self.key, 0) >= self.need

    def arrive(self) -> bool:
        """This replica's gradient is ready: True when it is among the first `need`."""
        return self.arrivals.add(self.key, 1) <= self.need

    def end(self, holding_next: int, dropped_rows: Optional[int]) -> None:
        """After the step: how many replicas hold a batch next step; this replica's rows
        dropped (None: not dropped)."""
        self.holding = holding_next if holding_next > 0 else self.world  # 0: the epoch ended, all hold one next
        if dropped_rows is not None:
            self.dropped_steps += 1
            self.dropped_rows += dropped_rows

    def take_counts(self) -> dict[str, int]:
        """Drops since the last call (an epoch's end), and zero them."""
        out = {"dropped_steps": self.dropped_steps, "dropped_rows": self.dropped_rows}
        self.dropped_steps = self.dropped_rows = 0
        return out
