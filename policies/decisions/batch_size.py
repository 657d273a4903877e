"""Adaptive batch size (`data.adaptive_batch`): grow allreduce's batch when the step is limited by
gradient noise, not by curvature. Pure functions, no Ray, no torch.

The noise scale. With per-example gradients of mean G and covariance S (trace tr S), the mean
gradient over B rows has E||g_B||^2 = ||G||^2 + tr S / B. McCandlish et al. (2018, "An Empirical
Model of Large-Batch Training") call B_noise = tr S / ||G||^2 the simple noise scale: below it a
step's direction is mostly noise and a larger batch buys almost proportionally more progress per
step (so, with the linear scaling rule, the same progress in fewer, larger steps); above it a
larger batch buys little. De et al. ("Automated Inference with Adaptive Batches") grow the batch
when the gradient's variance says the step is noise-limited; this is that test, measured.

Measuring it from what allreduce already sends. Every step carries the gradient diversity of its
p replicas, D = sum_i ||g_i||^2 / ||sum_i g_i||^2 (policies/rules/allreduce.py StepFigures), each g_i
the gradient of b rows. In expectation, with x = B_noise / b,
    D = p (||G||^2 + tr S / b) / (p^2 ||G||^2 + p tr S / b) = (1 + x) / (p + x),
so x = (D p - 1) / (1 - D) and
    B_noise = b (D p - 1) / (1 - D)                                      (`noise_scale`)
D = 1/p: identical gradients, no noise (B_noise = 0); D -> 1: noise dominates (B_noise -> inf).
The replicas' gradients are independent samples only with equal batches, so the rule needs
p >= 2 equal shares (no strategy.balance, no backup replicas: the config refuses them).

The rule (`AdaptiveBatch.decide`), at an epoch's end, from the epoch's mean diversity: the
per-replica batch b is multiplied by `factor` when the grown global batch p b factor is still at
most B_noise (the step stays noise-limited at the larger batch) and b factor <= `max_batch`. It
never shrinks (as De et al.'s batches: the noise scale grows as training converges). The learning
rate follows the global batch by the large-minibatch rule (policies/decisions/lr_scaling.py: linear
scaling with a gradual warmup over scaling.lr_warmup_steps), through the same schedule a resize moves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


def noise_scale(diversity: float, replicas: int, batch: int) -> float:
    """B_noise = b (D p - 1) / (1 - D) in rows: 0 when D <= 1/p, inf when D >= 1."""
    if replicas < 2 or batch < 1:
        raise ValueError(f"need replicas >= 2 and batch >= 1, got {replicas} and {batch}")
    if not math.isfinite(diversity) or diversity <= 0:
        raise ValueError(f"diversity must be finite and > 0, got {diversity}")
    if diversity >= 1.0:
        return math.inf
    return max(0.0, batch * (diversity * replicas - 1.0) / (1.0 - diversity))


@dataclass(frozen=True)
class AdaptiveBatch:
    """The rule: `base` (data.batch_size) grows by `factor` up to `max_batch` per replica."""

    base: int
    max_batch: int
    factor: int = 2

    def __post_init__(self) -> None:
        if self.base < 1 or self.max_batch < self.base or self.factor < 2:
            raise ValueError(f"need 1 <= base <= max_batch and factor >= 2, got {self.base}, {self.max_batch}, "
                             f"{self.factor}")

    def decide(self, diversity: Optional[float], replicas: int, batch: int,
               accumulate: int = 1) -> Optional[tuple[int, float]]:
        """(the new per-replica batch, the noise scale in rows it was decided on), or None to keep
        `batch`. A step's gradient is over batch x `accumulate` rows (data.accumulate); no
        figure (None, not finite: e.g. an epoch whose every step overflowed in fp16) keeps it."""
        if diversity is None or not math.isfinite(diversity) or diversity <= 0 or replicas < 2:
            return None
        if batch * self.factor > self.max_batch:
            return None
        rows = batch * accumulate
        b_noise = noise_scale(diversity, replicas, rows)
        if replicas * rows * self.factor > b_noise:
            return None
        return batch * self.factor, b_noise
