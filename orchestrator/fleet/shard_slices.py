"""The sandblaster coordinator's way to the shards (policies/rules/sandblaster.py `Slices`): the
same call on every shard's slice, through the shard group's per-shard outcomes."""
from __future__ import annotations

from typing import Any

import numpy as np

from orchestrator.errors import TrainingError
from orchestrator.fleet.outcomes import gather
from orchestrator.fleet.shard_group import all_answers


class ShardSlices:
    """The sandblaster coordinator's way to the shards (policies/rules/sandblaster.py `Slices`):
    every shard runs the same call on its slice. `shards`: a ShardGroup, or a list of handles.
    The coordinator's operations (`run`, which move vectors) are answered by every shard within
    `timeout_s` (`outcomes.gather`), or TrainingError naming each shard that died or gave no
    answer. The calls that may be asked twice (`held`, `forget`, `finish_pass`, `values`) go,
    with a ShardGroup, through its `on_every_shard`: a dead or silent shard is rebuilt from its
    snapshot and asked again."""

    def __init__(self, shards: Any, timeout_s: float = 30.0) -> None:
        self.group = shards if hasattr(shards, "on_every_shard") else None
        self._handles = None if self.group is not None else list(shards)
        self.timeout_s = timeout_s

    @property
    def handles(self) -> list:
        return self.group.handles if self.group is not None else list(self._handles)

    def _all(self, method: str, *args: Any, what: str) -> list:
        refs = {i: getattr(h, method).remote(*args) for i, h in enumerate(self.handles)}
        return all_answers(gather(refs, self.timeout_s), f"sandblaster: {what}")

    def _every(self, method: str, *args: Any, what: str) -> list:
        if self.group is None:
            return self._all(method, *args, what=what)
        answers = self.group.on_every_shard(method, lambda i: args, f"sandblaster: {what}", timeout_s=self.timeout_s,
                                            snapshot=False)
        return [answers[i] for i in sorted(answers)]

    def run(self, ops) -> list[list[float]]:
        return self._all("lbfgs", list(ops), what="the shards' operations")

    def begin_pass(self, pass_id: int) -> None:
        self._all("gradient_pass", pass_id, what="the start of a gradient pass")

    def held(self) -> list[tuple[int, list[int], float, int]]:
        """Each shard's (open pass, the tasks it holds, their loss sum, their rows)."""
        return [tuple(h) for h in self._every("gradient_held", what="the pass's tasks")]

    def forget(self) -> None:
        """Every shard drops its L-BFGS vectors but x (a shard rebuilt: its history is gone)."""
        self._every("lbfgs_forget", what="the history's reset")

    def finish_pass(self, rows: int, tasks: int) -> None:
        """Every shard's "g" from the pass; each must hold every task 0..tasks-1 exactly once."""
        for shard, ids in enumerate(self._every("finish_gradient", rows, what="the pass's gradient")):
            if ids != list(range(tasks)):
                raise TrainingError(f"sandblaster: shard {shard} holds {len(ids)} of the pass's {tasks} task gradients")

    def values(self) -> np.ndarray:
        return np.concatenate(self._every("values", what="the shards' values"))
