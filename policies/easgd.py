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
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from policies.modes import ShardClient
from policies.sharding import FlatParams

PAPER_BETA = 0.9


def default_alpha(replicas: int, beta: float = PAPER_BETA) -> float:
    return beta / replicas


@dataclass
class EasgdWorker:
    model: torch.nn.Module
    flat: FlatParams
    optimizer: torch.optim.Optimizer  # local: SGD, or SGD with Nesterov momentum (EAMSGD)
    client: ShardClient
    replicas: int
    alpha: float
    tau: int = 4
    variant: str = "async"  # async | sync
    step_count: int = 0
    distances: list[float] = field(default_factory=list)
    exchanges: int = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        self.flat.grads.zero_()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()  # the gradient at x, the parameters before any elastic move
        comm_s = 0.0
        if self.step_count % self.tau == 0:
            t0 = time.perf_counter()
            with torch.no_grad():
                if self.variant == "async":
                    d, sq = self.client.elastic(self.flat.params, self.alpha)
                    self.flat.params.sub_(d)
                else:
                    c = self.client.sync_round(self.step_count // self.tau, self.flat.params, self.replicas,
                                               self.alpha * self.replicas)
                    diff = self.flat.params - c
                    sq = float(diff.pow(2).sum())
                    self.flat.params.sub_(diff, alpha=self.alpha)
            self.distances.append(math.sqrt(sq))
            self.exchanges += 1
            comm_s = time.perf_counter() - t0
        self.optimizer.step()
        self.step_count += 1
        return float(loss.detach()), comm_s

    def end_epoch(self) -> dict[str, Any]:
        d = self.distances
        stats = {"exchanges": self.exchanges, "elastic_distance": d[-1] if d else 0.0,
                 "elastic_distance_mean": sum(d) / len(d) if d else 0.0}
        self.distances, self.exchanges = [], 0
        return stats
