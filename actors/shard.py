"""ParameterShard: a Ray actor holding one slice of the reference parameters (policies/sharding.py
ShardState), and RayShardClient: how a replica talks to all shards.

Shards are asyncio actors: every method runs on one event loop, so each update is applied
atomically, and the synchronous EASGD barrier can wait without blocking other replicas' calls.
They take no CPU reservation, so they fit beside replicas on a small machine. Buffers travel as
flat numpy arrays through the object store (one message per shard per push or pull, zero-copy
reads on the receiving side); nothing is pickled per tensor.
"""
from __future__ import annotations

import asyncio
import warnings
from collections import deque

import numpy as np
import ray
import torch

from policies.sharding import ShardState, average_buffers


def _view(array: np.ndarray) -> torch.Tensor:
    """A tensor over an array from the object store (read-only, zero-copy); we only read it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _host(t: torch.Tensor) -> np.ndarray:
    """The shard boundary: a flat tensor as a numpy array (copied off a GPU, a view on the CPU)."""
    return t.detach().cpu().numpy()


@ray.remote(num_cpus=0)
class ParameterShard:
    def __init__(self, values: np.ndarray, optimizer: str, lr: float, momentum: float, weight_decay: float,
                 replicas: int) -> None:
        self.state = ShardState(torch.from_numpy(np.array(values, dtype=np.float32)), optimizer, lr, momentum,
                                weight_decay)
        self.state.init_clocks(replicas)
        self._rounds: dict[int, asyncio.Event] = {}

    async def pull(self) -> tuple[int, np.ndarray]:
        return self.state.version, self.state.values.numpy()

    async def push(self, grad: np.ndarray, version_seen: int, rank: int, step: int, staleness_lr: bool) -> tuple[int, int]:
        """Apply a gradient; returns (its staleness, the slowest replica's step)."""
        staleness = self.state.apply_gradient(_view(grad), version_seen, staleness_lr)
        return staleness, self.state.report_clock(rank, step)

    async def min_clock(self) -> int:
        return min(self.state.clocks.values(), default=0)

    async def forget_replica(self, rank: int) -> None:
        self.state.forget(rank)

    async def idle(self, rank: int) -> None:
        self.state.idle(rank)

    async def version(self) -> int:
        return self.state.version

    async def elastic(self, x: np.ndarray, alpha: float) -> tuple[np.ndarray, float]:
        d, sq = self.state.elastic_exchange(_view(x), alpha)
        return d.numpy(), sq

    async def sync_round(self, round_id: int, x: np.ndarray, replicas: int, beta: float, has_data: bool,
                         timeout_s: float) -> tuple[np.ndarray, int]:
        event = self._rounds.setdefault(round_id, asyncio.Event())
        if self.state.sync_contribute(round_id, _view(x), replicas, beta, has_data):
            event.set()
        await asyncio.wait_for(event.wait(), timeout_s)
        center, active = self.state.sync_center_before(round_id)
        if round_id not in self.state._closed:
            self._rounds.pop(round_id, None)
        return center.numpy(), active

    async def values(self) -> np.ndarray:
        return self.state.values.numpy()

    async def observed_max_lead(self) -> int:
        return self.state.max_lead

    async def set_buffers(self, rank: int, buffers: dict) -> None:
        self.state.buffers[rank] = buffers

    async def buffers(self) -> dict:
        return average_buffers(self.state.buffers)


class RayShardClient:
    """policies.modes.ShardClient over ParameterShard actors; pushes go out in the background
    with at most `max_in_flight` outstanding."""

    def __init__(self, shards: list, bounds: list[tuple[int, int]], max_in_flight: int, timeout_s: float) -> None:
        self.shards, self.bounds = shards, bounds
        self.max_in_flight, self.timeout_s = max_in_flight, timeout_s
        self.in_flight: deque[list] = deque()
        self._stale: list[int] = []
        self._min_clock = 0

    def pull(self, into: torch.Tensor) -> list[int]:
        replies = ray.get([s.pull.remote() for s in self.shards], timeout=self.timeout_s)
        for (lo, hi), (_, values) in zip(self.bounds, replies):
            into[lo:hi].copy_(_view(values))  # host -> the replica's device
        return [v for v, _ in replies]

    def push(self, grad: torch.Tensor, versions: list[int], rank: int, step: int, staleness_lr: bool) -> None:
        flat = _host(grad)
        self.in_flight.append([s.push.remote(flat[lo:hi], v, rank, step, staleness_lr)
                               for s, (lo, hi), v in zip(self.shards, self.bounds, versions)])
        while len(self.in_flight) > self.max_in_flight:
            self._record(self.in_flight.popleft())

    def _record(self, refs: list) -> None:
        replies = ray.get(refs, timeout=self.timeout_s)
        self._stale += [s for s, _ in replies]
        self._min_clock = max(self._min_clock, replies[0][1])

    def completed(self) -> tuple[list[int], int]:
        while self.in_flight:
            ready, _ = ray.wait(self.in_flight[0], num_returns=len(self.in_flight[0]), timeout=0)
            if len(ready) < len(self.in_flight[0]):
                break
            self._record(self.in_flight.popleft())
        out, self._stale = self._stale, []
        return out, self._min_clock

    def drain(self) -> None:
        while self.in_flight:
            self._record(self.in_flight.popleft())

    def min_clock(self) -> int:
        self._min_clock = ray.get(self.shards[0].min_clock.remote(), timeout=self.timeout_s)
        return self._min_clock

    def version(self) -> int:
        return ray.get(self.shards[0].version.remote(), timeout=self.timeout_s)

    def idle(self, rank: int) -> None:
        ray.get(self.shards[0].idle.remote(rank), timeout=self.timeout_s)

    def elastic(self, x: torch.Tensor, alpha: float) -> tuple[torch.Tensor, float]:
        flat = _host(x)
        replies = ray.get([s.elastic.remote(flat[lo:hi], alpha) for s, (lo, hi) in zip(self.shards, self.bounds)],
                          timeout=self.timeout_s)
        d = torch.from_numpy(np.concatenate([d for d, _ in replies])).to(x.device)
        return d, sum(q for _, q in replies)

    def sync_round(self, round_id: int, x: torch.Tensor, replicas: int, beta: float,
                   has_data: bool) -> tuple[torch.Tensor, int]:
        flat = _host(x)
        refs = [s.sync_round.remote(round_id, flat[lo:hi], replicas, beta, has_data, self.timeout_s)
                for s, (lo, hi) in zip(self.shards, self.bounds)]
        replies = ray.get(refs, timeout=self.timeout_s + 5)
        return torch.from_numpy(np.concatenate([c for c, _ in replies])).to(x.device), replies[0][1]

    def set_buffers(self, rank: int, buffers: dict) -> None:
        ray.get(self.shards[0].set_buffers.remote(rank, buffers), timeout=self.timeout_s)

    def buffers(self) -> dict:
        return ray.get(self.shards[0].buffers.remote(), timeout=self.timeout_s)


def create_shards(initial: np.ndarray, bounds: list[tuple[int, int]], optimizer: str, lr: float, momentum: float,
                  weight_decay: float, replicas: int) -> list:
    """One ParameterShard per bound, each given its slice (one object-store put per shard)."""
    return [ParameterShard.remote(initial[lo:hi], optimizer, lr, momentum, weight_decay, replicas)
            for lo, hi in bounds]
