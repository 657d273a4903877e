"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): allreduce's summed gradient sent as a
rank-r product, with error feedback; the rule torch's `ddp_comm_hooks.powerSGD_hook` applies to
DDP buckets, here on the parameters of our flat buckets.

Each parameter with a matrix shape (n x m after flattening all but the first dimension) whose
rank-r factors are smaller than it (n m > r (n + m)) is compressed; every other one (biases,
small matrices) is summed as it is. Replica i, every step, per compressed parameter:

    M_i = G_i + e_i                      (its summed gradient, plus what the last steps left out)
    P = sum_i M_i Q          all-reduce   (n x r; Q the same m x r matrix on every replica)
    P <- orthonormal columns of P        (QR; the same on every replica: the same P)
    Q' = sum_i M_i^T P       all-reduce   (m x r)
    G  = P Q'^T                           (the summed gradient the step uses, identical everywhere)
    e_i = M_i - G / p                     (error feedback: this replica's part left out)
    Q <- Q' / p                           (warm start: next step's Q)

Two all-reduces per step instead of one, of (n + m) r floats per compressed parameter instead
of n m. The first also carries the uncompressed parameters and the first bucket's tail (loss
sums, rows, flags, figures). With r >= min(n, m) the product is exact (P spans the column space
of sum_i M_i): the step equals the uncompressed one (tested). Every replica starts from the
same Q (a fixed seed); a replacement starts with a fresh Q and no error, which changes the next
step's approximation but not the replicas' agreement (P and Q' are sums every replica shares).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

SEED = 20191  # every replica draws the same starting Q


def compressible(shape: Sequence[int], rank: int) -> bool:
    """A parameter worth compressing: a matrix whose rank-r factors are smaller than it."""
    if len(shape) < 2:
        return False
    n = int(shape[0])
    m = 1
    for d in shape[1:]:
        m *= int(d)
    r = min(rank, n, m)
    return n * m > r * (n + m)


def floats_sent(shapes: Sequence[Sequence[int]], rank: int) -> int:
    """Floats one step's two all-reduces carry for parameters of these shapes (the cost model's
    bytes: 4 x this)."""
    total = 0
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= int(d)
        if compressible(shape, rank):
            n, m = int(shape[0]), numel // int(shape[0])
            total += min(rank, n, m) * (n + m)
        else:
            total += numel
    return total


class PowerSgd:
    """The compressor of one replica: its Q per compressed parameter and its error feedback."""

    def __init__(self, params: Sequence[torch.nn.Parameter], rank: int, recipe: Any = None) -> None:
        """`recipe`: the replica's (policies/rules/recipe.py); while it skips non-finite losses
        (a switch on probation) a step whose loss is not finite keeps no error feedback."""
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.params, self.rank, self.recipe = list(params), int(rank), recipe
        gen = torch.Generator().manual_seed(SEED)
        self.compressed: list[int] = []
        self.plain: list[int] = []
        self.q: dict[int, torch.Tensor] = {}
        self.error: dict[int, torch.Tensor] = {}
        for i, p in enumerate(self.params):
            if compressible(p.shape, rank):
                n, m = p.shape[0], p.numel() // p.shape[0]
                r = min(rank, n, m)
                self.compressed.append(i)
                self.q[i] = torch.randn(m, r, generator=gen, dtype=p.dtype).to(p.device)
                self.error[i] = torch.zeros(n, m, dtype=p.dtype, device=p.device)
            else:
                self.plain.append(i)

    def _matrix(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return p.grad.view(p.shape[0], -1)

    def reduce(self, reducer: Any, tail: torch.Tensor, world: int) -> None:
        """Replace every parameter's `.grad` (this replica's summed gradient) with the
        approximated sum over the replicas, and sum `tail` in place along (float32)."""
        skipping = self.recipe is not None and self.recipe.skip_nonfinite  # else no host sync for the check
        with torch.no_grad():
            ms = {i: self._matrix(i) + self.error[i] for i in self.compressed}
            ps = [ms[i] @ self.q[i] for i in self.compressed]
            plain = [self.params[i].grad.reshape(-1) for i in self.plain]
            first = torch.cat([p.reshape(-1) for p in ps] + plain + [tail])
            reducer.wait(reducer.start(first))
            offset = 0
            for k, i in enumerate(self.compressed):
                n = ps[k].numel()
                ps[k] = torch.linalg.qr(first[offset : offset + n].view_as(ps[k]), mode="reduced").Q
                offset += n
            for i in self.plain:
                g = self.params[i].grad
                g.copy_(first[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            tail.copy_(first[offset:])
            if skipping and not math.isfinite(float(tail[0])):  # the step's loss, summed alike on every replica:
                return  # not applied, so its error and factors are not kept (off probation it ends the run)
            qs = [ms[i].t() @ ps[k] for k, i in enumerate(self.compressed)]
            if qs:
                second = torch.cat([q.reshape(-1) for q in qs])
                reducer.wait(reducer.start(second))
                offset = 0
                for k, i in enumerate(self.compressed):
                    q = second[offset : offset + qs[k].numel()].view_as(qs[k])
                    offset += qs[k].numel()
                    approx = ps[k] @ q.t()
                    self.error[i] = ms[i] - approx / world
                    self._matrix(i).copy_(approx)
                    self.q[i] = q / world
