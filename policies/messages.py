"""The messages a replica's epoch stream sends the driver, typed: the replica side
(actors/replica/epoch_loop.py) builds them, the driver (orchestrator/control/running.py,
epoch_end.py, states.py) and the mode registry (policies/rules/registry.py) read them by field.
A progress row stays a plain dict: it is a set of named figures for MLflow (docs/events.md)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

ENDS = ("epoch", "interrupted", "paused")  # how a segment ends


@dataclass(frozen=True)
class Stepping:
    """`announce`: the replica took its first step since it was (re)started or resumed."""
    rank: int
    t_wall: float
    step: int


@dataclass(frozen=True)
class Progress:
    """Progress rows sent mid-segment (tracking.progress_interval_s)."""
    rank: int
    rows: list[dict[str, Any]]


@dataclass(frozen=True)
class Evaluation:
    """eval.every_steps: this replica's evaluation sums of the reference model at `step`."""
    rank: int
    epoch: int
    step: int
    sums: Any


@dataclass(frozen=True)
class SegmentEnd:
    """A segment's end: `kind` "epoch" (the replica's part of the epoch done: its evaluation
    sums, the mode's figures, the partitions it read and the completions not yet reported),
    "interrupted" (a membership change; `reason`) or "paused" (a switch or a grow), with the
    segment's counts and the progress rows not sent yet."""
    kind: str
    rank: int
    epoch: int
    steps: int
    samples: int
    train_s: float
    comm_s: float
    consumed: list  # [step] -> row ids (trace_ids)
    loss: float
    progress: list[dict[str, Any]]
    step: int  # the replica's step count at the end
    mode_name: str
    partitions: list[int] = field(default_factory=list)
    unreported: list[int] = field(default_factory=list)
    eval: Optional[Any] = None
    mode: Optional[dict[str, Any]] = None  # the mode's own figures (downpour: staleness, ...)
    reason: str = ""
    position: Optional[dict[str, Any]] = None  # "paused": where it stands in its pass (PartitionReader.position)

    def __post_init__(self) -> None:
        if self.kind not in ENDS:
            raise ValueError(f"a segment ends as one of {ENDS}, not {self.kind!r}")

    def then(self, later: "SegmentEnd") -> "SegmentEnd":
        """This rank's totals over this segment and a later one of the same epoch: counts and
        row ids added; the evaluation, loss and mode figures of the later one if it ended the
        epoch."""
        merged = replace(self, steps=self.steps + later.steps, samples=self.samples + later.samples,
                         train_s=self.train_s + later.train_s, comm_s=self.comm_s + later.comm_s,
                         consumed=self.consumed + later.consumed, partitions=self.partitions + later.partitions)
        if later.kind == "epoch":  # a later segment that trained no row (a repair at the epoch's end) has no loss
            merged = replace(merged, eval=later.eval if later.eval is not None else self.eval,
                             loss=later.loss if later.loss == later.loss else self.loss, mode=later.mode,
                             mode_name=later.mode_name, kind="epoch")
        return merged
