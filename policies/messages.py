"""The messages a replica's epoch stream sends the driver, typed: the replica side
(actors/replica/epoch_loop.py) builds them, the driver (orchestrator/control/running.py,
epoch_end.py, states.py) and the mode registry (policies/rules/registry.py) read them by field.
A progress row (`ProgressRow`) names the figures MLflow logs (docs/events.md).

Below them, the other values that cross between the actors or the fleet and the controller,
typed the same way: an epoch's counts, the partition server's status, a reader's place in its
pass, the place inside an epoch a checkpoint holds, what the fleet did on its own, a keeper's move, a replica's answer to a mode
change, and typed views of a checkpoint's state and of a switch's guard it keeps (the file stays
the plain dict it always was)."""
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
class ProgressRow:
    """A replica's figures over its last tracking.log_every_steps steps: where it is (`step`, and
    `step_in_epoch`), its loss, speed and rate, compute seconds per step, communication share and
    seconds per step, its batch's rows; local SGD's balanced period, allreduce's waiting seconds,
    busy spread and gradient diversity, the mean gradient norm, the steps skipped (fp16, a
    switch's probation). A figure the replica does not measure is None."""
    rank: int
    epoch: int
    step: int
    step_in_epoch: int
    loss: float
    samples_per_s: float
    compute_s: Optional[float]
    comm_share: float
    lr: Optional[float]
    comm_s: float
    batch_rows: int
    period: Optional[int] = None
    wait_s: Optional[float] = None
    busy_spread: Optional[float] = None
    gradient_diversity: Optional[float] = None
    grad_norm: Optional[float] = None
    skipped_steps: Optional[int] = None

    def figure(self, name: str) -> Any:
        """The figure called `name` (None when not measured)."""
        return getattr(self, name)


@dataclass(frozen=True)
class Progress:
    """Progress rows sent mid-segment (tracking.progress_interval_s)."""
    rank: int
    rows: list[ProgressRow]


@dataclass(frozen=True)
class ReaderPosition:
    """Where a replica stands in its pass (PartitionReader.position): the partitions trained
    whole, and those trained part way (partition -> rows of its in-epoch order trained)."""
    full: list[int]
    partial: dict[int, int]


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
    progress: list[ProgressRow]
    step: int  # the replica's step count at the end
    mode_name: str
    partitions: list[int] = field(default_factory=list)
    unreported: list[int] = field(default_factory=list)
    eval: Optional[Any] = None
    mode: Optional[dict[str, Any]] = None  # the mode's own figures (downpour: staleness, ...)
    reason: str = ""
    position: Optional[ReaderPosition] = None  # "paused": where it stands in its pass

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


@dataclass(frozen=True)
class EpochCounts:
    """An epoch's counts: steps (the furthest rank's), samples (every rank's), train_s and
    comm_s (the slowest rank's)."""
    steps: int = 0
    samples: int = 0
    train_s: float = 0.0
    comm_s: float = 0.0


@dataclass(frozen=True)
class InEpochPlace:
    """Where inside its epoch a checkpoint was taken: the partitions trained whole (`done`), those
    begun (`skips`: partition -> rows of its in-epoch order trained), the epoch's counts so far
    and each rank's step. A checkpoint keeps it as the flat dict `saved()` gives (its "in_epoch"
    part, orchestrator/persistence/run_state.py InEpoch); `from_saved` reads one back."""
    epoch: Optional[int]
    done: list[int]
    skips: dict[int, int]
    counts: EpochCounts
    replica_steps: dict[int, int] = field(default_factory=dict)

    def saved(self) -> dict[str, Any]:
        c = self.counts
        return {"epoch": self.epoch, "done": self.done, "skips": self.skips, "steps": c.steps, "samples": c.samples,
                "train_s": c.train_s, "comm_s": c.comm_s, "replica_steps": self.replica_steps}

    @classmethod
    def from_saved(cls, saved: dict[str, Any]) -> "InEpochPlace":
        return cls(saved.get("epoch"), saved["done"], saved["skips"],
                   EpochCounts(saved["steps"], saved["samples"], saved["train_s"], saved["comm_s"]),
                   saved.get("replica_steps", {}))


@dataclass(frozen=True)
class ServerStatus:
    """The partition server's status (PartitionServer.status): the epoch it serves, whether every
    partition of it was served, how many are left, the partitions served whole (partition ->
    rank), those served again after a replica died, the server's incarnation."""
    epoch: int
    complete: bool
    remaining: int
    done: dict[int, Any]
    redone: list[dict[str, Any]]
    generation: int


@dataclass(frozen=True)
class FleetEvent:
    """Something the fleet did on its own (a partition server or a shard rebuilt,
    orchestrator/fleet/): the run's event (`kind`, `fields`, docs/events.md) and the line that
    tells the user."""
    kind: str
    fields: dict[str, Any]
    line: str


@dataclass(frozen=True)
class KeeperMove:
    """What one move of checkpoint.in_memory's keeper off a drained node came to: the node it
    left, the node it went to, its seconds, the bytes carried and when it was done (wall clock);
    or, `failed`, why it could not move."""
    node: str
    to: Optional[str] = None
    move_s: Optional[float] = None
    bytes: int = 0
    done_wall: Optional[float] = None
    failed: Optional[str] = None


@dataclass(frozen=True)
class ModeSet:
    """A replica's answer to a mode change (ModelReplica.set_mode): its rank and step, and what
    became of its local optimizer state (carry_optimizer_state's word, for the event)."""
    rank: int
    step: int
    local_optimizer: str


@dataclass(frozen=True)
class SavedState:
    """A checkpoint's state as the controller reads it: a typed view (`of`) of the plain dict a
    replica's `state` gives and a checkpoint file holds, which stays as it is."""
    model: Any
    optimizer: Any
    step: int
    recipe: Any = None
    worker: Any = None
    run: Optional[dict[str, Any]] = None  # the run's position, by part (Position.save)
    probation: Optional[dict[str, Any]] = None  # a switch's guard still judging (its saved form)

    @classmethod
    def of(cls, state: dict[str, Any]) -> "SavedState":
        return cls(state["model"], state.get("optimizer"), state["step"], state.get("recipe"), state.get("worker"),
                   state.get("run"), state.get("probation") or None)

    def part(self, name: str) -> Any:
        """The run position's part `name`."""
        return self.run[name]

    @property
    def probation_until(self) -> Optional[int]:
        """The last epoch the guard on probation judges (None: not on probation)."""
        return int(self.probation["until"]) if self.probation else None

    def loadable(self) -> dict[str, Any]:
        """What a replica loads (ModelReplica.load_state): model, optimizer, step, recipe, worker."""
        return {"model": self.model, "optimizer": self.optimizer, "step": self.step, "recipe": self.recipe,
                "worker": self.worker}


@dataclass(frozen=True)
class Probation:
    """A switch's guard as a checkpoint keeps it (read back with its model): the phase and mode
    from before the switch, their model, the test loss at the switch, the epoch ends it has
    left to judge and the last epoch it judges."""
    phase: int
    mode: str
    state: Any
    loss: float
    checks: int
    until: int

    @classmethod
    def of(cls, saved: Optional[dict[str, Any]]) -> Optional["Probation"]:
        """The guard a checkpoint's `probation` dict holds (None when it holds none)."""
        return None if not saved else cls(int(saved["phase"]), str(saved["mode"]), saved["state"],
                                          float(saved["loss"]), int(saved["checks"]), int(saved["until"]))
