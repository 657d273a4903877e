"""What the state handlers get instead of the controller: the run's contexts, each the one
owner of its part of the run, and the operations the handlers share.

    RunContext
      |-- fleet     Fleet     the actors and who holds them: replicas (ReplicaGroup), shards
      |                       (ShardGroup), the partition server, the pause gate, elasticity,
      |                       where the data lives, the run's interrupt state
      |-- phase     Phase     which phase runs (the one owner): strategy, mode spec, lock step,
      |                       leasing, the phase record
      |-- ledger    Ledger    what the run has done: totals, each replica's step and latest row,
      |                       completions not yet reported, the clocks, the best model
      |-- policies  Policies  the deciders, passed in: failure, stop, switch, best, chance
      |-- report    Reporter  MLflow, events, the display, callbacks
      `-- operations the handlers share: open an epoch or a stream, give data, re-cut the test
          slices, finish an evaluation, take a checkpoint, watch the servers while waiting

The controller (orchestrator/control/controller.py) owns the state machine and builds this (with the
fleet's Elasticity and the group's wait watch, which are handlers' work); the
handlers (starting, running, epoch_end, carrier, repair, phase_switch, grow, elastic, finishing,
failures) take a RunContext, and the state's payload they work on, never the controller. What
the control flow has pending (a switch, its probation, a stop) is the state's
(orchestrator/control/states.py Pending), not a context's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional, Union

from orchestrator.checks import one_line
from orchestrator.config import JobConfig
from orchestrator.data.in_memory import Dataset
from orchestrator.errors import Interrupts, TrainingError
from orchestrator.control.decide import DecisionLog
from orchestrator.fleet.drains import DrainWatch
from orchestrator.fleet.replica_group import ReplicaGroup
from orchestrator.fleet.pause import PauseGate
from orchestrator.reporting.progress import ProgressDisplay
from orchestrator.reporting.reporter import Reporter
from orchestrator.persistence.run_state import CHECKPOINT_FLUSH_S, DRAIN_S, Checkpointer, InEpoch, Part, PartUnsaved, Position, RunTotals
from orchestrator.control.epoch_record import EpochRecord
from orchestrator.control.states import EpochSegment, RateBase
from orchestrator.fleet.epoch_reader import EpochReader
from orchestrator.reporting.tracking import Tracker
from policies.decisions.failure import FailurePolicy
from policies.decisions.leases import MAX_GRANT, first_grant_messages
from policies.rules.recipe import planned_steps
from policies.rules.registry import ModeSpec, mode_spec
from policies.decisions.batch_size import AdaptiveBatch
from policies.decisions.stop import BestWatch, ChanceWatch, StopPolicy
from policies.decisions.switching import SwitchPolicy, make_switch_policy, replicas_strategy, shard_settings
from policies.messages import ProgressRow, SavedState, ServerStatus
from policies.rules.tasks import split_metric, sum_stats

if TYPE_CHECKING:  # the fleet's parts made in Starting and by the controller (names only: no import at run time)
    from orchestrator.control.reconfig.elastic import Elasticity
    from orchestrator.data.placement import StoredData, StreamedData
    from orchestrator.fleet.server_link import ServerLink
    from orchestrator.fleet.shard_group import ShardGroup

SHARD_STATE_TIMEOUT_S = 10.0  # the shards' optimizer states for a checkpoint


@dataclass
class Fleet:
    """The actors and who holds them."""
    group: ReplicaGroup
    interrupts: Interrupts
    needs_shards: bool  # any phase keeps its reference in shards
    shard_group: Optional[ShardGroup] = None  # sharded modes, from Starting on
    server: Optional[ServerLink] = None  # to the PartitionServer, from Starting on
    pause: Optional[PauseGate] = None  # holds the replicas at partition boundaries (why: the state's Pending.pause)
    elastic: Optional[Elasticity] = None  # growing and shrinking with the cluster (control/reconfig/elastic.py)
    data: Union[StoredData, StreamedData, None] = None  # where the data lives (orchestrator/data/placement.py): in-memory refs kept alive here
    drains: DrainWatch = field(default_factory=DrainWatch)  # nodes being drained (preemption notices)
    reader: EpochReader = field(default_factory=EpochReader)  # the epoch's open streams and their hang clocks


@dataclass
class Phase:
    """Which phase runs: the one owner of it (`set`, called where a switch commits). A switch
    decided, or on probation, is the controller state's (orchestrator/control/states.py Pending)."""
    server_optimizer: Any  # what the shards apply: a name, or {name, kwargs} (policies/rules/sharding.py ShardState)
    strategy: dict[str, Any] = field(default_factory=dict)
    spec: Optional[ModeSpec] = None
    lock_step: bool = False
    pinned: bool = False
    batch_shares: Optional[list[int]] = None  # strategy.balance: the split last reported (rows or periods)
    lease_plan: tuple = ()  # (rows, replicas, seed, pinned, shuffle): the grants' pure plan (policies/decisions/leases.py)
    tasks: Optional[list[tuple[int, int, int]]] = None  # sandblaster's strategy.task_rows: what is leased, (partition, lo, hi) each
    max_grant: int = MAX_GRANT
    backups: bool = False  # sandblaster's backup copies of late partitions (strategy.backup_tasks)
    phases: list[dict[str, Any]] = field(default_factory=list)  # the result JSON's record of which mode ran when
    coordinator: Any = None  # sandblaster: the L-BFGS coordinator's scalars (orchestrator/control/passes.py)
    coordinator_generations: list[int] = field(default_factory=list)  # the shards' incarnations it ran on
    coordinated: Optional[tuple] = None  # (epoch, figures, converged): the last pass's iteration, made once

    def set(self, strategy: dict[str, Any]) -> None:
        """The phase that runs now: its strategy, its mode's registry entry, lock-step or not."""
        self.strategy = strategy
        self.spec = mode_spec(strategy["mode"])
        self.lock_step = self.spec.lock_step(strategy)
        self.batch_shares = None  # a phase's balanced work starts even
        self.pinned = self.spec.leases_pinned(strategy)


