"""What a checkpoint holds and where it goes.

A checkpoint is the lowest live rank's `state()` (the mode's reference model, its optimizer
state and step) plus the run's position: named parts, each a `Stateful` owner of that state
(`state_dict` / `load_state_dict`), registered on a `Position` when the run's context is built:

    totals           RunTotals (epochs, steps, samples, timings, restarts)   the controller
    policy           the switch policy's place (policies/decisions/switching.py)
    failure          the failure policy's restart budget (policies/decisions/failure.py)
    phases           which mode ran when
    train_elapsed_s  the training clock; wall_elapsed_s the run's
    batch_size       the replicas' batch (data.adaptive_batch grows it; orchestrator/control/reconfig/elastic.py)
    lr_schedule      every resize's learning-rate segment (orchestrator/control/reconfig/elastic.py)
    shards           each shard's server-optimizer state (orchestrator/fleet/shard_group.py)
    best             the best epoch so far (checkpoint.keep_best, stop.early_stopping)
    in_epoch         where inside its epoch a checkpoint was taken (`InEpoch`), None at an epoch end

A part a checkpoint lacks (one written before the part existed) keeps its fresh state;
`Position.load` says which. `Checkpointer` writes checkpoints into the run's CheckpointStore
(`<checkpoint.storage>/<run.name or mlflow run id>/`), keeps the newest state taken (a repair
that lost every allreduce replica goes on from it) and counts the next checkpoint's due time
from the newest one stored (`Clock`).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from dataclasses import asdict
from typing import Any, Callable, Optional, Protocol

from orchestrator.persistence.checkpoint import CheckpointStore, load_aside, save_checkpoint
from orchestrator.persistence.memory_copy import MemoryCopy, directory_key, end_leftover
from policies.messages import InEpochPlace, KeeperMove


@dataclass
class RunTotals:
    epochs: int = 0
    steps: int = 0
    samples: int = 0
    epoch_wall_s: float = 0.0  # whole epochs: training + evaluation + logging
    train_s: float = 0.0  # inside the replicas' step loops (slowest replica per epoch)
    comm_s: float = 0.0
    startup_s: float = 0.0
    time_to_target_s: Optional[float] = None
    metrics: dict[str, float] = field(default_factory=dict)  # the last epoch's task metrics (test_accuracy, ...)
    train_loss: float = float("nan")
    stop_reason: str = ""
    checkpoint: Optional[str] = None
    rows_per_epoch: list[int] = field(default_factory=list)  # train rows each epoch stepped on (all replicas)
    replica_restarts: int = 0
    # the driver's seconds in each state of its loop (control/states.py state_name), the run's
    # earlier drivers' included when it resumed
    state_s: dict[str, float] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("checkpoint", "stop_reason")}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for key, value in saved.items():
            if key != "startup_s":  # this start's own
                setattr(self, key, value)


class InEpoch:
    """The "in_epoch" part: where inside its epoch a checkpoint was taken (orchestrator/control/mid_epoch.py
    fills `taking` while it writes one; every other checkpoint holds None), and, loaded from a
    checkpoint, where a restarted run goes on (`loaded`, used once when that epoch opens):

        epoch          the epoch it was taken in (the run's completed epochs + 1)
        done           partitions trained whole
        skips          partition -> rows of its in-epoch order trained (a partition begun)
        steps, samples, train_s, comm_s   the epoch's counts so far (added to the rest at its end)
        replica_steps  rank -> its step count at the checkpoint
    """

    def __init__(self) -> None:
        self.taking: Optional[InEpochPlace] = None
        self.loaded: Optional[InEpochPlace] = None

    def state_dict(self) -> Optional[dict[str, Any]]:
        """The place as a checkpoint holds it: a plain dict (InEpochPlace.saved), or None."""
        return self.taking.saved() if self.taking is not None else None

    def load_state_dict(self, saved: Optional[dict[str, Any]]) -> None:
        self.loaded = InEpochPlace.from_saved(saved) if saved else None

    def take_for(self, epoch: int) -> Optional[InEpochPlace]:
        """The loaded place if it is inside `epoch` (then forgotten: it is used once)."""
        place, self.loaded = self.loaded, None
        return place if place is not None and place.epoch == epoch else None


class Stateful(Protocol):
    """A checkpoint part's owner: it gives its state and takes it back (the owner of the state
    is the one that knows what it is)."""

    def state_dict(self) -> Any: ...
    def load_state_dict(self, saved: Any) -> None: ...


@dataclass
class Part:
    """A part whose state is a derived value (a clock, a flag) of an owner that keeps more than
    it: its save and load, as a Stateful."""
    save: Callable[[], Any]
    load: Callable[[Any], None]

    def state_dict(self) -> Any:
        return self.save()

    def load_state_dict(self, saved: Any) -> None:
        self.load(saved)


class PartUnsaved(Exception):
    """A checkpoint part's owner cannot give its state now (e.g. a shard that does not answer):
    the checkpoint is written without it and says why, instead of a part silently empty."""


UNSAVED = "unsaved_parts"  # the position's record of the parts a checkpoint lacks: {name: why}


class Position:
    """The run's position as named parts, each a Stateful owner of its state."""

    def __init__(self) -> None:
        self._parts: dict[str, Stateful] = {}

    def register(self, name: str, part: Stateful) -> None:
        if name in self._parts or name == UNSAVED:
            raise ValueError(f"checkpoint part {name!r} is registered twice")
        self._parts[name] = part

    def save(self) -> dict[str, Any]:
        """Every part's state; a part whose owner raised PartUnsaved is left out and named, with
        the reason, under UNSAVED."""
        out: dict[str, Any] = {}
        unsaved: dict[str, str] = {}
        for name, part in self._parts.items():
            try:
                out[name] = part.state_dict()
            except PartUnsaved as exc:
                unsaved[name] = str(exc)
        if unsaved:
            out[UNSAVED] = unsaved
        return out

    def load(self, saved: dict[str, Any]) -> list[str]:
        """Each part `saved` holds back to its owner, in registration order; the names of the
        parts it lacks (they keep their fresh state: an older checkpoint's, or one written
        while the part's owner could not answer, `unsaved(saved)` says why)."""
        missing = []
        for name, part in self._parts.items():
            if name in saved:
                part.load_state_dict(saved[name])
            else:
                missing.append(name)
        return missing

    @staticmethod
    def unsaved(saved: dict[str, Any]) -> dict[str, str]:
        """The parts a saved position was written without, and why."""
        return dict(saved.get(UNSAVED) or {})


