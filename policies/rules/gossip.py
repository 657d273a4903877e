"""gossip: decentralized SGD; every replica averages its model with its ring neighbours only.

Every replica steps its own optimizer on its own batches (momentum kept per replica); every
`period` (H) steps the replicas meet in a round. A round first sums three flags across the
group (rows, "another batch follows", "pause": a 3-float all-reduce, the lock-step protocol's
only global traffic), then moves the models:

    gossip round:     x_i <- (x_{i-1} + x_i + x_{i+1}) / 3     ring neighbours, i +- 1 mod N
                      (N = 2: x_i <- (x_0 + x_1) / 2; N = 1: nothing)
    consensus round:  x_i <- (1/N) sum_j x_j                    every replica, one all-reduce

Each replica sends its model to its two neighbours and receives theirs (point-to-point sends
on the process group: 2 M bytes a replica whatever N, where the ring all-reduce moves
2 (N-1)/N M through every link). The ring's mixing matrix is doubly stochastic, so the mean of
the replicas' models moves only by their local steps, and gossip rounds pull the replicas
towards it (the spread shrinks by the matrix's second eigenvalue a round).

A consensus round is taken where the run needs one model: the round that ends the epoch (no
replica has another batch: evaluation and the epoch's checkpoint read one replica, as in
allreduce and local SGD), the round a phase switch pauses at, and the first round in a new
process group (the run's start, after a replacement or a resize: a newcomer copied a survivor,
the survivors had drifted apart). `consensus_distance`, the mean over replicas of
||x_i - mean||, is measured at each consensus round: how far the neighbour averaging had let
the replicas spread. A round that fails (a member died: `Interrupted`) is taken again after the
regroup, as a consensus round, and the batch is not trained twice (local_sgd.py's `owed`).
Module buffers (BatchNorm statistics) are rank 0's after every round.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch.nn.utils import parameters_to_vector

from policies.messages import SegmentEnd
from policies.rules.allreduce import reducer_group
from policies.rules.local_sgd import LocalSgdWorker, copy_into


def ring_neighbours(rank: int, world: int) -> list[int]:
    """The ranks a replica averages with: its left and right on the ring (one rank for 2, none for 1)."""
    return sorted({(rank - 1) % world, (rank + 1) % world} - {rank})


class GossipWorker(LocalSgdWorker):
    """The replica-side loop body of gossip (policies/rules/modes.py's shape): local SGD's
    lock-step rounds every `period` steps (its `step`), with the round's move replaced."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, reducer: Any, period: int = 1,
                 task: Any = None, recipe: Any = None) -> None:
        super().__init__(model, optimizer, reducer, period=period, task=task, recipe=recipe)
        self.distances: list[float] = []

    def export(self) -> dict[str, Any]:
        return {}  # no state beside the model and the optimizer

    def load(self, state: Optional[dict[str, Any]]) -> None:
        self.rows_since, self.owed = 0, False

    def _round(self, more: bool, pause: bool, fresh: bool) -> tuple[int, int]:
        rank, world = reducer_group(self.reducer)
        self.rank = rank
        with torch.no_grad():
            x = parameters_to_vector(self.params)
            flags = torch.tensor([float(self.rows_since), float(more), float(pause)], dtype=x.dtype, device=x.device)
            self.reducer.wait(self.reducer.start(flags))  # Interrupted: nothing moved
            _, with_more, pausing = flags.tolist()
            if world > 1:
                if fresh or with_more == 0 or pausing > 0:  # consensus: one model where the run needs one
                    mean = x.clone()
                    self.reducer.wait(self.reducer.start(mean))
                    mean.div_(world)
                    self.distances.append(float(torch.dist(x, mean)))
                    copy_into(self.params, mean)
                else:
                    theirs = self.reducer.exchange(x, ring_neighbours(rank, world))
                    copy_into(self.params, torch.stack([x, *theirs]).mean(dim=0))
        if self.buffer_sync:
            self.buffer_sync.sync(self.reducer)
        self.pg = getattr(self.reducer, "pg", None)
        self.since, self.rows_since, self.real_since = 0, 0, 0
        self.rounds += 1
        return int(round(with_more)), int(round(pausing))

    def end_epoch(self) -> dict[str, Any]:
        distances, self.distances = self.distances, []
        rounds, self.rounds = self.rounds, 0
        return {"rounds": rounds, "consensus_distance": sum(distances) / len(distances) if distances else 0.0}


def gossip_metrics(stats: list[SegmentEnd]) -> dict[str, float]:
    """Per epoch, across replicas: the mean consensus distance at the epoch's consensus rounds,
    and rounds per second of training."""
    modes = [s.mode for s in stats]
    slowest = max(s.train_s for s in stats)
    dist = [m["consensus_distance"] for m in modes if math.isfinite(m["consensus_distance"])]
    return {"consensus_distance": sum(dist) / len(dist) if dist else 0.0,
            "rounds_per_s": max(m["rounds"] for m in modes) / max(slowest, 1e-9)}