@dataclass
class Ledger:
    """What the run has done so far."""
    t0: float  # perf_counter when the run began (time_to_target_s counts from it)
    totals: RunTotals = field(default_factory=RunTotals)
    progress: dict[int, int] = field(default_factory=dict)  # rank -> the last step it reported
    signals: dict[int, ProgressRow] = field(default_factory=dict)  # rank -> its latest progress row
    unreported: dict[int, list[int]] = field(default_factory=dict)  # last epoch's final completions, not yet reported
    consumed: list[dict[int, list[list[int]]]] = field(default_factory=list)  # [epoch] {rank: [step] -> row ids}
    redone: list[dict[str, Any]] = field(default_factory=list)  # partitions served again after a replica died
    steps_per_epoch: int = 0
    train_started: float = 0.0  # perf_counter when training began (after start-up)
    t_train_wall: float = 0.0  # the same, wall clock (the replicas' throughput figures count from it)
    best_model: Optional[dict[str, Any]] = None  # keep_best: the best epoch's model (state dict)
    in_epoch: InEpoch = field(default_factory=InEpoch)  # a checkpoint's place inside its epoch (mid_epoch.py)
    decisions: DecisionLog = field(default_factory=DecisionLog)  # Running's decisions (decide.py), in order
    epoch: EpochRecord = field(default_factory=EpochRecord)  # what the epoch's streams said (epoch_record.py)


@dataclass
class Policies:
    """The deciders (policies/), passed in."""
    failure: FailurePolicy
    stop: StopPolicy
    switch: SwitchPolicy
    best: BestWatch  # checkpoint.keep_best, stop.early_stopping
    chance: Optional[ChanceWatch]  # a classification run's loss at chance: diverged
    batch: Optional[AdaptiveBatch] = None  # data.adaptive_batch


