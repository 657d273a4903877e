"""Phase switches: the controller asks the switch policy (policies/decisions/switching.py) at every
decision point and carries out the switch it decides, losing nothing.

When: at an epoch's end (`until` epochs or a metric; adaptive too), or mid-epoch (`until`
steps or seconds; adaptive on the replicas' progress reports). A mid-epoch switch pauses the
partition server: each replica stops at its next partition boundary (a lock-step mode: every
replica after the same step, the pause rides on the step's all-reduce), ends its segment with
a "paused" item and keeps its place in the epoch. A replica that already holds the last
partitions it will get this epoch finishes them; when every stream has ended the switch is
carried out (if nobody paused, at the epoch's end).

How (`carry_out`), with every replica stopped:
1. the reference parameters: allreduce -> downpour/easgd: the shards are re-seeded from the
   replicas' current, identical parameters (the EASGD center = those parameters);
   downpour <-> easgd: the shards' contents carry over; either way the shards' server
   optimizer starts afresh (its state belonged to the other rule) and a snapshot is taken;
2. every replica changes its update rule in place (`ModelReplica.set_mode`): a replica
   leaving a sharded mode pushes what it accumulated and waits for its acknowledgements first;
   entering from a sharded mode it loads the reference (Downpour's server copy, EASGD's center),
   so every replica starts the phase from the same parameters; the new rule's local optimizer
   takes the old one's state when both are of the same kind, else starts fresh (said in the
   event); into allreduce the carried per-element state is averaged across the replicas;
3. allreduce: the process group is formed (a new generation) if the new mode needs one;
4. the partition server stops pausing; an asynchronous mode entered mid-epoch leases the rest
   of the epoch from one shared queue; the next epochs lease as the new mode does;
5. the replicas go on with the epoch where they were (no actor restart, no data reload). The
   `mode_switch` event is logged once every replica has stepped in the new mode, with
   `switch_s` from the decision until then, and the headline metric (`metric`: stop.target's, else the task's primary, e.g. test_accuracy) right before and right after.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np
from typing import TYPE_CHECKING, Any, Optional

from orchestrator.control.decide import switch_plan
from orchestrator.control.reconfig.carrier import Change
from orchestrator.control.states import EpochSegment, Guard, Pending, SwitchPlan
from policies.rules.registry import mode_spec
from policies.decisions.switching import Observation, Switch, replicas_strategy

if TYPE_CHECKING:
    from orchestrator.control.context import RunContext

MODE_CODES = {"allreduce": 0, "downpour": 1, "easgd": 2, "local_sgd": 3, "gossip": 4, "fsdp": 5, "hogwild": 6, "sandblaster": 7}  # the MLflow `mode` metric


def observe(run: "RunContext", epoch_end: bool, metrics: Optional[dict[str, float]] = None) -> Observation:
    rows = {r: row for r, row in run.ledger.signals.items() if r in run.fleet.group.members}
    compute = {r: row.compute_s for r, row in rows.items() if row.compute_s}
    shares = [row.comm_share for row in rows.values() if row.comm_share is not None]
    batch = {r: row.batch_rows for r, row in rows.items() if row.batch_rows}
    return Observation(epoch_end, run.ledger.totals.epochs, max(run.ledger.progress.values(), default=0),
                       time.perf_counter() - run.ledger.train_started, metrics or {}, compute,
                       sum(shares) / len(shares) if shares else None, batch, len(run.fleet.group.members))


def consider(run: "RunContext", seg: Optional[EpochSegment], pending: Pending, epoch_end: bool = False,
             metrics: Optional[dict[str, float]] = None) -> Pending:
    """Ask the policy; a switch it decides is recorded as pending (and, mid-epoch, the partition
    server starts pausing the replicas). What is pending after it."""
    if pending.switch is not None or len(run.policies.switch.plan) < 2 or run.fleet.pause.closed:
        return pending
    sw = run.policies.switch.decide(observe(run, epoch_end, metrics))
    if sw is None:
        return pending
    mid = not epoch_end and seg is not None and seg.begun
    pending = replace(pending, switch=switch_plan(sw, mid, run.phase.spec.name))
    to = f"{sw.mode} (phase {sw.phase})" if sw.mode == run.phase.spec.name else sw.mode  # e.g. allreduce with backups
    run.report.say(f"switch to {to} decided ({sw.rule}): {sw.reason}")
    return pending.pause_for(run.fleet.pause, "switch") if mid else pending


def evaluate(run: "RunContext", split: Optional[str] = None) -> dict[str, float]:
    """The task's metrics (e.g. test accuracy and loss) of the current mode's reference model
    now (every replica its slice of the split it holds; named for `split`, default the run's)."""
    method = "evaluate_reference" if run.phase.spec.sharded else "evaluate"
    evals = run.fleet.group.call(run.fleet.group.ranks, method, what=f"{split} evaluation" if split else "evaluation",
                           timeout_s=run.cfg.strategy.timeout_s)
    return run.finish_evaluation(evals, split)


def check_guard(run: "RunContext", pending: Pending, epoch: int, metrics: dict[str, float]) -> Pending:
    """At an epoch's end after a switch (the first full epoch after it, and the rest of a
    mid-epoch switch's own epoch): a test loss above the loss at the switch by more than
    strategy.rollback_margin (relative), or not finite, rolls the switch back: the phase and mode
    from before it and the model from before it (a `switch_rolled_back` event, then the
    rollback's own `mode_switch`), and no further switch this run."""
    g, margin = pending.guard, run.cfg.strategy.rollback_margin
    if g is None:
        return pending
    g = replace(g, checks=g.checks - 1)
    name = run.loss_metric
    loss = metrics.get(name)
    if loss is not None and margin is not None and (not math.isfinite(loss) or loss > g.loss * (1 + margin)):
        run.policies.switch.roll_back(g.phase)  # the policy's place is the policy's to move; it decides no more
        numbers = {f"{name}_at_switch": round(g.loss, 4), f"{name}_now": round(loss, 4), "margin": margin}
        skipped = sum(s.skipped_steps or 0 for s in run.ledger.signals.values())  # on probation (and fp16 ones)
        if skipped:
            numbers["skipped_steps"] = skipped
        reason = (f"{name} {loss:.4f} in {run.phase.spec.name} rose past {g.loss:.4f} x (1 + {margin:g}), the loss at the "
                  f"switch: back to {g.mode} with the model from before it; no further switch this run")
        rollback = switch_plan(Switch(g.phase, g.mode, "rollback", reason, numbers), False, run.phase.spec.name,
                               rollback=g.state)
        run.report.event("switch_rolled_back", epoch=epoch, mode=run.phase.spec.name, back_to=g.mode, **numbers)
        run.report.say(f"rolling the switch back: {reason}")
        return replace(pending, guard=None, switch=rollback)
    return replace(pending, guard=g if g.checks > 0 else None)


class Switching(Change):
    """A phase switch as the carrier's steps (orchestrator/control/reconfig/carrier.py; module doc): nobody
    joins or leaves; the state step consolidates the reference and changes every replica's
    rule; the verify step evaluates the new mode's reference."""

    kind = "switch"
    pause = "switch"
    duration_key = "switch_s"

    def __init__(self, plan: SwitchPlan, pending: Pending) -> None:
        """`pending`: the Running state's; `self.pending` is what is pending as the switch goes
        (its guard enters at the commit point, the switch leaves it once carried out), and
        `self.plan` the plan with what it measured before the commit point (carried out again
        after a loss, it measures nothing twice)."""
        super().__init__(plan.t_decide_wall)
        self.plan, self.pending = plan, pending
        self.paused: list[int] = []
        self.shards_did = "none"
        self.guard: Optional[Guard] = None

    def membership(self, run: "RunContext", seg: EpochSegment) -> None:
        """Unchanged; who paused for it (they go on after it) is noted before the passes are reported.
        The old phase is the plan's, not the controller's: carried out again after a loss in its
        middle, the controller may be in the new phase already."""
        self.old_mode = self.plan.from_mode or run.phase.spec.name
        self.old_spec = mode_spec(self.old_mode)
        self.new_strategy = run.policies.switch.plan[self.plan.switch.phase]
        self.new_spec = mode_spec(self.new_strategy["mode"])
        self.paused = run.ledger.epoch.paused_ranks()

    def hand_off(self, run: "RunContext", seg: EpochSegment) -> None:
        """The metric before; the shards seeded from the replicas or carried over; every replica's
        rule changed in place."""
        group, ranks, timeout_s = run.fleet.group, run.fleet.group.ranks, run.cfg.strategy.timeout_s
        rollback, margin = self.plan.rollback, run.cfg.strategy.rollback_margin
        if self.plan.measured is None:  # once: a retry past the commit point would measure the new rule's model
            before = evaluate(run)
            guard = None
            if rollback is None and margin is not None and run.loss_metric in before:  # this switch goes on probation
                guard = Guard(run.phase.phases[-1]["phase"], self.old_mode,
                              group.call([ranks[0]], "state", what="state")[0], before[run.loss_metric],
                              checks=2 if seg.begun else 1)
            self.plan = replace(self.plan, measured=(run.headline_value(before), guard))
        self.before, self.guard = self.plan.measured
        if self.new_spec.sharded and rollback is None:  # a rollback seeds the shards from the state it loads
            clocks = {r: step for r, step in zip(ranks, group.call(ranks, "current_step", what="steps"))}
            if self.old_spec.sharded:
                run.fleet.shard_group.reseed(None, run.shard_optimizer(self.new_strategy), clocks, timeout_s=timeout_s)
                self.shards_did = "contents carried over; server optimizer state reset"
            else:
                values = group.call([ranks[0]], "flat_parameters", what="parameters")[0]
                run.fleet.shard_group.reseed(values, run.shard_optimizer(self.new_strategy), clocks, timeout_s=timeout_s)
                self.shards_did = "seeded from the replicas' parameters; server optimizer state reset"
        self.translated = run.phase_optimizer(self.new_strategy)[1] if self.new_spec.sharded else None
        if self.translated:
            run.report.say(f"entering {self.new_spec.name}: {self.translated}")
        self.new_strategy = replicas_strategy(self.new_strategy, run.cfg.optimizer.model_dump(),
                                              len(run.fleet.group.members) or run.cfg.scaling.replicas,
                                              len(run.policies.switch.plan) > 1)[0]  # hogwild: its replicas' own momentum
        # the commit point: from here the replicas run the new rule, so the controller does too (a
        # replica lost in the call is replaced in the new phase; the switch is carried out again,
        # each step idempotent: set_mode on a replica in the new phase rebuilds the same worker)
        until = seg.epoch + self.guard.checks - 1 if self.guard is not None else -1  # the last epoch the guard judges
        if self.guard is not None:
            self.guard = replace(self.guard, until=until)
        self.pending = replace(self.pending, guard=self.guard)  # an interrupt from here on leaves a checkpoint of the new mode, on probation
        group.set_strategy(self.new_strategy, until)  # a replacement or a grow's replica joins on probation too
        run.phase.set(self.new_strategy)
        run.policies.switch.commit()  # a checkpoint from here on records the new phase (before: the old one)
        self.carried = group.call(ranks, "set_mode", self.new_strategy, self.old_spec.sharded, until, what="set mode")
        if self.new_spec.process_group and any(c.local_optimizer == "carried" for c in self.carried):
            # into allreduce: every replica must take the same step, so the momentum each kept
            # in the other mode (momentum, Adam's moments) is averaged once, as the parameters were
            buffers = group.call(ranks, "momentum", what="momentum")
            kept = [b for b in buffers if b is not None]
            if len(kept) == len(ranks) and all(set(k) == set(kept[0]) for k in kept):  # per state key
                mean = {key: np.mean(np.stack([k[key] for k in kept]), axis=0).astype(kept[0][key].dtype)
                        for key in kept[0]}
                group.call(ranks, "set_momentum", mean, what="momentum")
                self.carried = [replace(c, local_optimizer="carried, averaged") for c in self.carried]
        if rollback is not None:  # the model from before the switch it undoes, at each replica's own step
            steps = dict(zip(ranks, group.call(ranks, "current_step", what="steps")))
            group.call(ranks, "load_state", what="the state from before the switch",
                       per_rank=lambda r: ({**rollback, "step": steps[r]},))
            if self.new_spec.sharded:
                values = group.call([ranks[0]], "flat_parameters", what="parameters")[0]
                run.fleet.shard_group.reseed(values, run.shard_optimizer(self.new_strategy), steps, timeout_s=timeout_s)
                self.shards_did = "seeded from the state before the switch; server optimizer state reset"

    def regroup(self, run: "RunContext") -> bool:
        return self.new_spec.process_group or self.new_spec.lock_step(self.new_strategy)

    def verify(self, run: "RunContext", seg: EpochSegment) -> None:
        after = evaluate(run)
        self.after = run.headline_value(after)
        if self.plan.rollback is not None:  # the run's latest metrics are those of the model it holds again
            run.ledger.totals.metrics = after

    def share(self, seg: EpochSegment) -> Optional[bool]:
        """An asynchronous mode entered mid-epoch leases the rest of the epoch from one shared queue."""
        return seg.begun and not self.new_spec.leases_pinned(self.new_strategy)

    def reopen(self, run: "RunContext", seg: EpochSegment) -> list[int]:
        """Lock-step modes need every member; else those that paused go on."""
        return run.fleet.group.ranks if run.phase.lock_step else self.paused

    def waiting(self, run: "RunContext", seg: EpochSegment, reopened: list[int]) -> list[int]:
        if self.pending.stopping:  # a rollback before the run ends: nobody steps again, the event is logged now
            return []
        return reopened if seg.begun else run.fleet.group.ranks  # between epochs: they step when the next one opens

    def event(self, run: "RunContext", seg: EpochSegment, lr: dict[str, Any],
              reopened: list[int]) -> dict[str, Any]:
        sw, before, after = self.plan.switch, self.before, self.after
        step = max(run.ledger.progress.values(), default=0)
        run.record_phase(sw, step, before, after)
        self.pending = replace(self.pending, switch=None)  # its guard entered the pending at the commit point
        run.report.metrics([("mode", MODE_CODES[self.old_mode], max(step - 1, 0)),
                            ("mode", MODE_CODES[self.new_spec.name], step)])
        phases = (f" (phase {run.phase.phases[-2]['phase']} -> {sw.phase})"
                  if self.old_mode == self.new_spec.name and len(run.phase.phases) > 1 else "")  # e.g. allreduce -> allreduce with backups
        run.report.say(f"switched {self.old_mode} -> {self.new_spec.name}{phases} at step {step}: {run.metric} "
                       f"{before:.4f} before, {after:.4f} after")
        return {"kind": "mode_switch", "epoch": seg.epoch, "from": self.old_mode, "to": self.new_spec.name,
                "phase": sw.phase, "rule": sw.rule, "reason": sw.reason, "numbers": sw.numbers, "at_step": step,
                "mid_epoch": bool(seg.begun), "metric": run.metric, f"{run.metric}_before": round(before, 4),
                f"{run.metric}_after": round(after, 4), "shards": self.shards_did,
                "local_optimizer": sorted({c.local_optimizer for c in self.carried}),
                **({"optimizer_translated": self.translated} if self.translated else {}),
                **({"rollback": True} if self.plan.rollback is not None else {})}
