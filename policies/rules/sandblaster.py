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

The gradient at x is the sum of many small tasks (a slice of rows each): `TaskHandout` gives
the next task to whichever worker asks first (so a fast worker takes more of them), and once
none is left unstarted it hands a backup copy of the task expected to finish last to a worker
that is free. Every task's gradient sum goes to every shard, which keeps the first copy of each
task of the pass and drops the rest (`GradientPass`): each task counted exactly once whichever
copy of it finishes first; a copy from an earlier pass is dropped too.

`SliceVectors` and `GradientPass` are one shard's side (pure torch; actors/shards/parameter_shard.py
runs them on the shard's own values); `LbfgsCoordinator` the coordinator's, over anything with
`run(ops) -> per-shard answers` (`LocalSlices`: every slice in one process; `ShardSlices` in
orchestrator/fleet/shard_slices.py: the real shards). Equal to torch.optim.LBFGS on the same problem:
tests/unit/test_sandblaster.py (in one process), tests/integration/test_sandblaster_ray.py (real
shards, gradient tasks on Ray workers with a straggler and its backup). No mode of the registry
runs it yet (docs/modes.md lists the modes that run).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from policies.rules.batches import rows as batch_rows
from policies.rules.modes import StepResult

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


class GradientPass:
    """One shard's sum of the gradient tasks of the current pass over its slice.

    `begin(pass_id)` opens a pass (dropping whatever an earlier one left); `add` takes a task's
    gradient sum over the slice once: the first copy of a task (a backup may send a second)
    counts, later copies and copies from an earlier pass are dropped; a copy from a later pass
    opens that pass (the mode's replicas number passes by epoch, so the first push of an epoch
    opens it). With each counted task come its loss sum and rows (`loss_sum`, `rows`: the
    pass's loss). `finish(rows)` gives the mean gradient (the sum over every task / the rows
    they covered) and the task ids it holds."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pass_id = -1
        self.sum = torch.zeros(n, dtype=torch.float64)
        self.tasks: set[int] = set()
        self.dropped = 0
        self.loss_sum = 0.0
        self.rows = 0

    def begin(self, pass_id: int) -> None:
        self.pass_id = pass_id
        self.sum.zero_()
        self.tasks.clear()
        self.loss_sum, self.rows = 0.0, 0

    def add(self, pass_id: int, task_id: int, grad_sum: torch.Tensor, loss_sum: float = 0.0, rows: int = 0) -> bool:
        if pass_id > self.pass_id:
            self.begin(pass_id)
        if pass_id != self.pass_id or task_id in self.tasks:
            self.dropped += 1
            return False
        if grad_sum.numel() != self.n:
            raise ValueError(f"sandblaster: task {task_id}'s gradient has {grad_sum.numel()} values; the slice {self.n}")
        self.sum.add_(grad_sum.double())
        self.tasks.add(task_id)
        self.loss_sum += float(loss_sum)
        self.rows += int(rows)
        return True

    def held(self) -> tuple[int, list[int], float, int]:
        """(pass, the tasks it holds, their loss sum, their rows)."""
        return self.pass_id, sorted(self.tasks), self.loss_sum, self.rows

    def finish(self, rows: int) -> tuple[torch.Tensor, list[int]]:
        if rows <= 0:
            raise ValueError(f"sandblaster: a pass over {rows} rows")
        return (self.sum / rows).float(), sorted(self.tasks)


def task_bounds(rows: int, task_rows: int) -> list[tuple[int, int]]:
    """The pass's rows [0, rows) cut into tasks of task_rows rows (the last may be shorter)."""
    if rows <= 0 or task_rows <= 0:
        raise ValueError(f"sandblaster: {rows} rows in tasks of {task_rows}")
    return [(lo, min(lo + task_rows, rows)) for lo in range(0, rows, task_rows)]


