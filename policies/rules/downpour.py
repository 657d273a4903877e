"""downpour: asynchronous SGD through sharded parameter servers (DistBelief's Downpour SGD).

Replica side, every step t (one replica, never waiting for the others):
    if t % n_fetch == 0:  x <- pull()                     (the shards' current values)
    g <- grad of the loss at x on the local batch
    acc <- acc + g;  x <- x - eta g                       (local step until the next fetch)
    if (t + 1) % n_push == 0:  push(acc) in the background;  acc <- 0
Shard side (policies/rules/sharding.py, ShardState.apply_gradient): each push is applied as it
arrives by the shard's own optimizer, SGD or Adagrad (eta_i = gamma / sqrt(sum of squared
updates), DistBelief's stabilizer), with staleness = shard version at apply - version the
gradient was computed from; optionally eta / staleness.

Options: `max_staleness` s (stale synchronous parallel: a replica starts a step only while it
is at most s steps ahead of the slowest replica still working this epoch, so completed steps
differ by at most s + 1; shard 0 forgets a dead replica's clock as soon as the driver sees it
die), `warmstart_steps` K (rank 0 trains alone for its first K steps, then
everyone), `max_in_flight` (pushes outstanding before a replica waits: compute overlaps
communication up to that bound).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from policies.rules.batches import rows
from policies.rules.modes import ShardClient, StepResult
from policies.rules.recipe import Recipe
from policies.rules.sharding import FlatParams
from policies.rules.tasks import Classification, Task

SSP_POLL_S = 0.002


@dataclass
class DownpourWorker:
    model: torch.nn.Module
    flat: FlatParams
    client: ShardClient
    rank: int
    lr: float
    n_fetch: int = 1
    n_push: int = 1
    max_staleness: Optional[int] = None
    staleness_lr: bool = False
    warmstart_steps: int = 0
    timeout_s: float = 60.0
    step_count: int = 0
    versions: list[int] = field(default_factory=list)
    stalenesses: list[int] = field(default_factory=list)
    pushes: int = 0
    _min_clock: int = 0
    task: Task = field(default_factory=Classification)  # the loss (policies/rules/tasks.py)
    recipe: Recipe = field(default_factory=Recipe)  # micro-batches, precision, clipping (policies/rules/recipe.py)
    lr_factor: float = 1.0  # the schedule's factor at this replica's step (set by the replica each step)
    lock_step = False

    def __post_init__(self) -> None:
        self.acc = torch.zeros_like(self.flat.grads)
        # the local step between fetches: plain SGD at the scheduled rate (the shards apply optimizer.*)
        self.local = torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=self.lr)

    def step(self, x: torch.Tensor, y: torch.Tensor, more: bool = False, pause: bool = False) -> StepResult:
        comm_s = 0.0
        t0 = time.perf_counter()
        if self.step_count == 0 and self.rank > 0 and self.warmstart_steps > 0:
            self._wait_for(lambda: self.client.version() * self.n_push >= self.warmstart_steps, "warmstart")
        if self.max_staleness is not None:
            self._bound_lead()
        if self.step_count % self.n_fetch == 0:
            self.versions = self.client.pull(self.flat.params)
        comm_s += time.perf_counter() - t0

        self.flat.grads.zero_()
        loss = self.recipe.backward(self.model, self.task, x, y)
        if self.recipe.finite(loss):  # never push a non-finite gradient
            for group in self.local.param_groups:
                group["lr"] = self.lr * self.lr_factor
            if self.recipe.apply(self.local, norm=None).applied:  # clipped; fp16: skipped on inf/NaN
                self.acc.add_(self.flat.grads)
        self.step_count += 1

        if self.step_count % self.n_push == 0:
            t0 = time.perf_counter()
            self.client.push(self.acc, self.versions, self.rank, self.step_count, self.rate())
            self.acc.zero_()  # the push has been serialized: reuse the buffer
            self.pushes += 1
            self._collect()
            comm_s += time.perf_counter() - t0
        return StepResult(loss, comm_s, rows(y), more)

    def rate(self) -> tuple[bool, float]:
        """How the shards rate this push: (divide by its staleness, the schedule's factor)."""
        return (self.staleness_lr, self.lr_factor)

    def _collect(self) -> None:
        stale, min_clock = self.client.completed()
        self.stalenesses += stale
        self._min_clock = max(self._min_clock, min_clock)

    def _bound_lead(self) -> None:
        """SSP: start a step only while at most max_staleness steps ahead of the slowest replica
        (the lead itself is observed by shard 0, ShardState.max_lead)."""
        if self.step_count - self._min_clock <= self.max_staleness:
            return

        def caught_up() -> bool:
            self._min_clock = self.client.min_clock()
            return self.step_count - self._min_clock <= self.max_staleness

        self._wait_for(caught_up, "max_staleness")

    def _wait_for(self, condition, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {self.rank} waited {self.timeout_s:.0f}s for {what} (strategy.timeout_s)")
            time.sleep(SSP_POLL_S)

    def release(self) -> None:
        """A phase switch: push what was accumulated since the last push (n_push > 1) and wait
        until the shards acknowledged every push, so they hold all this replica learned."""
        if self.step_count % self.n_push and bool(self.acc.any()):
            self.client.push(self.acc, self.versions, self.rank, self.step_count, self.rate())
            self.acc.zero_()
            self.pushes += 1
        self.client.drain()
        self._collect()

    def end_epoch(self) -> dict[str, Any]:
        """Wait for this epoch's pushes; report staleness and push counts, then reset them."""
        self.client.drain()
        self._collect()
        self.client.idle(self.rank)
        s = self.stalenesses
        stats = {"pushes": self.pushes, "staleness_mean": sum(s) / len(s) if s else 0.0,
                 "staleness_max": max(s) if s else 0}
        self.stalenesses, self.pushes = [], 0
        return stats
