"""An in-process ShardClient over real ShardState objects: the shard maths without Ray."""
from __future__ import annotations

import torch

from policies.rules.sharding import ShardState, shard_bounds


class LocalShardClient:
    def __init__(self, initial: torch.Tensor, shards: int, replicas: int = 1, **opt):
        self.bounds = shard_bounds(initial.numel(), shards)
        self.states = [ShardState(initial[lo:hi].clone(), **opt) for lo, hi in self.bounds]
        self.states[0].init_clocks(replicas)
        self._stale: list[int] = []

    def values(self) -> torch.Tensor:
        return torch.cat([s.values for s in self.states])

    def pull(self, into):
        for (lo, hi), s in zip(self.bounds, self.states):
            into[lo:hi].copy_(s.values)
        return [s.version for s in self.states]

    def push(self, grad, versions, rank, step, staleness_lr):
        for (lo, hi), s, v in zip(self.bounds, self.states, versions):
            self._stale.append(s.apply_gradient(grad[lo:hi].clone(), v, staleness_lr))
        self.states[0].report_clock(rank, step)

    def completed(self):
        out, self._stale = self._stale, []
        return out, min(self.states[0].clocks.values())

    def drain(self):
        pass

    def min_clock(self):
        return min(self.states[0].clocks.values())

    def version(self):
        return self.states[0].version

    def idle(self, rank):
        self.states[0].idle(rank)

    def elastic(self, x, alpha):
        ds, sq = [], 0.0
        for (lo, hi), s in zip(self.bounds, self.states):
            d, q = s.elastic_exchange(x[lo:hi].clone(), alpha)
            ds.append(d)
            sq += q
        return torch.cat(ds), sq

    def sync_round(self, round_id, x, replicas, beta, has_data=True):
        for (lo, hi), s in zip(self.bounds, self.states):
            s.sync_contribute(round_id, x[lo:hi], replicas, beta, has_data)
        replies = [s.sync_center_before(round_id) for s in self.states]
        return torch.cat([c for c, _ in replies]), replies[0][1]

    def set_buffers(self, rank, buffers):
        self.states[0].buffers[rank] = buffers

    def buffers(self):
        from policies.rules.sharding import average_buffers

        return average_buffers(self.states[0].buffers)
