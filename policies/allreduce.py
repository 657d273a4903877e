"""allreduce: synchronous data parallel SGD, the whole update rule in one file.

Every step each of p replicas computes the gradient g_i of its own batch; g = (1/p) sum_i g_i
is formed with one all-reduce per flat bucket; every replica applies the same optimizer step
to the same parameters, so parameters stay identical without ever being sent.

Gradients live in flat buckets: each parameter's `.grad` is a view into a contiguous buffer,
so backward() writes straight into the buffer and the all-reduce needs no copy in or out.
Buckets are filled in backward order (last layer first) and each bucket's all-reduce starts
the moment its last gradient is accumulated, so communication of the late layers overlaps the
backward pass of the early ones. One bucket carries one extra float, the replica's loss, so the
mean loss across replicas rides along with the gradients for free.

The communication is passed in as a `Reducer` (torch.distributed in a replica actor, a plain
in-process sum in tests), so the rule is checked without Ray or process groups.

Ragged end: every replica leases the same number of partitions per epoch (the partition server
pins them round-robin) and takes `steps_per_partition` = floor(min partition rows / batch) steps
on each; the few rows past that are dropped *for this epoch only*. Rows are reshuffled every
epoch, so a different handful is dropped each time and none is dropped systematically.
Dropping keeps every step's global batch the same size (so the averaged gradient has the
same scale and the learning rate means the same thing every step) at the cost of < 1 batch
per replica per epoch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch
import torch.nn.functional as F


class Reducer(Protocol):
    def start(self, tensor: torch.Tensor) -> Any:
        """Begin summing `tensor` in place across all replicas; return a handle."""

    def wait(self, handle: Any) -> None:
        """Block until the sum behind `handle` is in the tensor."""


@dataclass
class GradientBuckets:
    """Flat gradient buffers whose slices are the parameters' `.grad` tensors, in backward
    order. While `armed`, a bucket's reduction starts as soon as its last gradient lands."""

    buffers: list[torch.Tensor]
    loss_slot: torch.Tensor  # a 1-element view at the end of the first bucket
    members: list[int]  # parameters per bucket
    reducer: Any = None
    _pending: list[int] = field(default_factory=list)
    _handles: list[Any] = field(default_factory=list)
    _started: list[bool] = field(default_factory=list)

    FIRST_BUCKET_BYTES = 2**20

    @classmethod
    def attach(cls, params: Sequence[torch.nn.Parameter], bucket_bytes: int) -> "GradientBuckets":
        """Group parameters in backward order; a bucket closes once it holds >= its cap: 1 MiB
        for the first (so the last layers' all-reduce starts early), `bucket_bytes` after."""
        groups: list[list[torch.nn.Parameter]] = [[]]
        size, cap = 0, min(cls.FIRST_BUCKET_BYTES, bucket_bytes)
        for p in reversed(list(params)):  # backward computes the last layers first
            groups[-1].append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                groups.append([])
                size, cap = 0, bucket_bytes
        if not groups[-1]:
            groups.pop()
        buffers = []
        for i, group in enumerate(groups):
            extra = 1 if i == 0 else 0
            flat = torch.zeros(sum(p.numel() for p in group) + extra, dtype=group[0].dtype, device=group[0].device)
            offset = 0
            for p in group:
                p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            buffers.append(flat)
        self = cls(buffers, buffers[0][-1:], [len(g) for g in groups])
        for b, group in enumerate(groups):
            for p in group:
                p.register_post_accumulate_grad_hook(lambda _p, b=b: self._grad_ready(b))
        return self

    def begin_step(self, reducer: Any) -> None:
        """Zero the buffers in place (grads stay views) and arm the hooks for one backward."""
        for b in self.buffers:
            b.zero_()
        self.reducer = reducer
        self._pending = list(self.members)
        self._handles = [None] * len(self.buffers)
        self._started = [False] * len(self.buffers)

    def _grad_ready(self, b: int) -> None:
        if self.reducer is None:
            return
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._start(b)

    def _start(self, b: int) -> None:
        self._started[b] = True
        self._handles[b] = self.reducer.start(self.buffers[b])

    def finish_step(self) -> None:
        """Start buckets whose hooks never fired (unused parameters), wait for all, disarm."""
        for b, started in enumerate(self._started):
            if not started:
                self._start(b)
        for h in self._handles:
            self.reducer.wait(h)
        self.reducer = None

    @property
    def numel(self) -> int:
        return sum(b.numel() for b in self.buffers) - 1


def allreduce_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    buckets: GradientBuckets,
    x: torch.Tensor,
    y: torch.Tensor,
    world_size: int,
    reducer: Reducer,
) -> tuple[float, float]:
    """One synchronous step. Returns (mean loss across replicas, seconds spent waiting for
    communication after the backward pass, i.e. the part overlap did not hide)."""
    buckets.begin_step(reducer)
    loss = F.cross_entropy(model(x), y)
    buckets.loss_slot.fill_(loss.detach())  # before backward: the first bucket may leave early
    loss.backward()
    t0 = time.perf_counter()
    buckets.finish_step()
    comm_s = time.perf_counter() - t0
    for b in buckets.buffers:
        b.div_(world_size)
    optimizer.step()
    return float(buckets.loss_slot.item()), comm_s


def steps_per_partition(rows_per_partition: Sequence[int], batch_size: int) -> int:
    """Steps every replica takes on each partition it leases: full batches of the smallest
    partition; the ragged end is dropped (see module docstring)."""
    steps = min(rows_per_partition) // batch_size
    if steps < 1:
        raise ValueError(
            f"a partition holds {min(rows_per_partition)} rows, fewer than one batch of {batch_size}; "
            "lower data.batch_size or data.partitions"
        )
    return steps


class AllReduceWorker:
    """The replica-side loop body for allreduce, in the shape every mode's worker has."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, bucket_bytes: int,
                 world_size: int, reducer: Reducer) -> None:
        self.model, self.optimizer = model, optimizer
        self.buckets = GradientBuckets.attach([p for p in model.parameters() if p.requires_grad], bucket_bytes)
        self.world_size, self.reducer = world_size, reducer

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        return allreduce_step(self.model, self.optimizer, self.buckets, x, y, self.world_size, self.reducer)

    def end_epoch(self) -> dict:
        return {}
