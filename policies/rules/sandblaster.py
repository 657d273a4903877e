"""sandblaster: L-BFGS run by a coordinator that never holds the model (DistBelief's Sandblaster).

"The core of the optimization algorithm resides in a coordinator process, which has no direct
access to the model parameters": each parameter shard keeps its slice of every vector the
algorithm needs (x, the gradient g, the direction d, the previous gradient and the s/y history),
and the coordinator sends it small operations on them (a dot product, a coefficient-wise
a <- a + alpha b, a scaled copy, |a|_max, |a|_1). Each shard answers with partial scalars, which
the coordinator combines (sums, or the max): it holds scalars only (rho_i, alpha_i, H_diag, the
step t), never a vector, so the history costs no coordinator memory and no network traffic.

One iteration, the same arithmetic as `torch.optim.LBFGS` without a line search (fixed step):

    y <- g - g_prev;  s <- t d;  if y.s > 1e-10: keep (s, y, rho = 1 / y.s), H_diag <- y.s / y.y
    q <- -g;  for i newest..oldest: a_i <- rho_i s_i.q;  q <- q - a_i y_i
    d <- H_diag q;  for i oldest..newest: b_i <- rho_i y_i.d;  d <- d + (a_i - b_i) s_i
    t <- lr (the first iteration: min(1, 1 / |g|_1) lr);  x <- x + t d

The gradient at x comes from gradient tasks (policies/rules/gradient_tasks.py: the shards' sum
of a pass's tasks, the replicas' worker in `strategy.mode: sandblaster`, and a handout of tasks by
speed with backups); the mode's coordinator runs on the driver (orchestrator/control/passes.py).

`SliceVectors` is one shard's side (pure torch; actors/shards/parameter_shard.py runs it on the
shard's own values); `LbfgsCoordinator` the coordinator's, over anything with
`run(ops) -> per-shard answers` (`LocalSlices`: every slice in one process; `ShardSlices` in
orchestrator/fleet/shard_slices.py: the real shards). Equal to torch.optim.LBFGS on the same problem:
tests/unit/test_sandblaster.py (in one process), tests/integration/test_sandblaster_ray.py (real
shards; the mode through the controller).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

# Operations a shard performs on its slice. Each is a tuple (name, *args); names of vectors are
# strings. Those marked -> answer one partial scalar, in order.
#   ("dot", a, b)            -> sum_j a_j b_j over the slice
#   ("absmax", a)            -> max_j |a_j| (0 on an empty slice)
#   ("abssum", a)            -> sum_j |a_j|
#   ("axpy", dst, alpha, a)     dst <- dst + alpha a
#   ("scaled", dst, alpha, a)   dst <- alpha a (a new vector)
#   ("drop", a)                 forget a
SCALAR_OPS = {"dot", "absmax", "abssum"}


class SliceVectors:
    """One shard's named vectors over its slice [lo, hi) of the flat parameters, and the
    operations on them (`run`). `x` is the slice of the parameters; `g` the slice of the
    gradient at x, written by `set` before each `LbfgsCoordinator.iteration`."""

    def __init__(self, x: torch.Tensor) -> None:
        self.v: dict[str, torch.Tensor] = {"x": x}

    def set(self, name: str, value: torch.Tensor) -> None:
        self.v[name] = value

    def run(self, ops: Sequence[tuple]) -> list[float]:
        out: list[float] = []
        for op in ops:
            kind, args = op[0], op[1:]
            v = self.v
            if kind == "dot":
                out.append(float(v[args[0]].double().dot(v[args[1]].double())))
            elif kind == "absmax":
                a = v[args[0]]
                out.append(float(a.abs().max()) if a.numel() else 0.0)
            elif kind == "abssum":
                out.append(float(v[args[0]].double().abs().sum()))
            elif kind == "axpy":
                v[args[0]].add_(v[args[2]], alpha=float(args[1]))
            elif kind == "scaled":
                v[args[0]] = v[args[2]].mul(float(args[1]))
            elif kind == "drop":
                v.pop(args[0], None)
            else:
                raise ValueError(f"sandblaster: unknown shard operation {kind!r}")
        return out


class Slices(Protocol):
    def run(self, ops: Sequence[tuple]) -> list[list[float]]:
        """Every shard runs `ops` on its slice; one list of partial scalars per shard."""


@dataclass
class LocalSlices:
    """Every shard's `SliceVectors` in this process (the coordinator's maths without Ray)."""

    shards: list[SliceVectors]

    def run(self, ops: Sequence[tuple]) -> list[list[float]]:
        return [s.run(ops) for s in self.shards]


def combine(ops: Sequence[tuple], answers: list[list[float]]) -> list[float]:
    """The shards' partial scalars made whole: dot products and |a|_1 summed, |a|_max the max."""
    kinds = [op[0] for op in ops if op[0] in SCALAR_OPS]
    whole = []
    for k, kind in enumerate(kinds):
        parts = [a[k] for a in answers]
        whole.append(max(parts) if kind == "absmax" else sum(parts))
    return whole


