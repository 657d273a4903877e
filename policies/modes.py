"""What each synchronization mode needs, and the transport protocol its replica-side rule uses.

A mode's update rule lives in its own file (allreduce.py, downpour.py, easgd.py) as a
`*Worker` class with `step(x, y) -> (loss, comm_s)` and `end_epoch() -> stats`. Workers talk
to the parameter shards only through `ShardClient`: Ray actors in production
(actors/shard.py), plain in-process `ShardState`s in tests.
"""
from __future__ import annotations

from typing import Protocol

import torch

MODES = ("allreduce", "downpour", "easgd")
SHARDED_MODES = ("downpour", "easgd")  # modes whose reference parameters live in ParameterShards


def needs_shards(mode: str) -> bool:
    return mode in SHARDED_MODES


class ShardClient(Protocol):
    def pull(self, into: torch.Tensor) -> list[int]:
        """Copy the shards' values into the flat vector `into`; returns each shard's version."""

    def push(self, grad: torch.Tensor, versions: list[int], rank: int, step: int, staleness_lr: bool) -> None:
        """Send an accumulated gradient, one message per shard, in the background."""

    def completed(self) -> tuple[list[int], int]:
        """(staleness of each push applied since the last call, slowest replica's step)."""

    def drain(self) -> None:
        """Wait for every push in flight."""

    def min_clock(self) -> int:
        """The slowest replica's last reported step (asks shard 0)."""

    def version(self) -> int:
        """Updates shard 0 has applied."""

    def idle(self, rank: int) -> None:
        """This replica has nothing left this epoch: the staleness bound stops waiting for it."""

    def elastic(self, x: torch.Tensor, alpha: float) -> tuple[torch.Tensor, float]:
        """Asynchronous EASGD exchange on every shard: returns (d, ||x - c||^2)."""

    def sync_round(self, round_id: int, x: torch.Tensor, replicas: int, beta: float) -> torch.Tensor:
        """Synchronous EASGD barrier: contributes x, returns the center before the round."""
