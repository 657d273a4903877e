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
- Reconfiguring(plan, segment): carries the decisions out (orchestrator/recovery.py): failed
  replicas replaced (a spare or a new actor) or dropped, their partitions back to the pool,
  state handed to the newcomers, the process group re-formed; or a phase switch the switch
  policy decided (orchestrator/switching.py): state consolidated, every replica's update rule
  changed in place; -> Running(same segment): the epoch goes on where it was;
- Finishing: final checkpoint and artifacts.

Who owns what: the replica group (orchestrator/group.py) owns the actors, ranks and
generations; the PartitionServer is the one ledger of what each epoch served; the reporter
(orchestrator/reporting.py) owns MLflow, events and the display; the mode registry
(policies/registry.py) says what differs between modes.
"""
from __future__ import annotations

import os
import tempfile
import time
import uuid
from typing import Any, Optional

import ray

from orchestrator.cluster import beside_driver
from orchestrator.config import JobConfig
from orchestrator.data import Dataset
from orchestrator import recovery, running, switching
from orchestrator.elastic import Elasticity
from orchestrator.epoch import report_shard_events, watch_servers
from orchestrator.errors import MemberLost, TrainingError, issued_whole
from orchestrator.group import ReplicaGroup
from orchestrator.placement import place_data
from orchestrator.progress import ProgressDisplay
from orchestrator.pause import PauseGate
from orchestrator.reporting import Reporter
from orchestrator.run_state import Checkpointer, Position, RunTotals
from orchestrator.states import (TERMINAL, EpochSegment, Errored, Finished, Finishing, Reconfiguring, Running,
                                  Starting, State, SwitchPlan)
from orchestrator.tracking import Tracker
from policies.checkpointing import due as checkpoint_due
from policies.failure import FailurePolicy
from policies.leases import MAX_GRANT, first_grant_messages
from policies.registry import mode_spec
from policies.stop import EpochSnapshot, StopPolicy
from policies.switching import make_switch_policy
from policies.tasks import sum_stats

SHARD_STATE_TIMEOUT_S = 10.0  # the shards' optimizer states for a checkpoint


class Controller:
    def __init__(self, config: JobConfig, dataset: Dataset, tracker: Optional[Tracker], t0: float,
                 display: Optional[ProgressDisplay] = None, trace_ids: bool = False,
                 resume: Optional[dict[str, Any]] = None) -> None:
        """`resume`: a checkpoint's state to go on from (orchestrator/resume.py): the run starts
        at the epoch after the one it was taken at, in the phase it was in."""
        self.cfg = config
        self.dataset = dataset
        self.t0 = t0
        self.trace_ids = trace_ids
        self.task = config.task.build()  # the loss and the metrics (policies/tasks.py)
        self.target = config.stop.the_target()
        self.metric = config.headline_metric()  # what progress lines, switch events and phases report
        self.switch_policy = make_switch_policy(config.strategy, config.metric_goals())
        self.resume = resume
        if resume is not None:
            # now, for the phase this start runs in; _restore loads every part again, this one included
            self.switch_policy.restore(resume["run"]["policy"])
        self.set_strategy(self.switch_policy.plan[self.switch_policy.current])
        self.pending_switch = None  # a SwitchPlan decided, not carried out yet (orchestrator/switching.py)
        self.pause = PauseGate(lambda: self.server)  # why the replicas are held at partition boundaries
        modes = config.strategy.modes()
        sharded = [m for m in modes if mode_spec(m).sharded]
        self.needs_shards = bool(sharded)  # any phase keeps its reference in shards
        self.server_optimizer = (mode_spec("downpour" if "downpour" in sharded else sharded[0]).server_optimizer(
            config.optimizer.name) if sharded else None)
        self.phases: list[dict[str, Any]] = []  # the result JSON's record of which mode ran when
        self.signals: dict[int, dict[str, Any]] = {}  # rank -> its latest progress row (the switch policy's input)
        self.report = Reporter(tracker, display, t0)
        self.elastic = Elasticity(self)  # growing and shrinking with the cluster (orchestrator/elastic.py)
        self.state: State = Starting()
        self.group = ReplicaGroup(config, strategy=self.strategy)
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
        self.failure_policy = FailurePolicy(ft.max_replica_restarts, ft.restart_backoff_s, config.scaling.min_replicas)
        self.steps_per_epoch = 0
        self._train_started = 0.0
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
            self._train_started = time.perf_counter() - seconds

        def load_wall_clock(seconds: float) -> None:
            self.t0 = time.perf_counter() - seconds  # time_to_target_s goes on counting from the first start

        def save_shards() -> Optional[list]:
            if self.shard_group is None:
                return None
            try:
                return self.shard_group.optimizer_states(min(self.cfg.strategy.timeout_s, SHARD_STATE_TIMEOUT_S))
            except Exception:  # a shard down (rebuilt at the next poll): a resume starts its optimizer afresh
                return None

        def load_shards(saved: Optional[list]) -> None:
            if saved is not None and self.shard_group is not None:
                self.shard_group.load_optimizer_states(saved, self.cfg.strategy.timeout_s)

        pos.register("totals", lambda: {k: v for k, v in asdict(self.totals).items()
                                        if k not in ("checkpoint", "stop_reason")}, load_totals)
        pos.register("policy", self.switch_policy.position, self.switch_policy.restore)
        pos.register("failure", self.failure_policy.position, self.failure_policy.restore)
        pos.register("phases", lambda: [dict(p) for p in self.phases], load_phases)
        pos.register("train_elapsed_s", lambda: time.perf_counter() - self._train_started, load_train_clock)
        pos.register("wall_elapsed_s", lambda: time.perf_counter() - self.t0, load_wall_clock)
        pos.register("lr_schedule", self.elastic.lr.position, self.elastic.restore_lr)
        pos.register("shards", save_shards, load_shards)
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

    def shard_optimizer(self, strategy: dict[str, Any]) -> tuple[str, float, float, float]:
        """What the shards apply in this phase: (name, lr, momentum, weight_decay), the phase's
        optimizer overrides over optimizer.*."""
        opt = {**self.cfg.optimizer.model_dump(), **(strategy.get("optimizer") or {})}
        return self.server_optimizer, opt["lr"], opt["momentum"], opt["weight_decay"]

    @property
    def train_started(self) -> float:
        return self._train_started

    def record_phase(self, sw: Any, step: int, before: float, after: float) -> None:
        """Close the running phase's record and open the next one's (`before`, `after`: the
        headline metric, e.g. test_accuracy, around the switch)."""
        now = round(time.perf_counter() - self._train_started, 3)
        if self.phases:
            self.phases[-1].update(end_step=step, end_s=now, ended_by=sw.rule, **{f"{self.metric}_at_end": round(before, 4)})
        self.phases.append({"phase": sw.phase, "mode": sw.mode, "start_step": step, "start_s": now,
                            "start_epoch": self.totals.epochs + 1, f"{self.metric}_at_start": round(after, 4)})

    def headline_value(self, metrics: dict[str, float]) -> float:
        """The headline metric's value in `metrics` (train_loss from the totals)."""
        return {**metrics, "train_loss": self.totals.train_loss}.get(self.metric, float("nan"))

    def finish_evaluation(self, evals: list[dict[str, Any]]) -> dict[str, float]:
        """The task's metrics from every replica's evaluation sums (added, then finished once:
        the same figures one process evaluating the whole test split gets)."""
        return {k: float(v) for k, v in self.task.finish(sum_stats(evals)).items()}

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
                    nxt = running.lost_meanwhile(self, state.segment, lost)
            elif isinstance(state, Reconfiguring) and isinstance(state.plan, SwitchPlan):
                try:
                    nxt = Running(switching.carry_out(self, state.plan, state.segment))
                except MemberLost as lost:  # repaired first; the switch is carried out after
                    self.pending_switch = state.plan
                    nxt = running.lost_meanwhile(self, state.segment, lost)
            elif isinstance(state, Reconfiguring):
                nxt = Running(recovery.reconfigure(self, state.plan, state.segment))
            elif isinstance(state, Finishing):
                self._finish()
                nxt = Finished()
            else:
                return state
        except BaseException as exc:
            self.state = Errored(exc)
            raise
        self.state = nxt
        if isinstance(nxt, Errored):
            raise nxt.error
        return nxt

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
            self._launch_shards()
            self.group.shards = self.shard_group.directory()
        self.group.launch()

    def _launch_shards(self) -> None:
        """ParameterShards holding the initial parameters (the same factory and seed as every
        replica), cut into balanced slices of the flat vector, snapshotted for rebuilds."""
        import torch

        from orchestrator.shard_group import ShardGroup
        from orchestrator.factory import build_model
        from policies.sharding import shard_bounds

        cfg = self.cfg
        model = build_model(cfg.model.factory, cfg.model.kwargs, cfg.data.seed)
        initial = torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad]).numpy()
        bounds = shard_bounds(initial.size, cfg.scaling.shards)
        first_sharded = next(p for p in self.switch_policy.plan if mode_spec(p["mode"]).sharded)
        name, lr, momentum, weight_decay = self.shard_optimizer(first_sharded)
        self.shard_group = ShardGroup.create(initial, bounds, name, lr, momentum, weight_decay, cfg.scaling.replicas,
                                             cfg.fault_tolerance.shard_snapshot_every_s,
                                             name_prefix=f"eo-{uuid.uuid4().hex[:12]}", placement=beside_driver(),
                                             hang_s=cfg.fault_tolerance.hang_timeout_s / 2)

    def _start(self) -> EpochSegment:
        from orchestrator.server_link import ServerLink

        if not self.group.members:
            self.launch()
        cfg, n = self.cfg, self.cfg.scaling.replicas
        # in-memory data: partitions put once; a file source: only its plan (orchestrator/placement.py)
        self.data = place_data(self.dataset, cfg.data.partitions or 4 * n, cfg.data.seed)
        rows = self.data.rows
        bs = cfg.data.batch_size
        self.steps_per_epoch = -(-sum(-(-r // bs) for r in rows) // n)  # the display's estimate
        self._plan = (rows, n, cfg.data.seed, self.spec.pinned, cfg.data.shuffle)
        # a run that can switch modes is granted one partition at a time: every partition boundary
        # is a point where a replica can hear a pause (two at a time saves calls otherwise)
        self.max_grant = 1 if len(self.switch_policy.plan) > 1 else MAX_GRANT
        self.server = ServerLink(*self._plan, self.max_grant, placement=beside_driver(),
                                 hang_s=cfg.fault_tolerance.hang_timeout_s / 2, timeout_s=cfg.strategy.timeout_s)
        self.group.wait_ready()
        self.group.form()
        self.group.warm_spares(self.data.sample)
        self._t_train_wall = time.time()
        self.give_data(self.group.ranks)
        self.totals.startup_s = time.perf_counter() - self.t0
        self._train_started = time.perf_counter()
        self.phases = [{"phase": self.switch_policy.current, "mode": self.spec.name, "start_step": 0, "start_s": 0.0,
                        "start_epoch": 1}]
        if self.resume is not None:
            self._restore(self.resume)
        self.report.event("started", metric=self.metric, task=cfg.task.name, replicas=n, spares=cfg.fault_tolerance.spares,
                          steps_per_epoch=self.steps_per_epoch, partitions=len(rows),
                          rows_per_partition=[min(rows), max(rows)], startup_s=round(self.totals.startup_s, 3))
        self.report.say(f"started {n} replicas ({len(rows)} partitions, ~{self.steps_per_epoch} steps/epoch per "
                        f"replica) in {self.totals.startup_s:.1f}s")
        at = self.totals.steps
        self.report.metrics([("replicas_alive", n, at), ("replica_restarts", self.totals.replica_restarts, at),
                             ("mode", switching.MODE_CODES[self.spec.name], at)])
        return self.begin_epoch(self.totals.epochs + 1)

    def _restore(self, state: dict[str, Any]) -> None:
        """Go on from a checkpoint: every replica loads its model, optimizer state and step; the
        shards (if any) take its parameters; then each part of the run's position goes back to
        its owner (orchestrator/run_state.py)."""
        ranks, step = self.group.ranks, state["step"]
        payload = ray.put({"model": state["model"], "optimizer": state["optimizer"], "step": step})
        self.group.call(ranks, "load_state", payload, what="state from the checkpoint")
        if self.shard_group is not None:
            values = self.group.call([ranks[0]], "flat_parameters", what="parameters")[0]
            self.shard_group.reseed(values, self.shard_optimizer(self.strategy), {r: step for r in ranks},
                                    timeout_s=self.cfg.strategy.timeout_s)
            if self.spec.sharded:
                self.group.call(ranks, "sync_from_shards", step, what="state from the shards")
        self.progress = {r: step for r in ranks}
        missing = self.position.load(state["run"])
        if "failure" in missing:  # a checkpoint from before the budget was kept: the count
            self.failure_policy.restore({"restarts": self.totals.replica_restarts, "in_a_row": 0})
        self.report.event("resumed", epoch=self.totals.epochs, step=self.totals.steps, replica_step=step,
                          phase=self.switch_policy.current, mode=self.spec.name,
                          **({"parts_missing": missing} if missing else {}))
        self.report.say(f"resumed after epoch {self.totals.epochs} (step {self.totals.steps}) in {self.spec.name}")

    def give_data(self, ranks: list[int]) -> None:
        """The partition server, the train partitions (refs, or a file source's plan) and each
        replica's share of the test split (shares follow the members' positions in rank order)."""
        members = self.group.ranks
        where = {r: self.data.test_share(i, len(members)) for i, r in enumerate(members)}
        self.group.call(ranks, "set_data", what="data",
                        per_rank=lambda r: (self.server.address(), [self.data.train], *where[r], self._t_train_wall))

    def reslice_tests(self) -> None:
        members = self.group.ranks
        where = {r: self.data.test_share(i, len(members)) for i, r in enumerate(members)}
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
        rows, n, seed, _, shuffle = self._plan
        self._plan = (rows, n, seed, self.spec.pinned, shuffle)  # leasing follows the mode of the phase
        first = first_grant_messages(*self._plan, epoch, ranks, self.max_grant)
        with issued_whole():
            for rank in ranks:
                self.open_stream(seg, rank, first_grant=first.get(rank), announce=rank in announce)
            seg.started = self.server.send("start_epoch", epoch, ranks, self.unreported, self.spec.pinned)
        self.unreported = {}
        return seg

    def open_stream(self, seg: EpochSegment, rank: int, first_grant: Optional[dict] = None, resume: bool = False,
                    announce: bool = False) -> None:
        actor = self.group.members[rank]
        seg.streams[rank] = actor.run_epoch.remote(seg.epoch, self.cfg.tracking.log_every_steps, self.trace_ids,
                                                   first_grant, resume, announce)
        seg.heard[rank] = time.perf_counter()

    def end_epoch(self, seg: EpochSegment) -> State:
        """The epoch's bookkeeping: evaluation, totals, metrics, events, checkpoint, the stop
        decision. Running(next epoch) or Finishing."""
        cfg, tot = self.cfg, self.totals
        epoch = seg.epoch
        stats = seg.merged()
        finals = [s for s in stats if s["eval"] is not None or s["mode"] is not None]
        if self.spec.sharded:  # evaluate the reference (server copy / center) once all are done
            evals = self.group.call(self.group.ranks, "evaluate_reference", what="evaluation",
                                    timeout_s=cfg.strategy.timeout_s)
        else:
            evals = [s["eval"] for s in finals]
        metrics = self.finish_evaluation(evals)

        tot.epochs = epoch
        tot.steps += max(s["steps"] for s in stats)
        tot.samples += sum(s["samples"] for s in stats)
        tot.rows_per_epoch.append(sum(s["samples"] for s in stats))
        tot.train_s += max(s["train_s"] for s in stats)
        tot.comm_s += max(s["comm_s"] for s in stats)
        tot.train_loss = finals[0]["loss"] if finals else stats[0]["loss"]
        tot.metrics = metrics
        judged = {**metrics, "train_loss": tot.train_loss}
        if self.trace_ids:
            self.consumed.append(seg.consumed())
        elapsed = time.perf_counter() - self.t0
        target = self.target
        if target is not None and tot.time_to_target_s is None and target.reached(judged):
            tot.time_to_target_s = elapsed
            self.report.event("target_reached", epoch=epoch, metric=target.metric, value=judged[target.metric],
                              target=target.value, goal=target.goal, **{target.metric: judged[target.metric]})

        rows_out = [(key, p[name], p["step"]) for p in seg.progress
                    for key, name in (("train_loss", "loss"), ("samples_per_s", "samples_per_s"), ("lr", "lr"))
                    if p.get(name) is not None]
        rows_out += [(k, v, tot.steps) for k, v in metrics.items()]
        rows_out += [("epoch", epoch, tot.steps),
                     ("comm_share", tot.comm_s / max(tot.train_s, 1e-9), tot.steps)]
        mine = [s for s in finals if s["mode"] is not None and s.get("mode_name") == self.spec.name]
        extra = self.spec.metrics(mine) if mine else {}  # a rank that ended the epoch before a switch: not its figures
        if self.shard_group is not None:
            extra.update(self.spec.shard_metrics(self.shard_group))
        rows_out += [(k, v, tot.steps) for k, v in extra.items()]
        rows_out += [("epoch_rows", tot.rows_per_epoch[-1], tot.steps),
                     ("replicas_alive", len(self.group.members), tot.steps),
                     ("replica_restarts", tot.replica_restarts, tot.steps)]
        self.report.metrics(rows_out)
        tot.epoch_wall_s += time.perf_counter() - seg.t_start
        self.report.event("epoch_end", epoch=epoch, step=tot.steps, **{k: round(v, 6) for k, v in metrics.items()},
                          train_loss=round(tot.train_loss, 4),
                          train_s_by_rank=[round(s["train_s"], 3) for s in stats],
                          steps_by_rank=[s["steps"] for s in stats], rows=tot.rows_per_epoch[-1],
                          replicas=len(self.group.members), **{k: round(v, 4) for k, v in extra.items()})
        shown = "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items(), key=lambda kv: kv[0] != self.metric))
        self.report.say(f"epoch {epoch}: {shown}  train_loss {tot.train_loss:.4f}  ({elapsed:.1f}s)")
        if not seg.had_failure:
            self.failure_policy.epoch_without_failure()

        ck = cfg.checkpoint
        if checkpoint_due(epoch, time.perf_counter(), max(self.checkpoints.last_s, self._train_started),
                          ck.every_epochs, ck.every_s):
            try:
                tot.checkpoint = self.checkpoint(f"epoch_{epoch:04d}", cfg.strategy.timeout_s)
            except TrainingError as exc:  # a replica stopped or died meanwhile: the next epoch sees to it
                self.report.event("checkpoint_failed", epoch=epoch, reason=str(exc))
                self.report.say(f"checkpoint after epoch {epoch} not written ({exc}); the previous one is kept")
        decision = self.stop_policy.decide(EpochSnapshot(epoch, judged, time.perf_counter() - self._train_started))
        if decision.stop:
            tot.stop_reason = decision.reason
            self.report.event("stop", reason=decision.reason)
            return Finishing()
        switching.consider(self, None, epoch_end=True,
                           metrics=judged)
        # the next epoch starts when Running next runs (a caller between steps sees this one's ledger);
        # it carries on timing a recovery whose newcomer had nothing left to do in this one
        return Running(EpochSegment(epoch + 1, time.perf_counter(), recoveries=seg.recoveries, begun=False))

    def finish_epochs(self) -> dict[str, Any]:
        """Report the last epoch's final completions; the server's status, which must say the
        epoch was served whole."""
        status = self.server.call("finish", self.unreported)
        self.unreported = {}
        if not status["complete"]:
            raise TrainingError(f"epoch {status['epoch']}: {status['remaining']} partitions were never served")
        return status

    # ---- Finishing: final checkpoint and artifacts -----------------------------------------
    def _finish(self) -> None:
        if self.phases:
            self.phases[-1].update(end_step=max(self.progress.values(), default=0),
                                   end_s=round(time.perf_counter() - self._train_started, 3),
                                   ended_by="stop", **{f"{self.metric}_at_end": round(self.headline_value(self.totals.metrics), 4)})
        if self.shard_group is not None:  # a rebuild still waiting for replay is reported as it stands
            report_shard_events(self, self.shard_group.settle_all(), self.totals.epochs)
        self.finish_epochs()
        self.totals.checkpoint = self.checkpoint("final", self.cfg.strategy.timeout_s, named="model.pt")
        with tempfile.TemporaryDirectory() as tmp:
            import torch

            path = os.path.join(tmp, "model.pt")
            torch.save(self.last_state["model"], path)
            self.report.tracker.log_file(path)
        from orchestrator.final_model import log_trained_model

        seconds = log_trained_model(self.report.tracker, self.cfg, self.dataset, self.last_state["model"])
        if seconds is not None:
            self.report.event("model_logged", name="model", seconds=round(seconds, 3))

    def checkpoint(self, tag: str, timeout_s: float, named: Optional[str] = None) -> str:
        """The lowest rank's model and optimizer state (all replicas hold the same parameters,
        or the mode's reference) plus the run's position, written by the Checkpointer
        (orchestrator/run_state.py). The final one says the run finished (a named run is not
        started again from it). Returns the named copy's path if there is one, else the store's."""
        t = time.perf_counter()
        first = self.group.ranks[0]
        state = self.group.call([first], "state", what=f"checkpoint {tag}", timeout_s=timeout_s)[0]
        state.update(epoch=self.totals.epochs, mlflow_run_id=self.tracker.run_id,
                     config=self.cfg.model_dump(mode="json"), run=self.position.save(), finished=tag == "final")
        path, stored = self.checkpoints.write(state, tag, self.totals.steps, self.totals.epochs, self.tracker.run_id,
                                              named)
        self.report.event("checkpoint", path=path, epoch=self.totals.epochs, step=self.totals.steps,
                          seconds=round(self.checkpoints.last_s - t, 4), **({"stored": stored} if named else {}))
        return path

    def _watch(self) -> None:
        """While the driver waits on replicas (a repair, a switch, an evaluation): a dead shard
        or partition server is still noticed and rebuilt, so a replica waiting for one is not
        left waiting."""
        watch_servers(self, self.totals.epochs + 1)

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

    # ---- helpers ---------------------------------------------------------------------------
    def get(self, refs, what: str, timeout: Optional[float] = None):
        return self.group._get(refs, what, self.cfg.strategy.timeout_s if timeout is None else timeout)
