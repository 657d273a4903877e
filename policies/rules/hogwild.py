"""hogwild: lock-free updates of one shared parameter vector (Hogwild!, Niu et al.).

The run's one parameter shard (scaling.shards 1) keeps its slice, the whole flat parameter
vector, in shared memory on its node (actors/shards/parameter_shard.py `mapping`). A CPU replica
on that node maps it and makes its model's parameters views into it: every step, with no lock,
no message and no copy,
    g <- grad of the loss at x (x read as it is: other replicas may be writing it meanwhile)
    x <- x - eta g                                     (the optimizer's step, written in place)
so each replica's update lands in every other replica's parameters at once. Reads can see a
vector half-updated by another replica; for sparse or small updates this costs little
(Hogwild!'s argument), and no replica ever waits for another.

A replica that cannot map the vector (on another node, or on a GPU) trains as downpour with
n_fetch = n_push = 1 through the same shard: it pulls x, pushes g, and the shard applies it to the
same shared vector (`remote`). The optimizer's state (momentum, Adam's moments) is each direct
replica's own (a checkpoint holds one replica's); the shard's, for the pushes, is its own.

Recovery: the shard is rebuilt from its last snapshot like any other (orchestrator/fleet/
shard_group.py); a direct replica notices its process gone (a signal-0 probe each step, no call)
and maps the new incarnation, so the updates written directly since that snapshot are lost (at
most `fault_tolerance.shard_snapshot_every_s` of them). A replica killed loses nothing: what it wrote
is in the vector.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from policies.messages import SegmentEnd
from policies.rules.batches import rows
from policies.rules.modes import StepResult
from policies.rules.recipe import Recipe
from policies.rules.sharding import FlatParams
from policies.rules.tasks import Classification, Task


def process_alive(pid: int) -> bool:
    """Whether process `pid` still exists (signal 0: nothing is sent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class HogwildWorker:
    """One replica's hogwild rule. `share()` -> (the shared vector, the pid that holds it) or None
    when it cannot be mapped here; `remote`: the downpour worker used then."""

    model: torch.nn.Module
    flat: FlatParams
    optimizer: torch.optim.Optimizer  # this replica's own, stepping the shared parameters in place
    share: Callable[[], Optional[tuple[torch.Tensor, int]]]
    remote: Any
    task: Task = field(default_factory=Classification)
    recipe: Recipe = field(default_factory=Recipe)
    lr_factor: float = 1.0  # the schedule's factor at this replica's step (set by the replica each step)
    step_count: int = 0
    direct_steps: int = 0
    remaps: int = 0
    lock_step = False

    def __post_init__(self) -> None:
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.holder: Optional[int] = None
        self._bind()

    @property
    def holds_reference(self) -> bool:
        """The model's parameters are the shared vector itself (nothing to pull or put back).
        Asked before an evaluation or a checkpoint: a lost holder's vector is let go of first (and
        its successor's mapped), so neither reads an orphaned vector."""
        self._follow_holder()
        return self.holder is not None

    def _follow_holder(self) -> None:
        if self.holder is not None and not process_alive(self.holder):  # the shard was lost: map its successor
            self.release()
            self._bind()
            self.remaps += 1

    def _bind(self) -> None:
        shared = self.share() if self.flat.device.type == "cpu" else None
        if shared is None:
            self.holder = None
            return
        values, self.holder = shared
        if values.numel() != self.flat.numel:
            raise ValueError(f"the shared vector holds {values.numel()} values, the model {self.flat.numel}")
        self.flat.rebind(values)

    def step(self, x: Any, y: Any, more: bool = False, pause: bool = False) -> StepResult:
        self._follow_holder()
        if self.holder is None:
            self.remote.lr_factor = self.lr_factor
            result = self.remote.step(x, y, more, pause)
            self.step_count += 1
            return result
        self.flat.grads.zero_()
        loss = self.recipe.backward(self.model, self.task, x, y)
        if self.recipe.finite(loss):  # never write a non-finite gradient into the shared vector
            for group, lr in zip(self.optimizer.param_groups, self.base_lrs):
                group["lr"] = lr * self.lr_factor
            if self.recipe.apply(self.optimizer).applied:  # clipped; fp16: skipped on inf/NaN
                self.direct_steps += 1
        self.step_count += 1
        return StepResult(loss, 0.0, rows(y), more)

    def release(self) -> None:
        """Let go of the shared vector (a phase switch, the end): the parameters become a private
        copy of it, so the next mode's steps touch this replica only. A remote replica waits for
        its pushes."""
        if self.holder is not None:
            self.flat.rebind(self.flat.params.clone())
            self.holder = None
        elif self.remote is not None:
            self.remote.release()

    def end_epoch(self) -> dict[str, Any]:
        stats = self.remote.end_epoch() if self.holder is None and self.remote is not None else {}
        stats.update(direct_steps=self.direct_steps, remaps=self.remaps)
        self.direct_steps = self.remaps = 0
        return stats


def hogwild_metrics(stats: list[SegmentEnd]) -> dict[str, float]:
    """`direct_share`: the share of the epoch's updates written straight into the shared vector
    (1.0 when every replica is on the shard's node); `updates_per_s` across replicas."""
    modes = [s.mode for s in stats if "direct_steps" in s.mode]
    if not modes:
        return {}
    direct = sum(m["direct_steps"] for m in modes)
    pushed = sum(m.get("pushes", 0) for m in modes)
    slowest = max(s.train_s for s in stats)
    return {"direct_share": direct / max(direct + pushed, 1), "updates_per_s": (direct + pushed) / max(slowest, 1e-9),
            "shard_remaps": sum(m["remaps"] for m in modes)}
