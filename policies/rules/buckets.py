"""The flat gradient buckets of `allreduce` (policies/rules/allreduce.py) and what rides in them.

Each parameter's `.grad` is a view into a contiguous buffer, so backward() writes straight into
the buffer and the all-reduce needs no copy in or out. Buckets are filled in backward order
(last layer first) and each bucket's all-reduce starts the moment its last gradient is
accumulated. The first bucket ends with SLOTS floats (summed loss, rows, "has another batch",
"pause") and, when asked for, the step's figure slots (`figure_slots`). `BufferSync` is DDP's
`broadcast_buffers`. The communication is a `Reducer` (torch.distributed in a replica actor, a
plain in-process sum in tests).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch


class Late(Exception):
    """Raised from a gradient hook when a backup replica learns mid-backward that the step
    already has its gradients: the rest of its backward pass is not computed."""


SLOTS = 4  # extra floats at the end of the first bucket: summed loss, rows, "has another batch", "pause"


def figure_slots(world: int) -> int:
    """Floats after the SLOTS that carry each step's measurements (`StepFigures`): the summed
    squared norms of the replicas' own gradients of the step before, then each rank's rows and
    busy seconds of the step before (a rank writes only its own pair; the sum hands every
    replica every pair)."""
    return 1 + 2 * world


class Reducer(Protocol):
    def start(self, tensor: torch.Tensor) -> Any:
        """Begin summing `tensor` in place across all replicas; return a handle."""

    def wait(self, handle: Any) -> None:
        """Block until the sum behind `handle` is in the tensor."""

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Overwrite `tensor` in place with rank 0's (blocking)."""


@dataclass
class GradientBuckets:
    """Flat gradient buffers whose slices are the parameters' `.grad` tensors, in backward
    order. While `armed`, a bucket's reduction starts as soon as its last gradient lands."""

    buffers: list[torch.Tensor]
    slots: torch.Tensor  # a SLOTS-element view at the end of the first bucket
    members: list[int]  # parameters per bucket
    figures: Optional[torch.Tensor] = None  # the figure slots after `slots` (empty when none were asked for)
    reducer: Any = None
    measure: bool = False  # sum each bucket's squared norm before its reduction starts (`local_norm2`)
    local_norm2: float = 0.0
    tail: int = SLOTS  # floats at the end of the first bucket that are not gradients
    summed_norm2_last: float = 0.0  # measure: the last step's summed gradient's squared norm (0: none)
    compress: Optional[torch.dtype] = None  # strategy.compression: gradients travel in this dtype
    scale: float = 1.0  # compress: gradients are sent divided by this (the global batch: fp16's range)
    _low: list[Any] = field(default_factory=list)  # compress: per bucket, (the low-precision copy, its tail)
    stop: Optional[Callable[[], bool]] = None  # backups: asked as each gradient lands; True stops the backward (Late)
    _pending: list[int] = field(default_factory=list)
    _handles: list[Any] = field(default_factory=list)
    _started: list[bool] = field(default_factory=list)

    FIRST_BUCKET_BYTES = 2**20

    @classmethod
    def attach(cls, params: Sequence[torch.nn.Parameter], bucket_bytes: int, figures: int = 0) -> "GradientBuckets":
        """Group parameters in backward order; a bucket closes once it holds >= its cap: 1 MiB
        for the first (so the last layers' all-reduce starts early), `bucket_bytes` after.
        `figures`: floats of measurements riding after the SLOTS (`figure_slots`)."""
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
            extra = SLOTS + figures if i == 0 else 0
            flat = torch.zeros(sum(p.numel() for p in group) + extra, dtype=group[0].dtype, device=group[0].device)
            offset = 0
            for p in group:
                p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            buffers.append(flat)
        tail = SLOTS + figures
        self = cls(buffers, buffers[0][-tail:][:SLOTS], [len(g) for g in groups], buffers[0][-tail:][SLOTS:],
                   tail=tail)
        self.params = [p for group in groups for p in group]
        self.hooks = [p.register_post_accumulate_grad_hook(lambda _p, b=b: self._grad_ready(b))
                      for b, group in enumerate(groups) for p in group]
        return self

    def detach(self) -> None:
        """Let go of the parameters: hooks removed, `.grad` no longer views into the buckets."""
        for h in self.hooks:
            h.remove()
        for p in self.params:
            p.grad = None
        self.hooks = []

    def begin_step(self, reducer: Any) -> None:
        """Zero the buffers in place (grads stay views) and arm the hooks for one backward."""
        for b in self.buffers:
            b.zero_()
        self.reducer = reducer
        self.local_norm2 = self.summed_norm2_last = 0.0
        self._pending = list(self.members)
        self._handles = [None] * len(self.buffers)
        self._low = [None] * len(self.buffers)
        self._started = [False] * len(self.buffers)

    def _grad_ready(self, b: int) -> None:
        if self.stop is not None and self.stop():
            raise Late()
        if self.reducer is None:
            return
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._start(b)

    def _start(self, b: int) -> None:
        self._started[b] = True
        if self.measure:  # this replica's own gradient, before the sum overwrites it
            grads = self.gradients(b)
            self.local_norm2 += float(grads.dot(grads))
        if self.compress is None:
            self._handles[b] = self.reducer.start(self.buffers[b])
            return
        # compressed: the gradients in the low dtype, scaled into its range; the first bucket's
        # tail (loss sums, rows, flags, figures) stays float32 and travels on its own
        low = (self.gradients(b) / self.scale).to(self.compress)
        tail = self.buffers[b][-self.tail:] if b == 0 else None
        self._low[b] = (low, tail)
        self._handles[b] = (self.reducer.start(low), self.reducer.start(tail) if tail is not None else None)

    def finish_step(self) -> None:
        """Start buckets whose hooks never fired (unused parameters, an empty step), wait for
        all, disarm."""
        for b, started in enumerate(self._started):
            if not started:
                self._start(b)
        for b, h in enumerate(self._handles):
            if self.compress is None:
                self.reducer.wait(h)
                continue
            self.reducer.wait(h[0])
            if h[1] is not None:
                self.reducer.wait(h[1])
            low, _ = self._low[b]
            grads = self.gradients(b)
            grads.copy_(low.to(grads.dtype)).mul_(self.scale)
        self.reducer = None

    @property
    def numel(self) -> int:
        return sum(b.numel() for b in self.buffers) - self.tail

    def summed_norm2(self) -> float:
        """Squared norm of the summed gradient (after the reduction, before the division)."""
        return sum(float(g.dot(g)) for g in map(self.gradients, range(len(self.buffers))))

    def gradients(self, b: int) -> torch.Tensor:
        """Bucket `b`'s gradients: the buffer, less the first bucket's tail of slots and figures."""
        return self.buffers[b][: -self.tail] if b == 0 else self.buffers[b]


class BufferSync:
    """DDP's `broadcast_buffers`: the module's buffers (BatchNorm running statistics, counters)
    overwritten with rank 0's, one flat broadcast per dtype. A model without buffers costs
    nothing."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for buf in model.buffers():
            self.groups.setdefault(buf.dtype, []).append(buf)

    def __bool__(self) -> bool:
        return bool(self.groups)

    def sync(self, reducer: Reducer) -> None:
        for bufs in self.groups.values():
            flat = torch.cat([b.detach().reshape(-1) for b in bufs])
            reducer.broadcast(flat)
            offset = 0
            for b in bufs:
                b.detach().copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