@dataclass(frozen=True)
class Clock:
    """When a checkpoint's state was taken: what checkpoint.every_s and checkpoint.every_steps
    count the next checkpoint from."""
    at_s: float = 0.0  # perf_counter when its state was taken (0: none yet, the training clock's start counts)
    step: int = 0  # the replica step in its state


@dataclass
class WriteOrder:
    """One checkpoint to write: its state, where it goes, and what must be stored before it
    (`before`: set once MLflow holds every metric logged before the checkpoint)."""
    state: dict[str, Any]
    tag: str
    step: int
    epoch: int
    store: CheckpointStore
    named: Optional[str]
    before: Any = None  # a threading.Event (or None)
    fields: dict[str, Any] = field(default_factory=dict)  # for its event
    clock: Clock = Clock()  # when its state was taken


CHECKPOINT_FLUSH_S = 10.0  # the MLflow writes asked for before a checkpoint, stored before it is written
DRAIN_S = 60.0  # a run that ends (or errs) waits this long for a checkpoint still being written


@dataclass(frozen=True)
class WriteOutcome:
    """What one checkpoint write came to (`Checkpointer.written`): stored (`path`, `stored`: the
    store's own path when a name was given too, `write_s`, `flush_late`: MLflow had not stored the
    run's metrics in time), failed (`failed`: why) or superseded before it began (`superseded_by`:
    the newer checkpoint's tag). `fields`: what its event carries besides (the caller's, and the
    in-memory keeper's answer)."""

    tag: str
    step: int
    fields: dict[str, Any]
    path: str = ""
    stored: str = ""
    write_s: float = 0.0
    flush_late: bool = False
    failed: str = ""
    superseded_by: str = ""