@dataclass
class LbfgsCoordinator:
    """L-BFGS through shard operations: the coordinator's state is scalars and vector names.

    Use: the gradient at the current x is on the shards as "g" and `loss` is the loss there;
    `iteration(loss)` returns True when it moved x and wants the gradient at the new x (into "g",
    then call it again), False when the run is done (`why`; at max_iter x was moved first and,
    as torch does, nothing is evaluated there)."""

    slices: Slices
    lr: float = 1.0
    max_iter: int = 20
    max_eval: int | None = None
    tolerance_grad: float = 1e-7
    tolerance_change: float = 1e-9
    history_size: int = 100
    n_iter: int = 0
    evals: int = 0
    done: bool = False
    why: str = ""
    t: float = 0.0
    h_diag: float = 1.0
    prev_loss: float = float("nan")
    history: list[tuple[str, str, float]] = field(default_factory=list)  # (s name, y name, rho)
    _next_id: int = 0

    def __post_init__(self) -> None:
        if self.max_eval is None:
            self.max_eval = self.max_iter * 5 // 4

    def _ask(self, *ops: tuple) -> list[float]:
        return combine(ops, self.slices.run(ops))

    def _finish(self, why: str) -> bool:
        self.done, self.why = True, why
        return False

    def iteration(self, loss: float) -> bool:
        if self.done:
            return False
        self.evals += 1
        [gmax] = self._ask(("absmax", "g"))
        if self.n_iter == 0:
            if gmax <= self.tolerance_grad:
                return self._finish("gradient below tolerance_grad")
        else:  # the checks torch makes after each move, in its order
            if self.evals >= self.max_eval:
                return self._finish("max_eval")
            if gmax <= self.tolerance_grad:
                return self._finish("gradient below tolerance_grad")
            [dmax] = self._ask(("absmax", "d"))
            if dmax * abs(self.t) <= self.tolerance_change:
                return self._finish("step below tolerance_change")
            if abs(loss - self.prev_loss) < self.tolerance_change:
                return self._finish("loss change below tolerance_change")
        return self._move(loss)

    def _move(self, loss: float) -> bool:
        self.n_iter += 1
        if self.n_iter == 1:
            self.slices.run([("scaled", "d", -1.0, "g")])
        else:
            self._direction()
        self.prev_loss = loss
        gsum, gtd = self._ask(("scaled", "g_prev", 1.0, "g"), ("abssum", "g"), ("dot", "g", "d"))
        if self.n_iter == 1:
            self.t = (min(1.0, 1.0 / gsum) if gsum > 0 else 1.0) * self.lr
        else:
            self.t = self.lr
        if gtd > -self.tolerance_change:
            return self._finish("directional derivative above -tolerance_change")
        self.slices.run([("axpy", "x", self.t, "d")])
        if self.n_iter == self.max_iter:
            return self._finish("max_iter")
        return True

    def _direction(self) -> None:
        """The new (s, y) pair into the history, then the two-loop recursion into "d"."""
        sid = self._next_id
        self._next_id += 1
        s, y = f"s{sid}", f"y{sid}"
        ys, yy = self._ask(("scaled", y, 1.0, "g"), ("axpy", y, -1.0, "g_prev"), ("scaled", s, self.t, "d"),
                           ("dot", y, s), ("dot", y, y))
        pending: list[tuple] = []  # operations that answer nothing ride with the next call that asks
        if ys > 1e-10:
            if len(self.history) == self.history_size:
                old_s, old_y, _ = self.history.pop(0)
                pending += [("drop", old_s), ("drop", old_y)]
            self.history.append((s, y, 1.0 / ys))
            self.h_diag = ys / yy
        else:
            pending += [("drop", s), ("drop", y)]
        pending.append(("scaled", "d", -1.0, "g"))  # q, built in d's place
        al = [0.0] * len(self.history)
        for i in range(len(self.history) - 1, -1, -1):
            s_i, y_i, rho = self.history[i]
            [sq] = self._ask(*pending, ("dot", s_i, "d"))
            al[i] = sq * rho
            pending = [("axpy", "d", -al[i], y_i)]
        pending.append(("scaled", "d", self.h_diag, "d"))
        for i, (s_i, y_i, rho) in enumerate(self.history):
            [yr] = self._ask(*pending, ("dot", y_i, "d"))
            pending = [("axpy", "d", al[i] - yr * rho, s_i)]
        self.slices.run(pending)
