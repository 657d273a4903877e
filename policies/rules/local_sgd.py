"""local_sgd: local SGD with period H and an outer optimizer on the average (DiLoCo), in one file.

Every replica steps its own optimizer on its own batches (momentum kept per replica); every
`period` (H) steps the replicas meet in one all-reduce and move a shared global model c:

    each replica i sends r_i (x_i - c) and r_i, its rows since the last round
    delta = sum_i r_i (x_i - c) / sum_i r_i       (the rows-weighted mean of the replicas' moves)
    outer_momentum mu = 0, outer_lr 1:  c <- c + delta              (plain model averaging)
    else (DiLoCo, Nesterov on the outer gradient g = -delta):
        m <- mu m + g;  c <- c - outer_lr (g + mu m)
    every replica: x_i <- c

With H = 1, mu = 0 and outer_lr 1 a round is one allreduce step of SGD without momentum on the
global batch: allreduce is local SGD with period 1. Larger H sends the model once per H steps
(the exchange's bytes are the model's, as allreduce's gradients). The outer state (c, m) is the
same on every replica (every replica computes it from the same sums); it travels with a
replica's exported state, so a replacement holds it too.

A round closes the step that completes a period, after that step's batch is trained. A round
that fails (a member died: `Interrupted`) moves nothing; the replica's loop takes the same step
again after the regroup, and the worker, owing only the round, does not train the batch twice.
The first step in a new process group (the run's start, a replacement, a resize) ends with a
round: the survivors' moves since c are averaged, and a newcomer (0 rows since it copied a
survivor's state) adds nothing and takes c.

Lock-step: every replica calls `step` the same number of times; one whose data ran out takes
empty steps (nothing trained). Each round also sums the replicas' "another batch follows" and
"pause" flags: the epoch ends at the first round where no replica has another batch (the round
has moved every replica to c, so the replicas are identical at every epoch's end), and a phase
switch's pause takes effect at the next round (identical there too). Module buffers (BatchNorm
statistics) are rank 0's after every round (as allreduce's `broadcast_buffers`).

Reported per epoch: `rounds`, and `local_drift`: the mean over the epoch's rounds of
||x_i - c_new|| (how far replica i had wandered from the new global model).
"""
from __future__ import annotations

import math
import time
from typing import Any, Optional

import torch
from torch.nn.utils import parameters_to_vector

from policies.messages import SegmentEnd
from policies.rules.allreduce import reducer_group
from policies.rules.buckets import BufferSync, Reducer
from policies.rules.balance import near_even, split, track_speed
from policies.rules.batches import rows as batch_rows
from policies.rules.recipe import Recipe
from policies.rules.modes import StepResult
from policies.rules.tasks import Classification, Task

ROUND_SLOTS = 3  # after the model's moves: rows since the last round, "has a batch this step", "pause"


def outer_step(center: torch.Tensor, momentum: Optional[torch.Tensor], delta: torch.Tensor,
               outer_lr: float, outer_momentum: float) -> None:
    """Move `center` in place by the averaged `delta` (the replicas' mean move): c += delta
    for plain averaging (outer_lr 1, no momentum); else Nesterov momentum on g = -delta:
    m <- mu m + g, c <- c - outer_lr (g + mu m). `momentum` (m) is updated in place."""
    if outer_momentum == 0.0:
        center.add_(delta, alpha=outer_lr)
        return
    momentum.mul_(outer_momentum).sub_(delta)  # m <- mu m + g, g = -delta
    center.add_(delta, alpha=outer_lr).sub_(momentum, alpha=outer_lr * outer_momentum)