class Checkpointer:
    """Writes a run's checkpoints (orchestrator/persistence/checkpoint.py) and remembers the newest.

    A write asked for with `wait=False` goes to one background thread, so the replicas train on
    while it is stored: the newest order waits in one slot while an older one is written, and a
    newer order replaces one still waiting (that one is `superseded`: a newer checkpoint never
    waits behind an older upload). `drain()` waits until nothing is left; `written()` hands back
    what each write came to (for the run's events). A write with `wait=True` (the final and the
    interrupted checkpoint) drains first and is stored before it returns. A crash mid-write
    leaves a temporary file and no sidecar: the checkpoint before it stays the newest good one.

    Two newest, kept apart. `last_state` is the newest state taken, stored or not: it is in
    memory, so a repair that lost every replica holding the model goes on from it (fewer steps
    lost than from the one stored), the best epoch's model is kept from it and the finish logs
    it. `stored` is the clock of the newest checkpoint stored (or resumed from): checkpoint.every_s
    and every_steps count from it (`last_s`, `last_step`), so a write that failed, or one
    superseded before it began, moves no clock and the next checkpoint is due from the last one
    stored. While a write waits or is being written the clocks count from it instead: one is on
    its way, and asking for another at every look until it lands would only supersede it."""

    def __init__(self, storage: str, keep: int, run_name: Optional[str], flush_s: float = CHECKPOINT_FLUSH_S,
                 in_memory_keep_s: Optional[float] = None) -> None:
        self.storage, self.keep, self.run_name, self.flush_s = storage, keep, run_name, flush_s
        self.store: Optional[CheckpointStore] = None  # opened at the first checkpoint (the run id is known then)
        self._asides: dict[str, Any] = {}  # the guard written beside the checkpoints: its key and reference
        self.in_memory_keep_s = in_memory_keep_s  # checkpoint.in_memory: a keeper holds each one too, this long unheard
        self.memory: Optional[MemoryCopy] = None  # that keeper (opened with the store)
        self.last_state: Optional[dict[str, Any]] = None  # the newest state taken, stored or not (class doc)
        self.stored = Clock()  # the newest checkpoint stored, or the one the run resumed from
        self._cv = threading.Condition()
        self._waiting: Optional[WriteOrder] = None
        self._writing: Optional[WriteOrder] = None  # the order the background thread is storing
        self._outcomes: list[WriteOutcome] = []
        self._thread: Optional[threading.Thread] = None
        self.taken_s: dict[tuple[str, int], float] = {}  # (tag, step) -> seconds on the training path (its event's)

    @property
    def last_s(self) -> float:
        """perf_counter when the checkpoint that checkpoint.every_s counts from was taken (class doc)."""
        return self._due_from().at_s

    @property
    def last_step(self) -> int:
        """The replica step of the checkpoint that checkpoint.every_steps counts from (class doc)."""
        return self._due_from().step

    def _due_from(self) -> Clock:
        """The newest write on its way (waiting, or being written), else the newest stored."""
        with self._cv:
            on_its_way = self._waiting or self._writing
            return on_its_way.clock if on_its_way is not None else self.stored

    def resumed(self, step: int) -> None:
        """The run goes on from a stored checkpoint at replica step `step`: every_steps counts from it."""
        with self._cv:
            self.stored = Clock(self.stored.at_s, step)

    def _keeper_key(self, directory: str) -> str:
        """The key of the keeper of the run's checkpoint directory `directory` under this storage."""
        return directory_key(f"{self.storage.rstrip('/')}/{directory}")

    def write(self, state: dict[str, Any], tag: str, step: int, epoch: int, mlflow_run_id: str,
              named: Optional[str] = None, wait: bool = True, before: Any = None,
              fields: Optional[dict[str, Any]] = None) -> tuple[str, str]:
        """`state` as ckpt-<step>-<tag>.pt (+ sidecar) in the run's store (the newest `keep`
        kept) and, given `named`, also as <that directory>/<named>: (the path to report, the
        store's path). `wait`: stored before this returns (its outcome raised, not queued);
        else written in the background (class doc). `before`: an event to wait for (at most
        flush_s) before writing; `fields`: for its event."""
        directory = self.run_name or mlflow_run_id
        if self.store is None or self.store.run_name != directory:
            self.store = CheckpointStore(self.storage, directory, self.keep)
            if self.memory is not None:
                self.memory.close()
            if self.in_memory_keep_s is not None:
                self.memory = MemoryCopy(self._keeper_key(directory), self.in_memory_keep_s)
        guard = state.get("probation")
        if guard and "state" in guard:  # a switch's guard: its model once, beside the checkpoints
            state = {**state, "probation": self._guard_aside(guard, step)}
        # the run's step count (monotonic, the x-axis of the epoch metrics) orders the store
        stored = self.store.path_of(CheckpointStore.name_for(step, tag))
        path = self.store.path_of(named) if named else stored
        self.last_state = state  # the newest taken; the clocks move once it is stored (class doc)
        order = WriteOrder(state, tag, step, epoch, self.store, named, before, dict(fields or {}),
                           Clock(time.perf_counter(), int(state.get("step") or 0)))
        if wait:
            if self.memory is not None:  # a background hand-over to a silent keeper does not hold this one up
                self.memory.hurry()
            try:
                self.drain()
            finally:
                if self.memory is not None:
                    self.memory.hurry(False)
            outcome = self._perform(order, waited=True)  # a store that fails raises: no clock moved
            with self._cv:
                self.stored = order.clock
                self._outcomes.append(outcome)
            return path, stored
        with self._cv:
            if self._waiting is not None:
                self._outcomes.append(WriteOutcome(self._waiting.tag, self._waiting.step, self._waiting.fields,
                                                   superseded_by=tag))
            self._waiting = order
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="checkpoint writer", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return path, stored

    def _perform(self, order: WriteOrder, waited: bool = False) -> WriteOutcome:
        """Store the order (and hand it to the keeper, with checkpoint.in_memory: first for a
        background write, so a driver that dies meanwhile loses nothing; after storing for one the
        run waits on, the final or the interrupted one, which must reach storage first)."""
        t = time.perf_counter()
        late = order.before is not None and not order.before.wait(self.flush_s)
        data, meta = CheckpointStore.serialized(order.state, order.step, order.epoch, order.tag)
        finished, held = bool(order.state.get("finished")), {}
        keep = self.memory is not None and not finished
        if keep and not waited:
            held = self.memory.hold(meta, data)
        stored = order.store.save_serialized(data, meta)
        if keep and waited:
            held = self.memory.hold(meta, data)
        if self.memory is not None and finished:  # the run is over: nothing to go on from
            held = self.memory.release()
        elif finished and self.run_name:  # in_memory off: a keeper an earlier driver of this name left ends too
            if end_leftover(self._keeper_key(order.store.run_name)):
                held = {"in_memory_released": "a keeper left by an earlier driver of this name"}
        if order.named:
            save_checkpoint(order.store.storage, order.store.run_name, order.named, order.state)
        path = order.store.path_of(order.named) if order.named else stored
        return WriteOutcome(order.tag, order.step, {**held, **order.fields}, path, stored,
                            round(time.perf_counter() - t, 4), late)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._waiting is None:
                    self._cv.wait()
                order, self._waiting = self._waiting, None
                self._writing = order
            try:
                outcome = self._perform(order)
            except Exception as exc:  # the store failed: said as the checkpoint's failure, the previous one kept
                outcome = WriteOutcome(order.tag, order.step, order.fields, failed=f"{type(exc).__name__}: {exc}")
            with self._cv:
                if not outcome.failed:  # stored: the clocks count from it
                    self.stored = order.clock
                self._outcomes.append(outcome)
                self._writing = None
                self._cv.notify_all()

    def _guard_aside(self, guard: dict[str, Any], step: int) -> dict[str, Any]:
        """A switch's guard (policies: the model from before the switch, kept while it is on
        probation) as a checkpoint holds it: its small fields and a reference to one copy of its
        model written beside the checkpoints at the first checkpoint on that probation
        (`guard-<step>.pt`), so a checkpoint on probation is not twice the size of another."""
        key = (guard["phase"], guard["mode"], guard["loss"], guard["until"], self.store.directory)
        if self._asides.get("key") != key:
            self._asides = {"key": key, "ref": self.store.save_aside(f"guard-{step:09d}.pt", guard["state"])}
        return {**{k: v for k, v in guard.items() if k != "state"}, "state_ref": self._asides["ref"]}

    def drain(self, timeout_s: Optional[float] = DRAIN_S) -> bool:
        """Wait (at most timeout_s) until every write asked for is stored; False if one is still going."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while self._writing is not None or self._waiting is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def move_keeper_off(self, draining: dict[str, Any]) -> list[KeeperMove]:
        """checkpoint.in_memory: the keeper's node is being drained -> its copy moves to another
        node (in the background, MemoryCopy.move_off). What each move since the last call came to."""
        if self.memory is None:
            return []
        if draining:
            self.memory.move_off(draining)
        return self.memory.moves()

    def close(self) -> None:
        """The run ended: its keeper (if any) is no longer touched, and ends keep_s later unless
        the run is started again (a finished run released it already)."""
        if self.memory is not None:
            self.memory.close()

    def written(self) -> list[WriteOutcome]:
        """What each write since the last call came to (stored, failed or superseded)."""
        with self._cv:
            out, self._outcomes = self._outcomes, []
        return out


def resolve_probation(saved: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """A checkpoint's `probation` with its guard's model in hand: read from the copy beside the
    checkpoints it names (`state_ref`, checked), or as an older checkpoint held it inline."""
    if not saved or "state_ref" not in saved:
        return saved
    return {**{k: v for k, v in saved.items() if k != "state_ref"}, "state": load_aside(saved["state_ref"])}
