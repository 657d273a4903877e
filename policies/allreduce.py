"""allreduce: synchronous data parallel SGD, the whole update rule in one file.

Every step each of p replicas computes the gradient g_i of its own batch; g = (1/p) sum_i g_i
is formed with one all-reduce per flat bucket; every replica applies the same optimizer step
to the same parameters, so parameters stay identical without ever being sent.

Gradients live in flat buckets: each parameter's `.grad` is a view into a contiguous buffer,
so backward() writes straight into the buffer and the all-reduce needs no copy in or out. The
last bucket carries one extra float, the replica's loss, so the mean loss across replicas
rides along with the gradients for free.

The reduction is passed in (`reduce_sum_`): torch.distributed.all_reduce in a replica actor,
a plain sum in tests, so the rule is checked without Ray or process groups.

Ragged epoch end: each replica takes `steps_per_epoch` = floor(min partition rows / batch)
steps; the few rows past that are dropped *for this epoch only*. Rows are reshuffled every
epoch, so a different handful is dropped each time and none is dropped systematically.
Dropping keeps every step's global batch the same size (so the averaged gradient has the
same scale and the learning rate means the same thing every step) at the cost of < 1 batch
per replica per epoch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

ReduceSum = Callable[[Sequence[torch.Tensor]], None]
"""Sums each tensor in place across all replicas (e.g. a loop of dist.all_reduce)."""


@dataclass
class GradientBuckets:
    """Flat gradient buffers whose slices are the parameters' `.grad` tensors."""

    buffers: list[torch.Tensor]
    loss_slot: torch.Tensor  # a 1-element view at the end of the last buffer

    @classmethod
    def attach(cls, params: Sequence[torch.nn.Parameter], bucket_bytes: int) -> "GradientBuckets":
        groups: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            if groups[-1] and size + nbytes > bucket_bytes:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        buffers = []
        for i, group in enumerate(groups):
            extra = 1 if i == len(groups) - 1 else 0
            dtype, device = group[0].dtype, group[0].device
            flat = torch.zeros(sum(p.numel() for p in group) + extra, dtype=dtype, device=device)
            offset = 0
            for p in group:
                p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            buffers.append(flat)
        return cls(buffers, buffers[-1][-1:])

    def zero_(self) -> None:
        for b in self.buffers:
            b.zero_()

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
    reduce_sum_: ReduceSum,
) -> tuple[float, float]:
    """One synchronous step. Returns (mean loss across replicas, seconds spent communicating)."""
    buckets.zero_()  # in place: the grads stay views into the buckets
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    buckets.loss_slot.fill_(loss.detach())
    t0 = time.perf_counter()
    reduce_sum_(buckets.buffers)
    comm_s = time.perf_counter() - t0
    for b in buckets.buffers:
        b.div_(world_size)
    optimizer.step()
    return float(buckets.loss_slot.item()), comm_s


def steps_per_epoch(rows_per_replica: Sequence[int], batch_size: int) -> int:
    """Steps every replica takes this epoch: the ragged end is dropped (see module docstring)."""
    steps = min(rows_per_replica) // batch_size
    if steps < 1:
        raise ValueError(
            f"a replica holds {min(rows_per_replica)} rows, fewer than one batch of {batch_size}; "
            "lower data.batch_size or scaling.replicas"
        )
    return steps


def epoch_order(rows: int, seed: int, epoch: int, rank: int) -> np.ndarray:
    """The order a replica visits its rows in an epoch: reproducible from (seed, epoch, rank)."""
    return np.random.default_rng([seed, epoch, rank]).permutation(rows)