@dataclass
class TaskHandout:
    """Who computes which gradient task of one pass, by speed, with backups for the stragglers.

    `next(worker, now)` is a free worker asking for work: the next unstarted task, in order (a
    fast worker comes back sooner and so takes more); once every task has started, a backup copy
    of the unfinished task expected to end last (started earliest, by the worker slowest per row,
    as `rate` has measured it), when it has fewer than `max_copies` copies running and not on a
    worker already computing it; None when there is nothing to give. `finished(task, worker,
    now)` reports a copy done: True for the first copy of the task (the one that counts), False
    for a later one; the worker's rows per second are measured from it."""

    tasks: list[tuple[int, int]]
    max_copies: int = 2
    started: dict[int, list[tuple[str, float]]] = field(default_factory=dict)  # task -> [(worker, start)]
    done: dict[int, str] = field(default_factory=dict)  # task -> the worker whose copy counted
    rate: dict[str, float] = field(default_factory=dict)  # worker -> rows per second (the newest task)
    _cursor: int = 0

    def next(self, worker: str, now: float) -> int | None:
        if self._cursor < len(self.tasks):
            task = self._cursor
            self._cursor += 1
            self.started[task] = [(worker, now)]
            return task
        candidates = [t for t, copies in self.started.items() if t not in self.done and len(copies) < self.max_copies
                      and all(w != worker for w, _ in copies)]
        if not candidates:
            return None
        task = max(candidates, key=lambda t: self._expected_end(t))
        self.started[task].append((worker, now))
        return task

    def _expected_end(self, task: int) -> float:
        lo, hi = self.tasks[task]
        worker, start = self.started[task][0]
        rate = self.rate.get(worker)
        return start + (hi - lo) / rate if rate else float("inf")  # not measured yet: assume the worst

    def finished(self, task: int, worker: str, now: float) -> bool:
        for w, start in self.started.get(task, []):
            if w == worker and now > start:
                lo, hi = self.tasks[task]
                self.rate[worker] = (hi - lo) / (now - start)
        if task in self.done:
            return False
        self.done[task] = worker
        return True

    @property
    def backups(self) -> int:
        """Backup copies handed out."""
        return sum(len(copies) - 1 for copies in self.started.values())

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.tasks)