def copy_into(params: list[torch.nn.Parameter], vector: torch.Tensor) -> None:
    """Copy a flat vector into the parameters (torch's vector_to_parameters would make them
    views of it instead)."""
    offset = 0
    for p in params:
        p.copy_(vector[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


class LocalSgdWorker:
    """The replica-side loop body for local SGD with period H (policies/rules/modes.py's shape)."""

    lock_step = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, reducer: Reducer,
                 period: int = 8, outer_lr: float = 1.0, outer_momentum: float = 0.0,
                 task: Optional[Task] = None, balance: Optional[dict[str, float]] = None,
                 recipe: Optional[Recipe] = None) -> None:
        if period < 1:
            raise ValueError(f"period must be >= 1, got {period}")
        self.model, self.optimizer, self.reducer = model, optimizer, reducer
        self.task = task or Classification()
        self.recipe = recipe or Recipe()  # micro-batches, precision, clipping of the local steps
        self.period, self.outer_lr, self.outer_momentum = int(period), float(outer_lr), float(outer_momentum)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffer_sync = BufferSync(model)
        with torch.no_grad():
            self.center = parameters_to_vector(self.params).detach().clone()
        self.momentum = torch.zeros_like(self.center) if self.outer_momentum else None
        self.since = 0  # steps (real or empty) since the last round
        self.rows_since = 0  # rows this replica trained since the last round
        self.pg: Any = None  # the process group of the last round: a new one means a round now
        self.pausing = False  # told to pause since the last round
        self.owed = False  # this step's batch was trained and its round failed: the retried step only meets
        self.rounds = 0
        self.drifts: list[float] = []
        self.balance = balance  # {min_share, max_share}: each replica's period by its speed
        self.periods: Optional[list[int]] = None  # balance: every rank's period (None: `period` for all)
        self.rank = 0  # this replica's rank in the group of the last round
        self.speeds: list[float] = []  # balance: every rank's steps per busy second, tracked over rounds
        self.real_since = 0  # balance: steps with a batch since the last round
        self.t_free: Optional[float] = None  # balance: when the last round ended (None: a new group)

    # ---- state a replacement copies ------------------------------------------------------
    def export(self) -> dict[str, Any]:
        return {"center": self.center.clone(), "momentum": None if self.momentum is None else self.momentum.clone()}

    def load(self, state: Optional[dict[str, Any]]) -> None:
        """A copy of another replica's outer state (None: the model as loaded is the global
        model, with no outer momentum yet). Rows since the last round start at 0: what this
        replica holds is someone else's work, counted there."""
        with torch.no_grad():
            if state is None:
                self.center = parameters_to_vector(self.params).detach().clone()
            else:
                self.center = state["center"].clone()
            if self.outer_momentum:
                m = state.get("momentum") if state is not None else None
                self.momentum = m.clone() if m is not None else torch.zeros_like(self.center)
        self.rows_since, self.owed = 0, False

    # ---- the step ------------------------------------------------------------------------
    def _round(self, more: bool, pause: bool, fresh: bool) -> tuple[int, int]:
        """The exchange: returns (replicas with another batch, replicas told to pause).
        `fresh`: the first round in a new process group (no speeds from the old one)."""
        rank, world = reducer_group(self.reducer)
        self.rank = rank
        figures = 2 * world if self.balance is not None else 0
        with torch.no_grad():
            x = parameters_to_vector(self.params)
            n = x.numel()
            buf = torch.zeros(n + ROUND_SLOTS + figures, dtype=x.dtype, device=x.device)
            torch.sub(x, self.center, out=buf[:n]).mul_(float(self.rows_since))
            buf[n : n + ROUND_SLOTS] = torch.tensor([float(self.rows_since), float(more), float(pause)], dtype=x.dtype)
            if figures and not fresh and self.t_free is not None:  # this replica's steps and busy seconds
                busy = time.perf_counter() - self.t_free
                buf[n + ROUND_SLOTS + 2 * rank : n + ROUND_SLOTS + 2 * rank + 2] = torch.tensor(
                    [float(self.real_since), busy], dtype=x.dtype)
            self.reducer.wait(self.reducer.start(buf))  # Interrupted: nothing moved
            rows, with_more, pausing = buf[n : n + ROUND_SLOTS].tolist()
            if figures:
                self._rebalance(buf[n + ROUND_SLOTS :].tolist(), world, fresh)
            if rows > 0:
                outer_step(self.center, self.momentum, buf[:n].div_(rows), self.outer_lr, self.outer_momentum)
                self.drifts.append(float(torch.dist(x, self.center)))
            copy_into(self.params, self.center)
        if self.buffer_sync:
            self.buffer_sync.sync(self.reducer)
        self.pg = getattr(self.reducer, "pg", None)
        self.since, self.rows_since, self.real_since = 0, 0, 0
        self.rounds += 1
        self.t_free = time.perf_counter()
        return int(round(with_more)), int(round(pausing))

    def _rebalance(self, figures: list[float], world: int, fresh: bool) -> None:
        """Every rank's period for the next round, the same on every replica: the group's
        world x period steps a round split in proportion to the ranks' speeds (steps per busy
        second, tracked over rounds by policies/rules/balance.py `track_speed`: half the last round's
        and half the figure before, or the last round's alone when it moved by 1.5x or more),
        each within [min_share, max_share] x period (policies/rules/balance.py `split`), kept even unless the
        split is predicted to shorten the round by more than balance.TOLERANCE (`near_even`:
        speeds a little apart by noise must not make every round wait for a longer period); a
        rank with no figure this round keeps its last speed."""
        if fresh or len(self.speeds) != world:
            self.speeds, self.periods = [0.0] * world, None
        for r in range(world):
            steps, busy = figures[2 * r], figures[2 * r + 1]
            if steps > 0 and busy > 0:
                self.speeds[r] = track_speed(self.speeds[r], steps / busy)
        if all(v > 0 for v in self.speeds):
            periods = split(self.period, self.speeds, self.balance["min_share"], self.balance["max_share"])
            self.periods = near_even(periods, self.period, self.speeds)

    @property
    def balanced_period(self) -> Optional[int]:
        """With balance, this replica's period now (its progress rows carry it: the controller
        leases pinned while every period is even, from one shared queue once they differ)."""
        return self.my_period if self.balance is not None else None

    @property
    def my_period(self) -> int:
        """This replica's steps between two rounds: `period`, or its balanced share of them."""
        if self.periods is None:
            return self.period
        return self.periods[self.rank]  # of this group: a new group's first step is a round, which resets them

    def step(self, x: Optional[torch.Tensor], y: Optional[torch.Tensor], more: bool = False,
             pause: bool = False) -> StepResult:
        loss_value, n = float("nan"), 0
        if x is not None and not self.owed:  # owed: trained before a round that failed; now only the round
            n = batch_rows(y)
            self.optimizer.zero_grad(set_to_none=False)
            loss_value = self.recipe.backward(self.model, self.task, x, y)
            if self.recipe.finite(loss_value):
                self.recipe.apply(self.optimizer)  # clipped; fp16: skipped on inf/NaN
            self.rows_since += n
            self.real_since += 1
        self.since += 1
        self.pausing = self.pausing or pause  # told to pause: said at the next round
        comm_s, go_on, paused, with_more = 0.0, True, False, 0
        fresh = getattr(self.reducer, "pg", None) is not self.pg  # a new process group: a round now
        if fresh or self.owed or self.since >= self.my_period:
            self.owed = True
            t0 = time.perf_counter()
            with_more, pausing = self._round(more, self.pausing, fresh)
            self.owed = self.pausing = False
            comm_s = time.perf_counter() - t0
            go_on, paused = with_more > 0, pausing > 0
        return StepResult(loss_value, comm_s, n, go_on, paused, with_more=with_more)

    def release(self) -> None:
        """Nothing to let go of: no hooks on the model."""

    def end_epoch(self) -> dict[str, Any]:
        drifts, self.drifts = self.drifts, []
        rounds, self.rounds = self.rounds, 0
        self.t_free = None  # the evaluation between epochs is nobody's step
        return {"rounds": rounds, "local_drift": sum(drifts) / len(drifts) if drifts else 0.0,
                "periods": list(self.periods) if self.periods is not None else None}


def local_sgd_metrics(stats: list[SegmentEnd]) -> dict[str, float]:
    """Per epoch, across replicas: the mean local drift, rounds per second of training and,
    balanced, each rank's period at the epoch's end (`replica<r>/period`)."""
    modes = [s.mode for s in stats]
    slowest = max(s.train_s for s in stats)
    drift = [m["local_drift"] for m in modes if math.isfinite(m["local_drift"])]
    out = {"local_drift": sum(drift) / len(drift) if drift else 0.0,
           "rounds_per_s": max(m["rounds"] for m in modes) / max(slowest, 1e-9)}
    periods = next((m["periods"] for m in modes if m.get("periods")), None)  # the same list on every replica
    for r, h in enumerate(periods or []):
        out[f"replica{r}/period"] = float(h)
    return out

