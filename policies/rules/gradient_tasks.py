"""sandblaster's gradient tasks: a pass's gradient at x as the sum of tasks (a slice of rows
each), whoever computes them, each counted once.

- `GradientPass` (a shard's side, run by actors/shards/parameter_shard.py on its slice): the
  first copy of each task of the pass counts, later copies and copies from an earlier pass are
  dropped, so a task served again or backed up counts exactly once whichever copy finishes first.
- `SandblasterWorker` (a replica's side in `strategy.mode: sandblaster`): a task is a partition,
  or a slice of one (`partition_tasks`, strategy.task_rows: the partition server then leases
  tasks and the reader maps each to its partition's rows); its summed-loss gradient goes to every
  shard when the next task begins; in a pass's tail a
  copy already in elsewhere is dropped part way (the partition server's backup copies:
  policies/decisions/leases.py).
- `TaskHandout` and `task_bounds`: a pass's rows cut into tasks handed to whichever worker asks
  first, with a backup copy of the task expected to end last once none is unstarted (workers
  that are not replicas: Ray tasks in tests/integration/test_sandblaster_ray.py).
The coordinator that turns a pass's gradient into an L-BFGS iteration on the shards is
policies/rules/sandblaster.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from policies.rules.batches import rows as batch_rows
from policies.rules.modes import StepResult


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


def partition_tasks(partition_rows: list[int], task_rows: int) -> list[tuple[int, int, int]]:
    """A pass's tasks over the train partitions (strategy.task_rows): task i is rows [lo, hi) of
    partition p's stored order, (p, lo, hi), each partition cut by `task_bounds` in turn, so every
    row is in exactly one task (an empty partition has none)."""
    return [(p, lo, hi) for p, n in enumerate(partition_rows) if n > 0 for lo, hi in task_bounds(n, task_rows)]


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
        self.backups_said: set[int] = set()  # this pass's backup copies already counted in a segment's figures
        self.last_loss = float("nan")

    def begin_segment(self, epoch: int) -> None:
        """The epoch loop starts (or resumes) a segment of pass `epoch`."""
        if epoch != self.pass_id:
            self.pass_id, self.fresh, self.part = epoch, True, None
            self.superseded, self.checked, self.backups_said = set(), (None, 0.0), set()
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
            raise RuntimeError(f"sandblaster: a batch from {len(parts)} partitions (a task is one partition, or a slice of one)")
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
            if self.rows:  # the dropped copy's loss so far: what the step reports
                self.last_loss = self.loss_sum / self.rows
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
        if not self.rows:  # pushed, an empty sum would count as the whole task
            self.part = None
            raise RuntimeError(f"sandblaster: task {partition} of pass {pass_id} to fill had no rows")
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
                 "tasks_backup": len(set(reader.backups) - self.backups_said) if reader is not None else 0}
        if reader is not None:  # a pass in segments (a pause): each copy counted in one of them
            self.backups_said |= set(reader.backups)
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