def make_policies(config: JobConfig, metric: str, task: Any, dataset: Dataset) -> Policies:
    s, ft = config.stop, config.fault_tolerance
    early = s.early_stopping
    classes = getattr(dataset, "num_classes", 0) or 0
    return Policies(
        failure=FailurePolicy(ft.max_replica_restarts, ft.restart_backoff_s, config.scaling.min_replicas),
        stop=StopPolicy(s.epochs, config.target(), s.at_target, s.max_wall_s, s.max_steps),
        switch=make_switch_policy(config.strategy, config.metric_goals()),
        best=BestWatch(*config.watched(), early.min_delta if early else 0.0, early.patience if early else None),
        chance=ChanceWatch(classes) if getattr(task, "name", "") == "classification" and classes > 1 else None,
        batch=AdaptiveBatch(config.data.batch_size, a.max, a.factor) if (a := config.data.adaptive_batch) else None)


def shards_optimizer(config: JobConfig) -> Any:
    """What the shards apply in a run whose phases keep their reference in shards (None if none)."""
    sharded = [m for m in config.strategy.modes() if mode_spec(m).sharded]
    if not sharded:
        return None
    server = mode_spec("downpour" if "downpour" in sharded else sharded[0]).server_optimizer(config.optimizer.name)
    # a name, or with optimizer.kwargs {name, kwargs} (policies/rules/sharding.py ShardState)
    return ({"name": server, "kwargs": dict(config.optimizer.kwargs)}
            if server == config.optimizer.name and config.optimizer.kwargs else server)


