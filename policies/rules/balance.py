"""Load-balanced allreduce: each replica's share of the global batch follows its measured speed.
Pure decisions, tested without Ray.

Synchronous SGD steps at the pace of its slowest replica. With p replicas of batch B each, the
step trains on p*B rows whatever way they are split, and the update is the mean gradient over
those rows (policies/rules/allreduce.py weights every replica's gradient by its rows). So the split
can follow the replicas' speeds without changing the maths of the step: replica i trains on

    b_i = p*B * v_i / sum_j v_j        (v_i: rows per second of replica i's own work)

bounded to [min_share*B, max_share*B] and rounded so the b_i still sum to p*B. Every replica
then reaches the collective at the same time; with two replicas, one 3x slower, the step takes
1.5T instead of 3T (T: one replica's time for B rows).

v_i is measured, never configured: a replica's busy seconds per step (everything it does
between two collectives: loading its batch, forward and backward, a deliberate straggler's
sleep) and its rows, summed over a window of `window` steps. Every replica sees every replica's
figures (they ride in the all-reduce, policies/rules/allreduce.py), so every replica computes the same
shares and takes its own without any other message. A new split is taken only when some share
moves by more than `tolerance` of B, and a split within `tolerance` of B everywhere is taken as
the even one, so noise neither churns the split nor leaves it uneven (an even split leases its
partitions as plain allreduce does: pinned).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import Optional, Sequence

TOLERANCE = 0.1  # near even is even (BatchBalancer's share band, local SGD's predicted round time)
JUMP = 1.5  # local SGD: a round's speed this far from the tracked one is a change, not noise


def split(batch: int, speeds: Sequence[float], min_share: float = 0.25, max_share: float = 4.0) -> list[int]:
    """Rows per replica for a global batch of len(speeds) * batch rows, proportional to
    `speeds` (rows/s), each within [min_share, max_share] * batch, summing to the global batch
    (largest remainders take the leftover rows). A replica with no figure yet (speed <= 0)
    counts as the median of the others (the even share when none has one)."""
    p = len(speeds)
    total = p * batch
    known = [s for s in speeds if s > 0]
    if not known:
        return [batch] * p
    fill = median(known)
    v = [s if s > 0 else fill for s in speeds]
    lo, hi = max(1.0, min_share * batch), max_share * batch
    lo, hi = min(lo, total / p), max(hi, total / p)  # bounds that cannot hold the batch are widened
    fixed: dict[int, float] = {}
    out: dict[int, float] = {}
    while len(fixed) < p:  # water-filling: clamp who falls outside (the high side first), share the rest
        free = [i for i in range(p) if i not in fixed]
        scale = (total - sum(fixed.values())) / sum(v[i] for i in free)
        out = {i: v[i] * scale for i in free}
        high = {i: hi for i, x in out.items() if x > hi}
        low = {i: lo for i, x in out.items() if x < lo}
        if not high and not low:
            break
        fixed.update(high or low)
        out = {}
    shares = [fixed.get(i, out.get(i, 0.0)) for i in range(p)]
    if not out:  # every share at a bound (only where rounding leaves no room): the fastest takes the rest
        shares[max(range(p), key=lambda i: v[i])] += total - sum(shares)
    rows = [int(s) for s in shares]
    order = sorted(range(p), key=lambda i: (-(shares[i] - rows[i]), i))
    for i in order[: total - sum(rows)]:
        rows[i] += 1
    return rows


def track_speed(old: float, new: float, jump: float = JUMP) -> float:
    """A rank's tracked speed after a round measured `new` (local SGD's balanced periods; `old`
    <= 0: no figure yet). Half the old figure and half the new one, which damps timing noise;
    but a round at least `jump` x faster or slower than the tracked speed is a change (a
    straggler started or ended), taken alone: halving towards it would leave the next rounds
    split for a speed the replica no longer has, each waiting on the wrong replica (from 3x
    slower back to full speed, halving takes three rounds to come within 1.1x)."""
    if old <= 0 or new >= jump * old or new * jump <= old:
        return new
    return 0.5 * (old + new)


def step_time(rows: Sequence[int], speeds: Sequence[float]) -> float:
    """Seconds a lock-step step takes when replica i trains rows[i] at speeds[i] rows/s: the
    slowest one's."""
    return max(r / s for r, s in zip(rows, speeds) if s > 0) if any(s > 0 for s in speeds) else 0.0


def near_even(shares: list[int], even: int, speeds: Sequence[float], tolerance: float = TOLERANCE) -> list[int]:
    """`shares`, unless they are predicted to save less than `tolerance` of the even split's
    step time (`step_time` at `speeds`): then the even split. Where the work comes in few whole
    units (local SGD's period of 8 steps: one step is 12.5%), speeds measured 1.15x apart by
    noise alone would otherwise split 9 / 7 and make every round wait for the replica with 9."""
    flat = [even] * len(shares)
    if shares == flat or step_time(shares, speeds) <= (1 - tolerance) * step_time(flat, speeds):
        return shares
    return flat


@dataclass
class BatchBalancer:
    """Decides this run's shares from the replicas' figures, the same way on every replica."""

    world: int
    batch: int
    window: int = 8
    min_share: float = 0.25
    max_share: float = 4.0
    tolerance: float = TOLERANCE
    shares: list[int] = field(default_factory=list)
    _rows: list[float] = field(default_factory=list)
    _busy: list[float] = field(default_factory=list)
    _seen: int = 0
    known: list[float] = field(default_factory=list)  # each replica's last measured speed (0: none yet)

    def __post_init__(self) -> None:
        if not self.shares:
            self.shares = [self.batch] * self.world
        self.known = [0.0] * self.world
        self._reset()

    def _reset(self) -> None:
        self._rows, self._busy, self._seen = [0.0] * self.world, [0.0] * self.world, 0

    def observe(self, rows: Sequence[float], busy: Sequence[float]) -> Optional[list[int]]:
        """One step's figures of every replica (rows trained, busy seconds; 0 rows: an empty
        step, left out; a step nobody has figures for is not counted). Every `window` steps
        with figures, the new shares (a replica with no figure in the window, e.g. out of rows
        at an epoch's end, counts at its last measured speed) if some moved by more than
        `tolerance` x batch, else None."""
        told = [i for i in range(self.world) if rows[i] > 0 and busy[i] > 0]
        for i in told:
            self._rows[i] += rows[i]
            self._busy[i] += busy[i]
        self._seen += 1 if told else 0
        if self._seen < self.window:
            return None
        self.known = [v if v > 0 else old for v, old in zip(self.speeds(), self.known)]
        self._reset()
        new = split(self.batch, self.known, self.min_share, self.max_share)
        band = self.tolerance * self.batch
        if max(abs(a - self.batch) for a in new) <= band:
            new = [self.batch] * self.world  # near even is even: the split the run started with
        if new == self.shares or (max(abs(a - b) for a, b in zip(new, self.shares)) <= band
                                  and new != [self.batch] * self.world):
            return None
        self.shares = new
        return new

    def speeds(self) -> list[float]:
        """Rows per busy second of each replica over the window so far (0: no figure)."""
        return [r / b if b > 0 else 0.0 for r, b in zip(self._rows, self._busy)]