@dataclass
class SandblasterWorker:
    """One replica's part in `strategy.mode: sandblaster`: a gradient worker, never a stepper.

    A pass is an epoch. At its first step the replica pulls x from the shards; each step adds
    its batch's gradient, summed over the batch's rows, to the sum of the partition the batch
    comes from (`where()`: the reader's (partition, rows) of the batch being trained); when the
    next partition begins (or the segment ends) the finished partition's sum goes to every
    shard as task `partition` of pass `epoch`, with its loss sum and rows, and is acknowledged
    before the replica goes on. The model's parameters never move here: the coordinator moves
    x on the shards once every task of the pass is in (orchestrator/control/passes.py).

    The partition server hands partitions to whichever replica asks first, so a faster replica
    computes more tasks; a partition served again (its replica died) is a second copy of the
    task, which the shards drop if the first was pushed. In a pass's tail (`reader().drained`:
    the queue is empty, and with strategy.backup_tasks an idle replica is computing a backup copy
    of a partition another still holds), before a step on a partition the replica asks the shards
    whether its task is in already (at a partition's first step, then at most every `CHECK_S`):
    if so it drops its partial sum and reads no more of that partition (`superseded`; the step
    trains nothing, `StepResult.dropped`). `fill(pass_id, partition, batches)` computes one task
    outside the epoch's loop: the coordinator's fill-in of a task no shard holds (a replica lost
    between reporting a partition and pushing its sum)."""

    model: torch.nn.Module
    flat: Any  # FlatParams
    client: Any  # RayShardClient
    where: Callable[[], list[tuple[int, int]]]
    task: Any = None
    recipe: Any = None
    reader: Optional[Callable[[], Any]] = None  # () -> the replica's PartitionReader (drained, drop)
    lock_step = False

    CHECK_S = 0.1  # in a pass's tail, how often a partition being computed is checked for another copy

    def __post_init__(self) -> None:
        self.pass_id: Optional[int] = None
        self.fresh = True  # pull x before the next step
        self.part: Optional[int] = None
        self.sum = torch.zeros_like(self.flat.grads)
        self.loss_sum, self.rows = 0.0, 0
        self.pushed = self.counted = self.superseded_n = 0
        self.superseded: set[int] = set()  # this pass's partitions another copy of which came in first
        self.checked: tuple[Optional[int], float] = (None, 0.0)  # (partition, when) last asked about
        self.last_loss = float("nan")

    def begin_segment(self, epoch: int) -> None:
        """The epoch loop starts (or resumes) a segment of pass `epoch`."""
        if epoch != self.pass_id:
            self.pass_id, self.fresh, self.part = epoch, True, None
            self.superseded, self.checked = set(), (None, 0.0)
            self._reset()

    def _reset(self) -> None:
        self.sum.zero_()
        self.loss_sum, self.rows = 0.0, 0

    def _pull(self) -> float:
        t = time.perf_counter()
        if self.fresh:
            self.client.pull(self.flat.params)
            self.fresh = False
        return time.perf_counter() - t

    def _gradient(self, x: Any, y: Any) -> float:
        """The batch's gradient summed over its rows into the task's sum; the batch's mean loss."""
        self.flat.grads.zero_()
        loss = self.recipe.backward(self.model, self.task, x, y, summed=True)
        if not self.recipe.finite(loss):
            raise FloatingPointError(f"the loss is {loss} at the pass's parameters")
        n = batch_rows(y)
        self.sum.add_(self.flat.grads)
        self.loss_sum += loss * n
        self.rows += n
        return loss

    def _push(self) -> float:
        t = time.perf_counter()
        counted = self.client.add_gradient(self.pass_id, self.part, self.sum, self.loss_sum, self.rows)
        self.pushed += 1
        self.counted += int(counted)
        self.part = None
        self._reset()
        return time.perf_counter() - t

    def step(self, x: Any, y: Any, more: bool = False, pause: bool = False) -> StepResult:
        if self.pass_id is None:
            raise RuntimeError("sandblaster: a step before the pass began (begin_segment)")
        comm = self._pull()
        parts = self.where()
        if len(parts) != 1:
            raise RuntimeError(f"sandblaster: a batch from {len(parts)} partitions (a task is one partition)")
        partition = parts[0][0]
        if partition in self.superseded:  # the one batch cut ahead of the drop
            return StepResult(self.last_loss, comm, 0, more, dropped=batch_rows(y))
        if self.part is not None and partition != self.part:
            comm += self._push()
        self.part = partition
        t = time.perf_counter()
        if self._in_elsewhere(partition):
            self.superseded.add(partition)
            self.superseded_n += 1
            self.part = None
            self._reset()
            self.reader().drop(partition)
            return StepResult(self.last_loss, comm + time.perf_counter() - t, 0, more, dropped=batch_rows(y))
        comm += time.perf_counter() - t
        self.last_loss = self._gradient(x, y)
        return StepResult(self.last_loss, comm, batch_rows(y), more)

    def _in_elsewhere(self, partition: int) -> bool:
        """In the pass's tail: whether every shard holds this partition's task already (asked at
        the partition's first step, then at most every CHECK_S)."""
        reader = self.reader() if self.reader is not None else None
        if reader is None or not reader.drained:
            return False
        now = time.perf_counter()
        if partition == self.checked[0] and now - self.checked[1] < self.CHECK_S:
            return False
        self.checked = (partition, now)
        return bool(self.client.task_held(self.pass_id, partition))

    def fill(self, pass_id: int, partition: int, batches: Any) -> bool:
        """Task `partition` of pass `pass_id` computed over `batches` and pushed; True if it counted."""
        self.begin_segment(pass_id)
        if self.part is not None:
            self._push()
        self._pull()
        counts = self.pushed, self.counted  # the epoch's own pushes only (`end_epoch`'s figures)
        self.part = partition
        for x, y in batches:
            self._gradient(x, y)
        self._push()
        counted = self.counted > counts[1]
        self.pushed, self.counted = counts
        return counted

    def end_epoch(self) -> dict[str, Any]:
        """The segment's last partition pushed; x is pulled again at the next step (the
        coordinator moves it once the pass is complete)."""
        if self.part is not None:
            self._push()
        self.fresh = True
        reader = self.reader() if self.reader is not None else None
        stats = {"tasks_pushed": self.pushed, "tasks_counted": self.counted, "tasks_superseded": self.superseded_n,
                 "tasks_backup": len(reader.backups) if reader is not None else 0}
        self.pushed = self.counted = self.superseded_n = 0
        return stats

    def release(self) -> None:
        if self.part is not None:
            self._push()


def sandblaster_metrics(stats: list) -> dict[str, float]:
    """`duplicate_tasks`: task sums the shards dropped this epoch (a partition served again, a
    backup copy completed second); `backup_tasks`: backup copies of late partitions the replicas
    took (strategy.backup_tasks); `superseded_tasks`: copies a replica stopped computing part way
    because another copy was in (a pass's tail)."""
    modes = [s.mode for s in stats if "tasks_pushed" in s.mode]
    if not modes:
        return {}
    return {"duplicate_tasks": sum(m["tasks_pushed"] - m["tasks_counted"] for m in modes),
            "backup_tasks": sum(m.get("tasks_backup", 0) for m in modes),
            "superseded_tasks": sum(m.get("tasks_superseded", 0) for m in modes)}
