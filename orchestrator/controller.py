"""The controller: a state machine whose states carry their payloads. Policies decide, the
controller acts, actors hold state and move tensors.

    Starting -> Running(segment) -> ... -> Finishing -> Finished
                   |        ^
                   v        |                  any state -> Errored(error)
              Reconfiguring(plan, segment)

`step()` runs the current state once and returns the next:
- Starting: actors, data into the object store, process group, first epoch's segment;
- Running(segment): reads the replicas' epoch streams (orchestrator/running.py) until the epoch
  ends (-> the epoch's bookkeeping, then Running(next epoch) or Finishing) or a failure needs a
  decision. A failure (a replica died, hung, or its user code raised) is a value: the failure
  policy (policies/failure.py) judges it; Fail -> Errored;
- Reconfiguring(plan, segment): one carrier (orchestrator/reconfigure.py) takes the same steps
  for every kind: pause -> membership -> passes -> ledger -> state -> regroup -> data -> lr ->
  reopen. A repair plan (orchestrator/recovery.py: failed replicas replaced or dropped, their
  partitions back to the pool, state to the newcomers; a shrink when the cluster has no room), a
  switch plan (orchestrator/switching.py: state consolidated, every replica's update rule
  changed in place) or a grow plan (orchestrator/elastic.py: ready replicas join);
  -> Running(same segment): the epoch goes on where it was;
- Finishing: final checkpoint and artifacts.

Who owns what: the replica group (orchestrator/group.py) owns the actors, ranks and
generations; the PartitionServer is the one ledger of what each epoch served; the reporter
(orchestrator/reporting.py) owns MLflow, events and the display; the mode registry
(policies/registry.py) says what differs between modes.
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple, Optional


from orchestrator.config import JobConfig
from orchestrator.data import Dataset
from orchestrator import failures, finishing, reconfigure, recovery, running, starting, switching
from orchestrator.elastic import Elasticity, Grow
from orchestrator.epoch import watch_servers
from orchestrator.errors import Interrupts, MemberLost, TrainingError
from orchestrator.checks import one_line
from orchestrator.group import ReplicaGroup
from orchestrator.progress import ProgressDisplay
from orchestrator.pause import PauseGate
from orchestrator.reporting import Reporter
from orchestrator.run_state import UNSAVED, Checkpointer, PartUnsaved, Position, RunTotals
from orchestrator.states import (TERMINAL, EpochSegment, Errored, Finished, Finishing, Plan, Reconfiguring, Running,
                                  Starting, State, SwitchPlan)
from orchestrator.tracking import Tracker
from policies.failure import FailurePolicy
from policies.leases import MAX_GRANT, first_grant_messages
from policies.registry import mode_spec
from policies.stop import ChanceWatch, StopPolicy
from policies.recipe import planned_steps
from policies.stop import BestWatch
from policies.switching import entering_optimizer, make_switch_policy
from policies.tasks import split_metric, sum_stats

SHARD_STATE_TIMEOUT_S = 10.0  # the shards' optimizer states for a checkpoint
CHECKPOINT_FLUSH_S = 10.0  # the MLflow writes asked for before a checkpoint, stored before it is written


class Written(NamedTuple):
    """A checkpoint written: where, and the members found lost while taking it."""
    path: str
    lost: list[MemberLost]


class Controller:
    def __init__(self, config: JobConfig, dataset: Dataset, tracker: Optional[Tracker], t0: float,
                 display: Optional[ProgressDisplay] = None, trace_ids: bool = False,
                 resume: Optional[dict[str, Any]] = None, interrupts: Optional[Interrupts] = None) -> None:
        """`resume`: a checkpoint's state to go on from (orchestrator/resume.py): the run starts
        at the epoch after the one it was taken at, in the phase it was in. `interrupts`: the
        run's interrupt state (the trainer routes the process's signals to it)."""
        self.cfg = config
        self.interrupts = interrupts or Interrupts()
        self.dataset = dataset
        self.t0 = t0
        self.trace_ids = trace_ids
        self.task = config.task.build()  # the loss and the metrics (policies/tasks.py)
        self.target = config.target()
        self.metric = config.headline_metric()  # what progress lines, switch events and phases report
        self.switch_policy = make_switch_policy(config.strategy, config.metric_goals())
        self.resume = resume
        if resume is not None:
            # now, for the phase this start runs in; starting.restore loads every part again, this one included
            self.switch_policy.restore(resume["run"]["policy"])
        self.set_strategy(self.switch_policy.plan[self.switch_policy.current])
        self.pending_switch = None  # a SwitchPlan decided, not carried out yet (orchestrator/switching.py)
        self.guard = None  # the last switch on probation (switching.check_guard)
        self.switching_off = False  # a switch was rolled back: no further switch this run
        self.stopping = False  # the stop policy said stop while a rollback was pending: finish once it is done
        classes = getattr(dataset, "num_classes", 0) or 0
        self.chance = ChanceWatch(classes) if getattr(self.task, "name", "") == "classification" and classes > 1 else None
        self.pause = PauseGate(lambda: self.server)  # why the replicas are held at partition boundaries
        modes = config.strategy.modes()
        sharded = [m for m in modes if mode_spec(m).sharded]
        self.needs_shards = bool(sharded)  # any phase keeps its reference in shards
        server = (mode_spec("downpour" if "downpour" in sharded else sharded[0]).server_optimizer(config.optimizer.name)
                  if sharded else None)
        # what the shards apply: a name, or with optimizer.kwargs {name, kwargs} (policies/sharding.py ShardState)
        self.server_optimizer = ({"name": server, "kwargs": dict(config.optimizer.kwargs)}
                                 if server == config.optimizer.name and config.optimizer.kwargs else server)
        self.phases: list[dict[str, Any]] = []  # the result JSON's record of which mode ran when
        self.signals: dict[int, dict[str, Any]] = {}  # rank -> its latest progress row (the switch policy's input)
        self.batch_shares: Optional[list[int]] = None  # strategy.balance: the split last reported (rows or periods)
        self.report = Reporter(tracker, display, t0)
        self.elastic = Elasticity(self)  # growing and shrinking with the cluster (orchestrator/elastic.py)
        self.state: State = Starting()
        self.group = ReplicaGroup(config, strategy=self.strategy, interrupts=self.interrupts)
        # optimizer.schedule's clock: the optimizer steps the run plans (policies/recipe.py planned_steps)
        self.group.raw["schedule_steps"] = planned_steps(dataset.train_rows, config.data.batch_size,
                                                         config.data.accumulate, config.scaling.replicas,
                                                         config.stop.epochs)
        self.shard_group = None
        self.group.on_wait = self._watch  # a replica waited on may be waiting for a shard or server rebuild
        self.totals = RunTotals()
        self.consumed: list[dict[int, list[list[int]]]] = []  # [epoch] {rank: [step] -> row ids} (trace_ids)
        self.redone: list[dict[str, Any]] = []  # partitions served again after a replica died
        self.server = None
        self.data = None  # where the data lives (orchestrator/placement.py): in-memory refs kept alive here
        self.progress: dict[int, int] = {}  # rank -> the last step it reported (progress rows)
        s, ft = config.stop, config.fault_tolerance
        self.stop_policy = StopPolicy(s.epochs, self.target, s.at_target, s.max_wall_s)
        early = s.early_stopping
        self.best = BestWatch(self.metric, config.metric_goals()[self.metric], early.min_delta if early else 0.0,
                              early.patience if early else None)  # checkpoint.keep_best, stop.early_stopping
        self.best_model: Optional[dict[str, Any]] = None  # keep_best: the best epoch's model (state dict)
        self.failure_policy = FailurePolicy(ft.max_replica_restarts, ft.restart_backoff_s, config.scaling.min_replicas)
        self.steps_per_epoch = 0
        self.train_started = 0.0  # perf_counter when training began (after start-up)
        self.t_train_wall = 0.0  # the same, wall clock (the replicas' throughput figures count from it)
        self.lease_plan: tuple = ()  # (rows, replicas, seed, pinned, shuffle): the grants' pure plan (policies/leases.py)
        self.max_grant = MAX_GRANT
        self.unreported: dict[int, list[int]] = {}  # last epoch's final completions, not yet reported
        self.checkpoints = Checkpointer(config.checkpoint.storage, config.checkpoint.keep, config.run.name)
        self.position = self._position()

    def _position(self) -> Position:
        """The run's position a checkpoint holds: each part with its owner's save and load
        (orchestrator/run_state.py)."""
        from dataclasses import asdict

        pos = Position()

        def load_totals(saved: dict[str, Any]) -> None:
            for key, value in saved.items():
                if key != "startup_s":  # this start's own
                    setattr(self.totals, key, value)

        def load_phases(saved: list) -> None:
            self.phases = saved

        def load_train_clock(seconds: float) -> None:
            self.train_started = time.perf_counter() - seconds

        def load_wall_clock(seconds: float) -> None:
            self.t0 = time.perf_counter() - seconds  # time_to_target_s goes on counting from the first start

        def save_shards() -> Optional[list]:
            if self.shard_group is None:
                return None
            try:
                return self.shard_group.optimizer_states(min(self.cfg.strategy.timeout_s, SHARD_STATE_TIMEOUT_S))
            except Exception as exc:  # a shard down (rebuilt at the next poll): this checkpoint goes without
                raise PartUnsaved(f"the shards' optimizer states: {type(exc).__name__}: {one_line(exc)[:200]}") from None

        def load_shards(saved: Optional[list]) -> None:
            if saved is not None and self.shard_group is not None:
                self.shard_group.load_optimizer_states(saved, self.cfg.strategy.timeout_s)

        pos.register("totals", lambda: {k: v for k, v in asdict(self.totals).items()
                                        if k not in ("checkpoint", "stop_reason")}, load_totals)
        pos.register("policy", self.switch_policy.position, self.switch_policy.restore)
        pos.register("failure", self.failure_policy.position, self.failure_policy.restore)
        pos.register("phases", lambda: [dict(p) for p in self.phases], load_phases)
        pos.register("train_elapsed_s", lambda: time.perf_counter() - self.train_started, load_train_clock)
        pos.register("wall_elapsed_s", lambda: time.perf_counter() - self.t0, load_wall_clock)
        pos.register("lr_schedule", self.elastic.lr.position, self.elastic.restore_lr)
        pos.register("shards", save_shards, load_shards)
        pos.register("best", self.best.position, self.best.restore)
        pos.register("switching_off", lambda: self.switching_off, lambda off: setattr(self, "switching_off", off))
        return pos

    @property
    def last_state(self) -> Optional[dict[str, Any]]:
        """The newest checkpoint's state (a repair that lost every allreduce replica loads it)."""
        return self.checkpoints.last_state

    def set_strategy(self, strategy: dict[str, Any]) -> None:
        """The phase that runs now: its strategy, its mode's registry entry, lock-step or not."""
        self.strategy = strategy
        self.spec = mode_spec(strategy["mode"])
        self.lock_step = self.spec.lock_step(strategy)
        self.batch_shares = None  # a phase's balanced work starts even
        self.pinned = self.spec.leases_pinned(strategy)

    def shard_optimizer(self, strategy: dict[str, Any]) -> tuple[str, float, float, float]:
        """What the shards apply in this phase: (name, lr, momentum, weight_decay), the phase's
        optimizer overrides over optimizer.*, translated for the mode it enters
        (policies/switching.py: entering_optimizer)."""
        return (self.server_optimizer, *self.phase_optimizer(strategy)[0])

    def phase_optimizer(self, strategy: dict[str, Any]) -> tuple[tuple[float, float, float], Optional[str]]:
        """(lr, momentum, weight_decay) of a phase's shards and what was translated (or None)."""
        replicas = len(self.group.members) or self.cfg.scaling.replicas
        opt, note = entering_optimizer(strategy["mode"], self.cfg.optimizer.model_dump(), strategy.get("optimizer"),
                                       replicas, len(self.switch_policy.plan) > 1)
        return (opt["lr"], opt["momentum"], opt["weight_decay"]), note

    def record_phase(self, sw: Any, step: int, before: float, after: float) -> None:
        """Close the running phase's record and open the next one's (`before`, `after`: the
        headline metric, e.g. test_accuracy, around the switch)."""
        now = round(time.perf_counter() - self.train_started, 3)
        if self.phases:
            self.phases[-1].update(end_step=step, end_s=now, ended_by=sw.rule, **{f"{self.metric}_at_end": round(before, 4)})
        self.phases.append({"phase": sw.phase, "mode": sw.mode, "start_step": step, "start_s": now,
                            "start_epoch": self.totals.epochs + 1, f"{self.metric}_at_start": round(after, 4)})

    def headline_value(self, metrics: dict[str, float]) -> float:
        """The headline metric's value in `metrics` (train_loss from the totals)."""
        return {**metrics, "train_loss": self.totals.train_loss}.get(self.metric, float("nan"))

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
        return self.group.handles()

    @property
    def shards(self) -> list[Any]:
        return list(self.shard_group.handles) if self.shard_group is not None else []

    # ---- the state machine ---------------------------------------------------------------
    def step(self) -> State:
        """Run the current state once; the next state."""
        state = self.state
        try:
            if isinstance(state, Starting):
                nxt = Running(self._start())
            elif isinstance(state, Running):
                try:
                    nxt = running.run_segment(self, state.segment)
                except MemberLost as lost:
                    nxt = failures.lost_meanwhile(self, state.segment, lost)
            elif isinstance(state, Reconfiguring):
                nxt = self._reconfigure(state.plan, state.segment)
            elif isinstance(state, Finishing):
                finishing.finish(self)
                nxt = Finished()
            else:
                return state
        except BaseException as exc:
            self.state = Errored(exc)
            self.report.state(state, self.state)
            raise
        self.state = nxt
        self.report.state(state, nxt)
        if isinstance(nxt, Errored):
            raise nxt.error
        return nxt

    def _reconfigure(self, plan: Any, seg: EpochSegment) -> State:
        """Reconfiguring: the plan as the one carrier's steps (orchestrator/reconfigure.py). A
        replica lost meanwhile is a failure of the segment: a repair folds it into its plan
        (`recovery.reconfigure`); a switch is carried out after that repair; a grow's newcomers
        are members by then and the repair sees to the lost one."""
        if isinstance(plan, Plan):
            return Running(recovery.reconfigure(self, plan, seg))
        change = switching.Switching(plan) if isinstance(plan, SwitchPlan) else Grow(plan, self.elastic)
        try:
            return Running(reconfigure.carry_out(self, change, seg))
        except MemberLost as lost:
            if isinstance(plan, SwitchPlan):
                self.pending_switch = plan
            return failures.lost_meanwhile(self, seg, lost)

    def run(self) -> RunTotals:
        while not isinstance(self.step(), TERMINAL):
            pass
        return self.totals

    def run_epoch(self) -> State:
        """Step until one more epoch is done (or the run ends): the tests' and tools' unit."""
        target = self.totals.epochs + 1
        while not isinstance(self.step(), TERMINAL) and self.totals.epochs < target:
            pass
        return self.state

    # ---- Starting: data into the object store, actors, process group -----------------------
    def launch(self) -> None:
        """Ask Ray for the actors the mode needs and return at once: their worker processes boot
        (import torch, build the model) while the caller does other start-up work."""
        if self.needs_shards:
            starting.launch_shards(self)
            self.group.shards = self.shard_group.directory()
        self.group.launch()

    def _start(self) -> EpochSegment:
        """Starting (orchestrator/starting.py): data placed, the partition server, the process
        group, the replicas' data; a resumed run's state; the first epoch's segment."""
        return starting.start(self)

    def give_data(self, ranks: list[int]) -> None:
        """The partition server, the train partitions (refs, or a file source's plan) and each
        replica's share of the test split (shares follow the members' positions in rank order)."""
        members, split = self.group.ranks, self.cfg.eval_split
        where = {r: self.data.test_share(i, len(members), split) for i, r in enumerate(members)}
        self.group.call(ranks, "set_data", what="data",
                        per_rank=lambda r: (self.server.address(), [self.data.train], *where[r], self.t_train_wall))

    def reslice_tests(self, split: Optional[str] = None) -> None:
        """Each member's share of the evaluated split (default: the run's; "test" for the final
        evaluation of a run with a validation split)."""
        members, split = self.group.ranks, split or self.cfg.eval_split
        where = {r: self.data.test_share(i, len(members), split) for i, r in enumerate(members)}
        self.group.call(members, "set_test_slice", what="test slices", per_rank=lambda r: where[r])

    # ---- Running: an epoch's streams -------------------------------------------------------
    def begin_epoch(self, epoch: int, announce: frozenset = frozenset()) -> EpochSegment:
        """Start `epoch` on every member: the first grants (the same pure plan the server
        follows) go with the epoch call; the server call that starts the epoch, sent right
        after, also reports the last epoch's final completions."""
        return self.open_epoch(EpochSegment(epoch, time.perf_counter()), announce)

    def open_epoch(self, seg: EpochSegment, announce: frozenset = frozenset()) -> EpochSegment:
        epoch = seg.epoch
        seg.begun, seg.t_start = True, time.perf_counter()
        ranks = self.group.ranks
        rows, n, seed, _, shuffle = self.lease_plan
        self.pinned = self.spec.leases_pinned(self.strategy, self.batch_shares)
        self.lease_plan = (rows, n, seed, self.pinned, shuffle)  # leasing follows the mode of the phase (and the split)
        first = first_grant_messages(*self.lease_plan, epoch, ranks, self.max_grant)
        with self.interrupts.whole():
            for rank in ranks:
                self.open_stream(seg, rank, first_grant=first.get(rank), announce=rank in announce)
            seg.started = self.server.send("start_epoch", epoch, ranks, self.unreported, self.pinned)
        self.unreported = {}
        return seg

    def open_stream(self, seg: EpochSegment, rank: int, first_grant: Optional[dict] = None, resume: bool = False,
                    announce: bool = False) -> None:
        actor = self.group.members[rank]
        seg.streams[rank] = actor.run_epoch.remote(seg.epoch, self.cfg.tracking.log_every_steps, self.trace_ids,
                                                   first_grant, resume, announce)
        seg.heard[rank] = time.perf_counter()

    def finish_epochs(self) -> dict[str, Any]:
        """Report the last epoch's final completions; the server's status, which must say the
        epoch was served whole."""
        status = self.server.call("finish", self.unreported)
        self.unreported = {}
        if not status["complete"]:
            raise TrainingError(f"epoch {status['epoch']}: {status['remaining']} partitions were never served")
        return status

    def checkpoint(self, tag: str, timeout_s: float, named: Optional[str] = None) -> "Written":
        """The lowest answering rank's model and optimizer state (all replicas hold the same
        parameters at an epoch's end, or the mode's reference) plus the run's position, written by the Checkpointer
        (orchestrator/run_state.py). The final one says the run finished (a named run is not
        started again from it). Returns the named copy's path if there is one, else the store's, and
        the members found lost on the way (MemberLost each: the caller hands them to the failure
        policy, never drops them)."""
        t = time.perf_counter()
        ranks = self.group.ranks
        if not ranks:
            raise TrainingError(f"checkpoint {tag}: no replica left to take the model from")
        lost = []
        for i, rank in enumerate(ranks):  # a member that does not answer (hung, dying): the next one's copy
            try:
                state = self.group.call([rank], "state", what=f"checkpoint {tag}", timeout_s=timeout_s)[0]
                break
            except MemberLost as exc:
                if i == len(ranks) - 1:
                    raise
                lost.append(exc)  # the caller hands it to the failure policy
                self.report.say(f"checkpoint {tag}: {exc}; taking replica {ranks[i + 1]}'s copy")
        if not self.tracker.flush(CHECKPOINT_FLUSH_S):  # a run resumed from it finds every metric it covers
            self.report.say(f"checkpoint {tag}: MLflow has not stored the run's metrics within {CHECKPOINT_FLUSH_S:g}s; "
                            "the checkpoint is written anyway and they follow in the background")
        run = self.position.save()
        unsaved = Position.unsaved(run)
        state.update(epoch=self.totals.epochs, mlflow_run_id=self.tracker.run_id,
                     config=self.cfg.model_dump(mode="json"), run=run, finished=tag == "final")
        path, stored = self.checkpoints.write(state, tag, self.totals.steps, self.totals.epochs, self.tracker.run_id,
                                              named)
        self.report.event("checkpoint", path=path, epoch=self.totals.epochs, step=self.totals.steps,
                          seconds=round(self.checkpoints.last_s - t, 4), **({"stored": stored} if named else {}),
                          **({UNSAVED: unsaved} if unsaved else {}))
        for name, why in unsaved.items():
            self.report.say(f"checkpoint {tag} written without its {name} part: {why}")
        return Written(path, lost)

    def _watch(self) -> bool:
        """While the driver waits on replicas (a repair, a switch, an evaluation): a dead shard
        or partition server is still noticed and rebuilt, so a replica waiting for one is not
        left waiting. True when one was rebuilt or a shard is being rebuilt (a replica that
        waited on it was not hung meanwhile)."""
        return watch_servers(self, self.totals.epochs + 1)

    def halt(self, timeout_s: float) -> None:
        """An interrupted run: the replicas stop at their next partition boundary (the phase
        switch's pause; allreduce replicas all after the same step), so the lowest rank can
        answer for the final checkpoint without finishing its epoch."""
        if self.server is not None:
            self.pause.close("halt", timeout_s)  # already closed (a switch, a grow): the replicas pause anyway

    def shutdown(self) -> None:
        """Stop every actor this controller started (replicas, spares, shards, the server) and
        take back any autoscaler request this run made."""
        self.elastic.withdraw()
        self.group.shutdown()
        if self.shard_group is not None:
            self.shard_group.shutdown()
        if self.server is not None:
            self.server.shutdown()
        self.server = None

