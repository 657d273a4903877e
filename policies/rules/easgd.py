"""easgd: Elastic Averaging SGD (Zhang, Choromanska, LeCun 2015), center variable in the shards.

Replica i, every step t (asynchronous EASGD, the paper's Algorithm 1):
    x <- x_i;  g <- grad of the loss at x on the local batch
    if t % tau == 0:  d <- alpha (x - c);  x_i <- x_i - d;  c <- c + d   (the shard applies
                      c += d atomically: ShardState.elastic_exchange)
    x_i <- x_i - eta g                  (EAMSGD: a Nesterov momentum step instead)
Synchronous variant (`variant: sync`), at a barrier every tau steps with every replica:
    x_i <- x_i - alpha (x_i - c);  c <- (1 - beta) c + beta mean_i x_i     (beta = p alpha)
alpha defaults to beta / p with beta = 0.9 (the paper's choice); tau in 4..64 works.
Evaluation and the final model use the center c.

The local step is `optimizer.name`: sgd (with `strategy.momentum` > 0, Nesterov momentum:
EAMSGD), adam or adagrad.

Synchronous EASGD is lock-step (like allreduce): every replica meets every round, whatever data
it holds. Each round also counts the replicas that have a batch for that step; a replica whose
data ran out keeps taking empty steps and meeting rounds until a round where no replica has a
batch, which ends the epoch for all of them after the same step (that round is only a vote: the
center and the replicas stay where they are). Rounds are numbered by the membership generation
and the replicas' common round count in it, and the exchange happens every tau steps of the
epoch (counted from the last regroup). A round that a dead member never reaches is aborted by
the controller: the step raises `Interrupted` and is not applied, and the group meets again in
the next generation.

Reported per epoch: `elastic_distance` = ||x_i - c|| when the replica ends its epoch (the
center as the last round returned it, or pulled, for async), averaged over replicas by the
driver; `elastic_distance_mean` = the mean over this epoch's exchanges.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from policies.decisions.lr_scaling import easgd_alpha
from policies.rules.batches import rows
from policies.rules.modes import ShardClient, StepResult
from policies.rules.recipe import Recipe
from policies.rules.sharding import FlatParams
from policies.rules.tasks import Classification, Task

PAPER_BETA = 0.9


def default_alpha(replicas: int, beta: float = PAPER_BETA) -> float:
    return beta / replicas


@dataclass
class EasgdWorker:
    model: torch.nn.Module
    flat: FlatParams
    optimizer: torch.optim.Optimizer  # local: SGD, SGD with Nesterov momentum (EAMSGD), Adam, Adagrad
    client: ShardClient
    replicas: int
    alpha: float
    tau: int = 4
    variant: str = "async"  # async | sync
    step_count: int = 0
    epoch_step: int = 0  # sync: steps (real or empty) this epoch
    rounds: int = 0  # sync: rounds met so far in this generation (the same count on every replica)
    generation: int = 0  # sync: the membership generation; rounds are numbered (generation, rounds)
    distances: list[float] = field(default_factory=list)
    exchanges: int = 0
    _center: Optional[torch.Tensor] = None  # sync: the center the last round returned
    task: Task = field(default_factory=Classification)  # the loss (policies/rules/tasks.py)
    recipe: Recipe = field(default_factory=Recipe)  # micro-batches, precision, clipping (policies/rules/recipe.py)

    @property
    def lock_step(self) -> bool:
        return self.variant == "sync"

    def step(self, x: Optional[torch.Tensor], y: Optional[torch.Tensor], more: bool = False,
             pause: bool = False) -> StepResult:
        if x is not None:
            self.flat.grads.zero_()
            loss_value = self.recipe.backward(self.model, self.task, x, y)  # the gradient at x, before any elastic move
            applies = self.recipe.finite(loss_value)
        else:  # sync only: this replica's data ran out, the others' has not
            loss_value, applies = float("nan"), False
        comm_s, go_on = 0.0, True
        if self.variant == "async" and self.step_count % self.tau == 0:
            t0 = time.perf_counter()
            with torch.no_grad():
                d, sq = self.client.elastic(self.flat.params, self.alpha)
                self.flat.params.sub_(d)
            self._record(sq)
            comm_s = time.perf_counter() - t0
        elif self.variant == "sync" and self.epoch_step % self.tau == 0:
            t0 = time.perf_counter()
            c, active = self.client.sync_round((self.generation, self.rounds), self.flat.params, self.replicas,
                                               self.alpha * self.replicas, x is not None)
            self.rounds += 1
            self._center = c
            if active:
                with torch.no_grad():
                    diff = self.flat.params - c
                    self.flat.params.sub_(diff, alpha=self.alpha)
                self._record(float(diff.pow(2).sum()))
            go_on = active > 0
            comm_s = time.perf_counter() - t0
        if x is not None:
            if applies:
                self.recipe.apply(self.optimizer)  # clipped; fp16: skipped on inf/NaN
            self.step_count += 1
        self.epoch_step += 1
        if self.variant == "async":
            go_on = more
        return StepResult(loss_value, comm_s, 0 if y is None else rows(y), go_on)

    def regroup(self, replicas: int, generation: int) -> None:
        """A new membership (a replica replaced or dropped, the run resized): rounds of
        `replicas` members, numbered afresh in `generation`, every member's next step meets a
        round. beta = p alpha is kept as p changes (policies/decisions/lr_scaling.py: easgd_alpha)."""
        if replicas != self.replicas:
            self.alpha = easgd_alpha(min(self.alpha * self.replicas, replicas), replicas)
        self.replicas, self.generation, self.rounds, self.epoch_step = replicas, generation, 0, 0

    def _record(self, sq: float) -> None:
        self.distances.append(math.sqrt(sq))
        self.exchanges += 1

    def end_epoch(self) -> dict[str, Any]:
        if self.variant == "sync" and self._center is not None:
            center = self._center  # the epoch's last round was a vote: the center it returned is final
        else:
            center = torch.empty_like(self.flat.params)
            self.client.pull(center)
        d = self.distances
        stats = {"exchanges": self.exchanges,
                 "elastic_distance": float((self.flat.params - center).pow(2).sum().sqrt()),
                 "elastic_distance_mean": sum(d) / len(d) if d else 0.0}
        self.distances, self.exchanges, self.epoch_step, self._center = [], 0, 0, None
        return stats
