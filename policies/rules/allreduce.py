"""allreduce: synchronous data parallel SGD, the whole update rule in one file.

Every step each of p replicas computes the gradient g_i of its own batch; g = (1/p) sum_i g_i
is formed with one all-reduce per flat bucket; every replica applies the same optimizer step
to the same parameters, so parameters stay identical without ever being sent.

Gradients live in flat buckets (policies/rules/buckets.py): each parameter's `.grad` is a view
into a contiguous buffer, so backward() writes straight into the buffer and the all-reduce needs
no copy in or out. Buckets are filled in backward order (last layer first) and each bucket's
all-reduce starts the moment its last gradient is accumulated, so communication of the late
layers overlaps the backward pass of the early ones. The first bucket carries four extra floats that ride along
with the gradients for free: the replica's summed loss, its rows this step, whether it has
another batch after this one, and whether it was told to pause (a phase switch: every replica
stops after the same step).

The communication is passed in as a `Reducer` (torch.distributed in a replica actor, a plain
in-process sum in tests), so the rule is checked without Ray or process groups.

Every row, weighted by rows: each partition is cut into batches of `data.batch_size` with one
short last batch, so no row is dropped. A replica sums (not averages) its batch's loss, the
all-reduce sums gradients, losses and rows, and the summed gradient is divided by the step's
total rows: the update is the mean gradient over the rows actually seen that step, whatever the
batch sizes, exactly as one process training on the union of the replicas' batches.

Lock-step: replicas may hold different numbers of batches in an epoch (uneven partitions, a
short batch). Each step also sums the replicas' "I have another batch" flags; a replica whose
data ran out keeps joining the collective with an empty step (no rows, zero gradient) until the
sum says nobody has a batch left, and every replica ends the epoch after the same step. No
replica ever waits at a collective the others skip.

Buffers (e.g. BatchNorm running statistics) follow DDP's `broadcast_buffers`: rank 0's buffers
are broadcast to every replica before each step's forward pass and once more at the end of the
epoch, so every replica evaluates, and the checkpoint holds, the same statistics.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch

from policies.rules.backup import BackupGate
from policies.rules.balance import BatchBalancer
from policies.rules.batches import rows as batch_rows
from policies.rules.buckets import BufferSync, GradientBuckets, Late, Reducer, figure_slots
from policies.rules.modes import StepResult
from policies.rules.powersgd import PowerSgd
from policies.rules.recipe import Recipe
from policies.rules.tasks import Classification, Task


def allreduce_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    buckets: GradientBuckets,
    x: Optional[torch.Tensor],
    y: Optional[torch.Tensor],
    reducer: Reducer,
    more: bool = False,
    pause: bool = False,
    task: Optional[Task] = None,
    figures: Optional[Sequence[float]] = None,
    exchange: Optional[Callable[[], None]] = None,
    gate: Optional[BackupGate] = None,
    straggle: Optional[Callable[[float, Callable[[], bool]], None]] = None,
    recipe: Optional[Recipe] = None,
) -> StepResult:
    """One synchronous step on this replica's batch (`x` None: an empty step, this replica's
    data ran out but another's has not). `more`: this replica has another batch after this one.
    The update is the mean gradient over every row of the step across replicas; it is not
    applied when the step's loss is not finite (FloatingPointError). `task`: the loss
    (policies/rules/tasks.py; default classification); its batch mean times the batch's rows is summed.
    `figures`: this replica's measurements to sum with the others' in the figure slots; the
    sums come back in `StepResult.figures`, and `ready_at` is when this replica's backward
    pass was done (time.perf_counter). `exchange`: how the summed gradients and the first
    bucket's tail are formed after the backward pass instead of the buckets' own all-reduces
    started during it (PowerSGD). `gate`: backup replicas (policies/rules/backup.py): this replica's
    gradient is sent only if it is among the step's first; else it sends zeros and no rows,
    stopping its work as soon as it knows (`StepResult.dropped`: its rows). `straggle(busy_s,
    late)`: a deliberate straggler's delay after the backward pass, cut short once `late()`.
    `recipe` (policies/rules/recipe.py): micro-batches, autocast and loss scaling around the backward
    pass, clipping and the optimizer step on the summed gradient (default: one fp32 batch)."""
    recipe = recipe or Recipe()
    early = exchange is None and gate is None  # buckets leave during backward only when nothing can drop them
    buckets.begin_step(None)  # armed before the last micro-batch's backward (earlier ones only accumulate)
    if figures is not None:
        buckets.figures.copy_(torch.tensor(figures, dtype=buckets.figures.dtype))
    dropped = None
    if x is not None:
        n = batch_rows(y)
        t_busy = time.perf_counter()
        if gate is not None and gate.late():
            dropped = n
        else:
            def before_last(loss_sum: torch.Tensor) -> None:
                # before the last backward: the first bucket may leave during it
                buckets.slots.copy_(torch.stack([loss_sum, loss_sum.new_tensor(float(n)),
                                                 loss_sum.new_tensor(float(more)), loss_sum.new_tensor(float(pause))]))
                if early:
                    buckets.reducer = reducer

            buckets.stop = gate.late if gate is not None else None
            try:
                recipe.backward(model, task or Classification(), x, y, summed=True, before_last=before_last)
            except Late:
                dropped = n
            finally:
                buckets.stop = None
            if dropped is None:
                if straggle is not None:
                    straggle(time.perf_counter() - t_busy, gate.late if gate is not None else lambda: False)
                if gate is not None and not gate.arrive():
                    dropped = n
    if dropped is not None:  # a late gradient: none of it goes out
        for b in range(len(buckets.buffers)):
            buckets.gradients(b).zero_()
    if x is None or dropped is not None:
        buckets.slots.copy_(buckets.slots.new_tensor([0.0, 0.0, float(more), float(pause)]))
    t0 = time.perf_counter()
    if exchange is not None:
        exchange()
    else:
        buckets.reducer = reducer  # already set when the backward started the buckets
        buckets.finish_step()
    comm_s = time.perf_counter() - t0
    loss_sum, rows, more_total, pause_total = buckets.slots.tolist()
    mean_loss = loss_sum / rows if rows else 0.0
    applies = recipe.finite(mean_loss)  # every replica alike: the loss is the step's across replicas
    summed = buckets.figures.tolist() if figures is not None else None
    if rows and applies:
        norm = None
        if buckets.measure:
            buckets.summed_norm2_last = buckets.summed_norm2()
            norm = buckets.summed_norm2_last ** 0.5 / rows
        for b in buckets.buffers:
            b.div_(rows)
        recipe.apply(optimizer, buckets.params, norm=norm)  # clipped, fp16-unscaled: the same on every replica
    return StepResult(mean_loss, comm_s, int(rows), more_total > 0, pause_total > 0, figures=summed, ready_at=t0,
                      with_more=int(round(more_total)), dropped=dropped)


class StepFigures:
    """A replica's side of the per-step measurements (and of load balancing, when on), carried
    in the figure slots of every step at no extra message:
    - busy seconds: everything this replica did between the end of one step's collective and
      the moment its next backward pass was done (its batch, forward, backward, the optimizer
      step, a deliberate straggler's sleep); its rows that step;
    - wait seconds: how much longer the busiest replica was busy that step (this replica spent
      it waiting in the collective); the rest of the collective's time is communication;
    - gradient diversity (Yin et al. 2018): sum_i ||g_i||^2 / ||sum_i g_i||^2 over the replicas'
      own gradients of the step (g_i: the gradient of replica i's summed loss); 1/p when every
      replica's gradient is the same, 1 when they are orthogonal, above 1 when they pull apart
      (a larger batch helps the more, the higher it is).
    Every figure arrives one step late (a step's own numbers are known only after its first
    bucket left), so `observe` returns the step before's."""

    def __init__(self, rank: int, world: int, balancer: Optional[BatchBalancer] = None) -> None:
        self.rank, self.world, self.balancer = rank, world, balancer
        self.t_free: Optional[float] = None  # when the last step's collective ended (None: a new segment)
        self.mine: tuple[float, float] = (0.0, 0.0)  # this replica's rows and busy seconds of the last step
        self.local_norm2 = 0.0
        self.summed_norm2 = 0.0

    def outgoing(self) -> list[float]:
        out = [0.0] * figure_slots(self.world)
        out[0] = self.local_norm2
        out[1 + 2 * self.rank], out[2 + 2 * self.rank] = self.mine
        return out

    def observe(self, summed: list[float], started: float, rows: int, ready_at: float, synced_s: float,
                buckets: GradientBuckets) -> dict[str, Any]:
        """Take this step's own figures (for the next step to send) and read the step before's
        from every replica's `summed` figures; returns that step's wait_s, busy spread and
        diversity (None where unknown), and `shares` when the balancer moved them."""
        busy = ready_at - self.t_free - synced_s if self.t_free is not None else 0.0
        my_rows, my_busy = self.mine
        self.mine = (float(rows), busy if rows else 0.0)
        diversity = summed[0] / self.summed_norm2 if self.summed_norm2 > 0 and summed[0] > 0 else None
        self.local_norm2 = buckets.local_norm2
        self.summed_norm2 = buckets.summed_norm2_last
        all_rows, all_busy = summed[1::2], summed[2::2]
        active = [b for r, b in zip(all_rows, all_busy) if r > 0 and b > 0]
        out: dict[str, Any] = {"wait_s": None, "spread": None, "diversity": diversity, "shares": None}
        if my_rows > 0 and my_busy > 0 and active:
            out["wait_s"] = max(active) - my_busy
        if len(active) >= 2:
            out["spread"] = max(active) / min(active)
        if self.balancer is not None:
            out["shares"] = self.balancer.observe(all_rows, all_busy)
        return out

    def end_segment(self) -> None:
        """Time between segments (evaluation, a pause) is nobody's step."""
        self.t_free = None
        self.mine = (0.0, 0.0)


COMPRESSION = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16, "powersgd": None}


class AllReduceWorker:
    """The replica-side loop body for allreduce, in the shape every mode's worker has.
    `balance`: load-balanced batch shares (policies/rules/balance.py: window, min_share, max_share);
    `batch_share` is then the rows this replica's next batches should have. `compression`:
    "fp16" or "bf16": each bucket's gradients are summed in that dtype (half the bytes),
    divided by the global batch (replicas x `batch` rows) on the way in and multiplied back on
    the way out, so fp16's range holds a summed gradient; the first bucket's tail of loss
    sums, rows and figures is summed in float32 on its own. "powersgd": the summed gradient
    as rank-`powersgd_rank` factors with error feedback (policies/rules/powersgd.py), formed after
    the backward pass. `backups`: backup replicas (policies/rules/backup.py): each step applies the
    first `holding - backups` gradients to be ready; the reducer's group store decides who is
    in time. `straggle`: set by the replica to its deliberate straggler's delay
    (faults.slow_replicas) when backups are on, so the delay falls before this replica's
    gradient is ready and a late replica cuts it short."""

    lock_step = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, bucket_bytes: int,
                 reducer: Reducer, task: Optional[Task] = None, batch: int = 0,
                 balance: Optional[dict[str, Any]] = None, compression: str = "none",
                 powersgd_rank: int = 2, backups: int = 0, recipe: Optional[Recipe] = None) -> None:
        self.model, self.optimizer, self.task = model, optimizer, task or Classification()
        self.recipe = recipe or Recipe()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.bucket_bytes, self.batch, self.balance = bucket_bytes, batch, balance
        self.compress = COMPRESSION[compression]
        self.powersgd_rank = powersgd_rank if compression == "powersgd" else None
        self.exchange: Optional[Callable[[], None]] = None  # powersgd: forms the summed gradients after backward
        self.reducer = reducer
        self.buffer_sync = BufferSync(model)
        self.group: Optional[tuple[int, int]] = None
        self.buckets = GradientBuckets.attach(self.params, bucket_bytes)
        self.figures: Optional[StepFigures] = None
        self.batch_share: Optional[int] = None
        self.last: dict[str, Any] = {}
        self.backups = backups
        self.gate: Optional[BackupGate] = None
        self.gate_generation: Any = None  # (the reducer's process group, (rank, size)) the gate counts in
        self.straggle: Optional[Callable[[float, Callable[[], bool]], None]] = None
        self.drops = {"dropped_steps": 0, "dropped_rows": 0}  # gates of past groups, this epoch

    def _fit_group(self) -> None:
        """(Re)attach the buckets with figure slots for the group's size: at the first step,
        and after a regroup changed it (even shares again)."""
        group = reducer_group(self.reducer)
        if group == self.group:
            return
        rank, world = group
        self.buckets.detach()
        self.buckets = GradientBuckets.attach(self.params, self.bucket_bytes, figure_slots(world))
        self.buckets.measure = True
        self.buckets.compress, self.buckets.scale = self.compress, float(max(1, self.batch * world))
        balancer = None
        if self.balance is not None and self.batch and world > 1:
            balancer = BatchBalancer(world, self.batch, int(self.balance["window"]), float(self.balance["min_share"]),
                                     float(self.balance["max_share"]))
        self.figures = StepFigures(rank, world, balancer)
        self.batch_share = self.batch if balancer is not None else None
        if self.powersgd_rank is not None:  # grads are views into the new buckets: a compressor over them
            self.exchange = partial(PowerSgd(self.params, self.powersgd_rank, self.recipe).reduce, self.reducer,
                                    self.buckets.buffers[0][-self.buckets.tail:], world)
        self.group = group

    def _fit_gate(self) -> None:
        """Backups: a gate for this generation of the group, at its first step. Every
        generation (a regroup after a failure too, even at the same rank and size) has its own
        store and starts counting its steps from 0 on every member."""
        generation = (getattr(self.reducer, "pg", None), self.group)
        if generation == self.gate_generation:
            return
        self._take_drops()
        rank, world = self.group
        self.gate = BackupGate(self.backups, self.reducer.arrivals(), world, rank) if world > 1 else None
        self.gate_generation = generation

    def _take_drops(self) -> None:
        if self.gate is not None:
            for k, v in self.gate.take_counts().items():
                self.drops[k] += v

    @property
    def straggles_inside(self) -> bool:
        """The replica's straggler delay belongs inside the step (`straggle`), not after it."""
        return bool(self.backups)

    def step(self, x: Optional[torch.Tensor], y: Optional[torch.Tensor], more: bool = False,
             pause: bool = False) -> StepResult:
        self._fit_group()
        if self.backups:
            self._fit_gate()
        started = time.perf_counter()
        if self.buffer_sync:
            self.buffer_sync.sync(self.reducer)
        synced_s = time.perf_counter() - started  # a sync point: waiting for rank 0, not this replica's work
        figs, gate = self.figures, self.gate
        if gate is not None:
            gate.begin()
        result = allreduce_step(self.model, self.optimizer, self.buckets, x, y, self.reducer, more, pause, self.task,
                                figures=figs.outgoing(), exchange=self.exchange, gate=gate, straggle=self.straggle,
                                recipe=self.recipe)
        if gate is not None:
            gate.end(result.with_more, result.dropped)
        self.last = figs.observe(result.figures, started, batch_rows(y) if x is not None else 0, result.ready_at,
                                 synced_s, self.buckets)
        figs.t_free = time.perf_counter()
        if figs.balancer is not None:
            self.batch_share = self._share_after(figs, more, result.with_more)
        return result

    def _share_after(self, figs: "StepFigures", more: bool, with_more: int) -> int:
        """This replica's rows for its next batches: its share of the split, or at an uneven
        split's tail (`with_more` < world replicas still have a batch, and this is one of them)
        the global batch divided among those left, at most max_share x batch. The tail rule:
        the rows left at an epoch's end (a partition or two of the slower replicas, since
        partitions are leased whole) form global-batch steps rather than many small steps at
        the full rate, which measurably slowed learning (docs/modes-allreduce-options.md)."""
        shares, world = figs.balancer.shares, figs.world
        if more and 0 < with_more < world and len(set(shares)) > 1:
            return min(world * self.batch // with_more, int(float(self.balance["max_share"]) * self.batch))
        return shares[figs.rank]

    def release(self) -> None:
        self.buckets.detach()

    def end_epoch(self) -> dict:
        if self.figures is not None:
            self.figures.end_segment()
            if self.figures.balancer is not None:  # the next epoch starts at the split, not a tail's share
                self.batch_share = self.figures.balancer.shares[self.figures.rank]
        if self.buffer_sync:  # every replica evaluates (and rank 0 checkpoints) rank 0's statistics
            self.buffer_sync.sync(self.reducer)
        if not self.backups:
            return {}
        self._take_drops()
        out, self.drops = self.drops, {"dropped_steps": 0, "dropped_rows": 0}
        return out


def reducer_group(reducer: Any) -> tuple[int, int]:
    """(rank, size) of the reducer's group; (0, 1) for a reducer that does not say."""
    group = getattr(reducer, "group", None)
    return group() if group is not None else (0, 1)