class RunContext:
    def __init__(self, config: JobConfig, dataset: Dataset, tracker: Optional[Tracker], t0: float,
                 display: Optional[ProgressDisplay] = None, trace_ids: bool = False,
                 resume: Optional[dict[str, Any]] = None, interrupts: Optional[Interrupts] = None,
                 policies: Optional[Policies] = None) -> None:
        """`resume`: a checkpoint's state to go on from (orchestrator/persistence/resume.py): the run starts
        at the epoch after the one it was taken at, in the phase it was in. `interrupts`: the
        run's interrupt state (the trainer routes the process's signals to it). `policies`: the
        deciders, passed in (default: the config's, `make_policies`)."""
        self.cfg = config
        self.dataset = dataset
        self.trace_ids = trace_ids
        self.task = config.task.build()  # the loss and the metrics (policies/rules/tasks.py)
        self.target = config.target()
        self.metric = config.headline_metric()  # what progress lines, switch events and phases report
        self.resume = resume
        self.resumed = SavedState.of(resume) if resume is not None else None  # the same, typed
        self.policies = policies or make_policies(config, self.metric, self.task, dataset)
        if resume is not None:
            # now, for the phase this start runs in; starting.restore loads every part again, this one included
            self.policies.switch.load_state_dict(self.resumed.part("policy"))
        self.phase = Phase(shards_optimizer(config))
        plan = self.policies.switch.plan  # hogwild: its replicas' momentum translated, at a start or resume too
        self.phase.set(replicas_strategy(plan[self.policies.switch.current], config.optimizer.model_dump(),
                                         config.scaling.replicas, len(plan) > 1)[0])
        self.ledger = Ledger(t0)
        self.report = Reporter(tracker, display, t0)
        group = ReplicaGroup(config, strategy=self.phase.strategy, interrupts=interrupts or Interrupts())
        held = self.resumed.probation_until if self.resumed is not None else None
        if held is not None:  # resumed inside a switch's probation: the replicas are on it too
            group.set_strategy(self.phase.strategy, held)
        # optimizer.schedule's clock: the optimizer steps the run plans (policies/rules/recipe.py planned_steps)
        group.raw["schedule_steps"] = planned_steps(dataset.train_rows, config.data.batch_size,
                                                    config.data.accumulate, config.scaling.replicas, config.stop.epochs,
                                                    config.stop.max_steps)
        self.fleet = Fleet(group, group.interrupts, needs_shards=self.phase.server_optimizer is not None)
        self.fleet.pause = PauseGate()  # its server link is given when Starting starts the server
        self.checkpoints = Checkpointer(config.checkpoint.storage, config.checkpoint.keep, config.run.name,
                                        CHECKPOINT_FLUSH_S,
                                        config.checkpoint.in_memory_keep_s if config.checkpoint.in_memory else None)
        self.position = self._position()

    def _position(self) -> Position:
        """The run's position a checkpoint holds: each part its owner, Stateful
        (orchestrator/persistence/run_state.py); the fleet's Elasticity registers its learning-rate
        schedule when the controller builds it."""
        pos = Position()

        def load_phases(saved: list) -> None:
            self.phase.phases = saved

        def load_train_clock(seconds: float) -> None:
            self.ledger.train_started = time.perf_counter() - seconds

        def load_wall_clock(seconds: float) -> None:
            self.ledger.t0 = time.perf_counter() - seconds  # time_to_target_s goes on counting from the first start

        def save_shards() -> Optional[list]:
            if self.fleet.shard_group is None:
                return None
            try:  # a shard down or silent (rebuilt at the next poll): this checkpoint goes without, and says which
                return self.fleet.shard_group.optimizer_states(min(self.cfg.strategy.timeout_s, SHARD_STATE_TIMEOUT_S))
            except TrainingError as exc:
                raise PartUnsaved(f"the shards' optimizer states: {one_line(exc)[:200]}") from None

        def load_shards(saved: Optional[list]) -> None:
            if saved is not None and self.fleet.shard_group is not None:
                self.fleet.shard_group.load_optimizer_states(saved, self.cfg.strategy.timeout_s)

        pos.register("totals", self.ledger.totals)
        pos.register("policy", self.policies.switch)
        pos.register("failure", self.policies.failure)
        pos.register("phases", Part(lambda: [dict(p) for p in self.phase.phases], load_phases))
        pos.register("train_elapsed_s", Part(lambda: time.perf_counter() - self.ledger.train_started, load_train_clock))
        pos.register("wall_elapsed_s", Part(lambda: time.perf_counter() - self.ledger.t0, load_wall_clock))
        pos.register("shards", Part(save_shards, load_shards))
        pos.register("best", self.policies.best)
        pos.register("in_epoch", self.ledger.in_epoch)
        return pos

    @property
    def last_state(self) -> Optional[dict[str, Any]]:
        """The newest checkpoint state taken, stored or not (in memory: a repair that lost every
        allreduce replica loads it, the best epoch's model and the finish read it); the next
        checkpoint is due from the newest one stored (persistence/run_state.py: Checkpointer)."""
        return self.checkpoints.last_state

    @property
    def last_saved(self) -> Optional[SavedState]:
        """`last_state`, typed (None when none was taken)."""
        state = self.checkpoints.last_state
        return SavedState.of(state) if state is not None else None

    def rate_base(self) -> RateBase:
        """The running phase's rate a resize's schedule is a factor of (Elasticity.follow)."""
        return RateBase(self.shard_optimizer(self.phase.strategy)[1], self.phase.spec.global_batch)

    def shard_optimizer(self, strategy: dict[str, Any]) -> tuple[str, float, float, float]:
        """What the shards apply in this phase: (name, lr, momentum, weight_decay), the phase's
        optimizer overrides over optimizer.*, translated for the mode it enters
        (policies/decisions/switching.py: shard_settings)."""
        return (self.phase.server_optimizer, *self.phase_optimizer(strategy)[0])

    def phase_optimizer(self, strategy: dict[str, Any]) -> tuple[tuple[float, float, float], Optional[str]]:
        """(lr, momentum, weight_decay) of a phase's shards and what was translated (or None)."""
        replicas = len(self.fleet.group.members) or self.cfg.scaling.replicas
        return shard_settings(strategy, self.cfg.optimizer.model_dump(), replicas, len(self.policies.switch.plan) > 1)

    def record_phase(self, sw: Any, step: int, before: float, after: float) -> None:
        """Close the running phase's record and open the next one's (`before`, `after`: the
        headline metric, e.g. test_accuracy, around the switch)."""
        now = round(time.perf_counter() - self.ledger.train_started, 3)
        if self.phase.phases:
            self.phase.phases[-1].update(end_step=step, end_s=now, ended_by=sw.rule, **{f"{self.metric}_at_end": round(before, 4)})
        self.phase.phases.append({"phase": sw.phase, "mode": sw.mode, "start_step": step, "start_s": now,
                            "start_epoch": self.ledger.totals.epochs + 1, f"{self.metric}_at_start": round(after, 4)})

    def headline_value(self, metrics: dict[str, float]) -> float:
        """The headline metric's value in `metrics` (train_loss from the totals)."""
        return {**metrics, "train_loss": self.ledger.totals.train_loss}.get(self.metric, float("nan"))

    def finish_evaluation(self, evals: list[dict[str, Any]], split: Optional[str] = None) -> dict[str, float]:
        """The task's metrics from every replica's evaluation sums (added, then finished once:
        the same figures one process evaluating the whole split gets), named for the split they
        were measured on (default: the run's evaluated split; val_* with data.val_fraction)."""
        split = split or self.cfg.eval_split
        return {split_metric(k, split): float(v) for k, v in self.task.finish(sum_stats(evals)).items()}

    @property
    def loss_metric(self) -> str:
        """The evaluated split's loss (test_loss, or val_loss): what the switch guard and the
        divergence check watch."""
        return split_metric("test_loss", self.cfg.eval_split)

    # ---- the reporter's tracker (the trainer opens it while the actors boot) ---------------
    @property
    def tracker(self) -> Optional[Tracker]:
        return self.report.tracker

    @tracker.setter
    def tracker(self, tracker: Tracker) -> None:
        self.report.tracker = tracker

    @property
    def replicas(self) -> list[Any]:
        """The live replicas in rank order."""
        return self.fleet.group.handles()

    @property
    def shards(self) -> list[Any]:
        return list(self.fleet.shard_group.handles) if self.fleet.shard_group is not None else []

    # ---- Starting: data into the object store, actors, process group -----------------------
    def give_data(self, ranks: list[int]) -> None:
        """The partition server, the train partitions (refs, or a file source's plan) and each
        replica's share of the test split (shares follow the members' positions in rank order)."""
        members, split = self.fleet.group.ranks, self.cfg.eval_split
        where = {r: self.fleet.data.test_share(i, len(members), split) for i, r in enumerate(members)}
        self.fleet.group.call(ranks, "set_data", what="data",
                        per_rank=lambda r: (self.fleet.server.address(), [self.fleet.data.train], *where[r], self.ledger.t_train_wall,
                                            self.phase.tasks))

    def reslice_tests(self, split: Optional[str] = None) -> None:
        """Each member's share of the evaluated split (default: the run's; "test" for the final
        evaluation of a run with a validation split)."""
        members, split = self.fleet.group.ranks, split or self.cfg.eval_split
        where = {r: self.fleet.data.test_share(i, len(members), split) for i, r in enumerate(members)}
        self.fleet.group.call(members, "set_test_slice", what="test slices", per_rank=lambda r: where[r])

    # ---- Running: an epoch's streams -------------------------------------------------------
    def fresh_epoch(self, epoch: int, begun: bool = True) -> EpochSegment:
        """A new epoch's segment (`begun` False: its streams are opened when Running next runs);
        the reader and the epoch's record start empty, but for a recovery still being timed (a
        newcomer that had nothing left to do in the last epoch steps first in this one)."""
        self.fleet.reader.clear()
        self.ledger.epoch = EpochRecord(recoveries=self.ledger.epoch.recoveries)
        return EpochSegment(epoch, time.perf_counter(), begun=begun)

    def begin_epoch(self, epoch: int, announce: frozenset = frozenset()) -> EpochSegment:
        """Start `epoch` on every member: the first grants (the same pure plan the server
        follows) go with the epoch call; the server call that starts the epoch, sent right
        after, also reports the last epoch's final completions."""
        return self.open_epoch(self.fresh_epoch(epoch, begun=False), announce)

    def open_epoch(self, seg: EpochSegment, announce: frozenset = frozenset()) -> EpochSegment:
        """The segment's streams opened: the segment, begun now."""
        epoch = seg.epoch
        seg = replace(seg, begun=True, t_start=time.perf_counter())
        ranks = self.fleet.group.ranks
        rows, n, seed, _, shuffle = self.phase.lease_plan
        self.phase.pinned = self.phase.spec.leases_pinned(self.phase.strategy, self.phase.batch_shares)
        self.phase.lease_plan = (rows, n, seed, self.phase.pinned, shuffle)  # leasing follows the mode of the phase (and the split)
        place = self.ledger.in_epoch.take_for(epoch)  # a restart from a checkpoint inside this epoch
        if self.phase.spec.coordinated:  # sandblaster: the pass's task sums are in no checkpoint: the whole pass again
            place = None
        resume = {"done": place.done, "skips": place.skips} if place is not None else None
        if place is not None:
            self.ledger.epoch.carried = place.counts
        first = first_grant_messages(*self.phase.lease_plan, epoch, ranks, self.phase.max_grant, resume, self.phase.backups)
        with self.fleet.interrupts.whole():
            for rank in ranks:
                self.open_stream(seg, rank, first_grant=first.get(rank), announce=rank in announce)
            self.fleet.reader.started = self.fleet.server.send("start_epoch", epoch, ranks, self.ledger.unreported,
                                                               self.phase.pinned, resume=resume)
        self.ledger.unreported = {}
        return seg

    def open_stream(self, seg: EpochSegment, rank: int, first_grant: Optional[dict] = None, resume: bool = False,
                    announce: bool = False) -> None:
        actor = self.fleet.group.members[rank]
        self.fleet.reader.open(rank, actor.run_epoch.remote(seg.epoch, self.cfg.tracking.log_every_steps, self.trace_ids,
                                                            first_grant, resume, announce))

    def finish_epochs(self, whole: bool = True) -> ServerStatus:
        """Report the last epoch's final completions; the server's status, which must say the
        epoch was served whole (unless not `whole`: the run stopped inside it at stop.max_steps)."""
        status = self.fleet.server.call("finish", self.ledger.unreported)
        self.ledger.unreported = {}
        if whole and not status.complete:
            raise TrainingError(f"epoch {status.epoch}: {status.remaining} partitions were never served")
        return status

    def halt(self, timeout_s: float) -> None:
        """An interrupted run: the replicas stop at their next partition boundary (the phase
        switch's pause; allreduce replicas all after the same step), so the lowest rank can
        answer for the final checkpoint without finishing its epoch."""
        if self.fleet.server is not None:
            self.fleet.pause.close(timeout_s)  # already closed (a switch, a grow): the replicas pause anyway

    def shutdown(self) -> None:
        """Stop every actor this controller started (replicas, spares, shards, the server) and
        take back any autoscaler request this run made; a checkpoint still being written is
        waited for first (at most DRAIN_S)."""
        self.checkpoints.drain(DRAIN_S)
        self.checkpoints.close()
        self.fleet.elastic.withdraw()
        self.fleet.group.shutdown()
        if self.fleet.shard_group is not None:
            self.fleet.shard_group.shutdown()
        if self.fleet.server is not None:
            self.fleet.server.shutdown()
        self.fleet.server = None

