"""What each synchronization mode needs, and the transport protocol its replica-side rule uses.

A mode's update rule lives in its own file (allreduce.py, downpour.py, easgd.py, local_sgd.py) as a
`*Worker` class with `step(x, y, more, pause) -> StepResult`, `end_epoch() -> stats` and
`release()` (let go of the model before another mode's worker takes it: a phase switch). A worker whose
`lock_step` is true (allreduce, local SGD, synchronous EASGD) takes the same steps as every other replica:
the replica keeps calling `step(None, None, False)` (an empty step) after its own data ran out
until a step's result says no replica has a batch left (`go_on` false). Workers talk
to the parameter shards only through `ShardClient`: Ray actors in production
(actors/shards/parameter_shard.py), plain in-process `ShardState`s in tests.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Protocol

import torch

class Interrupted(Exception):
    """A step could not complete because the membership changed under it (a peer died, the
    controller aborted a round). The step is not applied; the replica ends its segment and
    waits for the controller to regroup."""


class Diverged(RuntimeError):
    """The loss became nan or inf: not a fault of the replica that saw it (every replica would),
    so the run ends instead of replacing it. The controller tells it apart by this type."""


class StepResult(NamedTuple):
    loss: float  # mean loss of the step (allreduce: across replicas; else this replica's batch)
    comm_s: float  # seconds waiting for communication
    rows: int  # rows the step trained on (allreduce: across replicas)
    go_on: bool  # lock-step workers: some replica has another batch; others: this one has
    paused: bool = False  # lock-step workers: some replica was told to pause (a phase switch) after this step
    figures: Optional[list] = None  # allreduce: the step's summed figure slots (policies/rules/allreduce.py StepFigures)
    ready_at: float = 0.0  # allreduce: when this replica's backward pass was done (time.perf_counter)
    with_more: int = 0  # allreduce: how many replicas have another batch after this step
    dropped: Optional[int] = None  # rows not trained on: allreduce's backups (a late gradient), sandblaster's copy already in


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

    def sync_round(self, round_id: int, x: torch.Tensor, replicas: int, beta: float,
                   has_data: bool) -> tuple[torch.Tensor, int]:
        """Synchronous EASGD barrier: contributes x and whether this replica has a batch for
        this step; returns (the center before the round, how many replicas have one). A round
        where none has is only a vote to end the epoch: the center does not move."""

    def set_buffers(self, rank: int, buffers: dict) -> None:
        """This replica's module buffers (e.g. BatchNorm statistics) at the end of its epoch."""

    def buffers(self) -> dict:
        """The reference model's buffers: the replicas' latest, averaged."""
