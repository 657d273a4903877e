"""One epoch's bookkeeping: closing a pass over the partitions (a further pass over what a
disturbed epoch left unserved), the epoch's end (evaluation, totals, metrics, events, the
periodic checkpoint, the stop decision: `end_epoch`), and noticing a rebuilt partition server or
shard whatever else the driver is doing."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

from orchestrator.control.decide import after_epoch, holding, running
from orchestrator.control import checkpointing
from orchestrator.control.checkpointing import report_written
from orchestrator.control import starting
from orchestrator.control.reconfig import phase_switch
from orchestrator.errors import MemberLost, TrainingError
from orchestrator.control.failures import lost_meanwhile
from orchestrator.control.passes import coordinate_pass
from orchestrator.control.states import EpochSegment, Pending
from policies.decisions.checkpointing import due as checkpoint_due
from policies.decisions.stop import EpochSnapshot, StopDecision
from orchestrator.reporting.reporter import Action
from policies.messages import FleetEvent, ProgressRow

if TYPE_CHECKING:
    from orchestrator.control.context import Fleet, Ledger, RunContext
    from orchestrator.persistence.run_state import Checkpointer, RunTotals
    from orchestrator.reporting.reporter import Reporter
    from policies.decisions.stop import Target

MAX_PASSES = 8  # further passes over an epoch's unserved partitions before the run gives up


def watch_servers(run: "RunContext", epoch: int) -> bool:
    """The shards and the partition server (`watch`), from the Running loop."""
    return watch(run.fleet, run.report, run.checkpoints, epoch)


class ServerWatch:
    """While the driver waits on replicas (a repair, a switch, an evaluation: the replica
    group's `on_wait`), a dead shard or partition server is still noticed and rebuilt (`watch`),
    so a replica waiting for one is not left waiting. It holds the parts it uses, not the run."""

    def __init__(self, fleet: "Fleet", report: "Reporter", checkpoints: "Checkpointer", ledger: "Ledger") -> None:
        self.fleet, self.report, self.checkpoints, self.ledger = fleet, report, checkpoints, ledger

    def __call__(self) -> bool:
        return watch(self.fleet, self.report, self.checkpoints, self.ledger.totals.epochs + 1)


def watch(fleet: "Fleet", report: "Reporter", checkpoints: "Checkpointer", epoch: int) -> bool:
    """The shards and the partition server: a dead (or stopped) one is rebuilt, whatever else
    the driver is doing (never waits on a shard; a server's rebuild is waited for). True when
    one was rebuilt or a shard is being rebuilt: a replica may have waited on it."""
    repaired = False
    if fleet.server is not None:
        for happened in fleet.server.poll():
            repaired = True
            report_fleet_event(report, happened)
    if fleet.shard_group is not None:
        report_shard_events(report, fleet.shard_group.poll(), epoch)
        repaired = repaired or fleet.shard_group.repairing
    report_written(checkpoints, report)  # checkpoints stored in the background meanwhile: their events
    return repaired


def report_fleet_event(report: "Reporter", happened: FleetEvent, **fields: Any) -> None:
    report.event(happened.kind, **fields, **happened.fields)
    report.say(happened.line)


def report_shard_events(report: "Reporter", events: list[FleetEvent], epoch: int) -> None:
    for happened in events:
        report_fleet_event(report, happened, epoch=epoch)


def close_pass(run: "RunContext", seg: EpochSegment, pending: Pending):
    """Every stream ended with no failure pending. An undisturbed epoch ends here (its last
    completions are reported with the next start_epoch); else ask the server's ledger whether
    every partition was served, and start a further pass over what is left if not (Running on
    the segment's next pass)."""
    record = run.ledger.epoch
    run.fleet.reader.check_started(run.fleet.server, seg.epoch)
    # a replica still paused here (the change it paused for went without reopening it) starts
    # the further pass afresh: what it trained since its last grant request is reported now
    completed = {r: item.unreported for r, item in record.ended.items() if item.kind in ("epoch", "paused")}
    stopped_at = [item.step for item in record.ended.values()]  # stop.max_steps: the epoch ends where its updates did
    if not record.disturbed or at_max_steps(run.cfg.stop.max_steps, stopped_at):
        run.ledger.unreported = completed
        return end_epoch(run, seg, pending)
    status = run.fleet.server.call("finish", completed)
    record.ended = {}
    if status.complete:
        run.ledger.redone += status.redone
        return end_epoch(run, seg, pending)
    seg = replace(seg, passes=seg.passes + 1)
    if seg.passes > MAX_PASSES:
        raise TrainingError(f"epoch {seg.epoch}: {status.remaining} partitions were never served")
    for rank in run.fleet.group.ranks:  # a further pass: every member asks the server for what is left
        run.open_stream(seg, rank, announce=rank in record.awaiting_steps())
    return running(seg, pending)


def at_max_steps(limit: Optional[int], steps: list[int]) -> bool:
    """Every replica stopped at stop.max_steps' update (`limit`; `steps`: where each member's
    last segment ended): what the epoch left unserved stays so."""
    return limit is not None and bool(steps) and min(steps) >= limit


def end_epoch(run: "RunContext", seg: EpochSegment, pending: Pending):
    """The epoch's bookkeeping: evaluation, totals, metrics, events, checkpoint, the stop
    decision. Running(next epoch, pending) or Finishing."""
    cfg, tot = run.cfg, run.ledger.totals
    epoch = seg.epoch
    record = run.ledger.epoch
    stats = record.merged()
    finals = [s for s in stats if s.eval is not None or s.mode is not None]
    converged, pass_figures = None, {}
    if run.phase.spec.coordinated:  # sandblaster: the pass's L-BFGS iteration moves x before it is evaluated
        pass_figures, converged = coordinate_pass(run, epoch)
    if run.phase.spec.sharded:  # evaluate the reference (server copy / center) once all are done
        evals = run.fleet.group.call(run.fleet.group.ranks, "evaluate_reference", what="evaluation",
                                timeout_s=cfg.strategy.timeout_s)
    else:
        evals = [s.eval for s in finals]
    metrics = run.finish_evaluation(evals)

    tot.epochs = epoch
    counts = record.counts(stats)  # with what was trained before a restart inside it (mid_epoch.py)
    tot.steps += counts.steps
    tot.samples += counts.samples
    tot.rows_per_epoch.append(counts.samples)
    tot.train_s += counts.train_s
    tot.comm_s += counts.comm_s
    # the lowest rank's that trained a row (a replacement that joined at the epoch's end has none: nan)
    tot.train_loss = next((s.loss for s in finals or stats if s.loss == s.loss), float("nan"))
    if pass_figures:  # sandblaster: the loss at the pass's x over every train row
        tot.train_loss = pass_figures["pass_loss"]
    tot.metrics = metrics
    judged = {**metrics, "train_loss": tot.train_loss}
    if run.trace_ids:
        run.ledger.consumed.append(record.consumed())
    elapsed = time.perf_counter() - run.ledger.t0
    note_target(run.target, tot, run.report, epoch, judged, elapsed)

    rows_out = [(key, p.figure(name), p.step) for p in record.progress
                for key, name in (("train_loss", "loss"), ("samples_per_s", "samples_per_s"), ("lr", "lr"),
                                  ("grad_norm", "grad_norm"), ("skipped_steps", "skipped_steps"))
                if p.figure(name) is not None]
    rows_out += step_metric_rows(record.all_progress)
    figures = step_figures(record.all_progress)
    if cfg.optimizer.schedule is not None:  # the rate by step for training.png (MLflow's `lr` holds every row)
        rates = [[p.step, p.lr] for p in record.progress if p.lr is not None]
        figures["lr_by_step"] = rates[:: max(1, len(rates) // LR_POINTS)]
    rows_out += [(k, v, tot.steps) for k, v in metrics.items()]
    rows_out += [("epoch", epoch, tot.steps),
                 ("comm_share", tot.comm_s / max(tot.train_s, 1e-9), tot.steps)]
    mine = [s for s in finals if s.mode is not None and s.mode_name == run.phase.spec.name]
    extra = run.phase.spec.metrics(mine) if mine else {}  # a rank that ended the epoch before a switch: not its figures
    if run.fleet.shard_group is not None:
        extra.update(run.phase.spec.shard_metrics(run.fleet.shard_group))
    extra.update(pass_figures)
    rows_out += [(k, v, tot.steps) for k, v in extra.items()]
    for event in run.phase.spec.epoch_events(mine) if mine else []:
        run.report.event(epoch=epoch, **event)
    rows_out += [("epoch_rows", tot.rows_per_epoch[-1], tot.steps),
                 ("replicas_alive", len(run.fleet.group.members), tot.steps),
                 ("replica_restarts", tot.replica_restarts, tot.steps)]
    run.report.metrics(rows_out)
    tot.epoch_wall_s += time.perf_counter() - seg.t_start
    run.report.event("epoch_end", epoch=epoch, step=tot.steps, **{k: round(v, 6) for k, v in metrics.items()},
                      train_loss=round(tot.train_loss, 4),
                      train_s_by_rank=[round(s.train_s, 3) for s in stats],
                      steps_by_rank=[s.steps for s in stats], rows=tot.rows_per_epoch[-1],
                      replicas=len(run.fleet.group.members), **{k: round(v, 4) for k, v in extra.items()}, **figures)
    shown = "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items(), key=lambda kv: kv[0] != run.metric))
    run.report.say(f"epoch {epoch}: {shown}  train_loss {tot.train_loss:.4f}  ({elapsed:.1f}s)")
    if not record.had_failure:
        run.policies.failure.epoch_without_failure()

    pending = phase_switch.check_guard(run, pending, epoch, metrics)  # a switch that hurt: rolled back before anything keeps this model
    try:  # an interrupt from here on leaves the guard as judged (a rollback decided: no checkpoint of this model)
        rolling_back = pending.switch is not None and pending.switch.rollback is not None
        lost: list[MemberLost] = []
        if not rolling_back:
            loss = metrics.get(run.loss_metric)
            why = run.policies.chance.observe(loss) if run.policies.chance is not None and loss is not None else None
            if why is not None:
                raise TrainingError(f"epoch {epoch}: training diverged: {why}; the last checkpoint is kept")
            lost = adapt_batch(run, seg, figures.get("gradient_diversity"))  # before the checkpoint, which keeps it
            ck = cfg.checkpoint
            best = run.policies.best.observe(epoch, judged) and ck.keep_best  # the best epoch so far: kept as best.pt
            if best or checkpoint_due(epoch, time.perf_counter(), max(run.checkpoints.last_s, run.ledger.train_started),
                                      ck.every_epochs, ck.every_s):
                try:
                    written = checkpointing.take(run, f"epoch_{epoch:04d}", cfg.strategy.timeout_s,
                                                 named="best.pt" if best else None,
                                                 wait=False,  # stored in the background while the next epoch trains
                                                 probation=pending.probation())
                    tot.checkpoint, lost = written.path, lost + written.lost
                    if best:
                        run.ledger.best_model = run.last_saved.model
                        watched = run.policies.best.metric
                        run.report.event("best_checkpoint", epoch=epoch, metric=watched, value=judged[watched])
                except TrainingError as exc:  # every member stopped or died meanwhile, or the store failed
                    lost = lost + ([exc] if isinstance(exc, MemberLost) else [])
                    run.report.event("checkpoint_failed", epoch=epoch, reason=str(exc))
                    run.report.say(f"checkpoint after epoch {epoch} not written ({exc}); the previous one is kept")
        decision = run.policies.stop.decide(EpochSnapshot(epoch, judged, time.perf_counter() - run.ledger.train_started,
                                                          asked=run.report.requests.take(Action.STOP), steps=tot.steps))
        if converged is not None and not decision.stop:
            decision = StopDecision(True, converged)
        if not decision.stop and not rolling_back:
            decision = run.policies.best.stop() or decision  # stop.early_stopping
        if decision.stop:
            tot.stop_reason = decision.reason
            run.report.event("stop", reason=decision.reason)
            if not rolling_back:
                return after_epoch(True, seg, pending)
            pending = replace(pending, stopping=True)  # the model from before the switch first (Running carries the rollback out), then the end
        else:
            pending = phase_switch.consider(run, None, pending, epoch_end=True, metrics=judged)
        # the next epoch starts when Running next runs (a caller between steps sees this one's ledger);
        # it carries on timing a recovery whose newcomer had nothing left to do in this one. Members
        # lost while the checkpoint was taken are its failures: repaired before it opens
        nxt = run.fresh_epoch(epoch + 1, begun=False)
        for exc in lost:
            lost_meanwhile(run, nxt, exc, pending)
        return after_epoch(False, nxt, pending)
    except BaseException as exc:
        holding(exc, pending)
        raise


def note_target(target: "Optional[Target]", tot: "RunTotals", report: "Reporter", epoch: int,
                judged: dict[str, float], elapsed: float, **where) -> None:
    """The first evaluation that reaches stop.target: time_to_target_s and a `target_reached`
    event (`where`: the step of an eval.every_steps evaluation)."""
    if target is not None and tot.time_to_target_s is None and target.reached(judged):
        tot.time_to_target_s = elapsed
        report.event("target_reached", epoch=epoch, metric=target.metric, value=judged[target.metric],
                          target=target.value, goal=target.goal, **where, **{target.metric: judged[target.metric]})


def interval_evaluation(run: "RunContext", seg: EpochSegment, rank: int, item: dict) -> None:
    """eval.every_steps: a member's evaluation sums at a step; once every member has sent its
    own for that step, the metrics: MLflow at that step, an `evaluation` event, a target
    reached. A step some member never reports (it left the group, or joined past it) is
    dropped at the epoch's end: a partial sum would be another split's figure."""
    pending = run.ledger.epoch.evaluations.setdefault(item.step, {})
    pending[rank] = item.sums
    members = sorted(run.fleet.group.members)
    if not set(members) <= set(pending):
        return
    del run.ledger.epoch.evaluations[item.step]
    step = item.step
    metrics = run.finish_evaluation([pending[r] for r in members])
    run.report.metrics([(k, v, step) for k, v in metrics.items()])
    run.report.event("evaluation", epoch=seg.epoch, step=step, **{k: round(v, 6) for k, v in metrics.items()})
    shown = "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items(), key=lambda kv: kv[0] != run.metric))
    run.report.say(f"step {step} (epoch {seg.epoch}): {shown}")
    note_target(run.target, run.ledger.totals, run.report, seg.epoch, metrics, time.perf_counter() - run.ledger.t0,
                step=step)


LR_POINTS = 200  # at most this many (step, lr) points per epoch_end event
STEP_FIGURES = ("compute_s", "comm_s", "wait_s", "batch_rows")  # per replica, from its progress rows


def adapt_batch(run: "RunContext", seg: EpochSegment, diversity: Optional[float]) -> list[MemberLost]:
    """data.adaptive_batch: the epoch's gradient noise decides whether the replicas' batch grows
    for the next epoch (policies/decisions/batch_size.py); the rate follows it (elastic.rebatch).
    Not after an epoch whose membership changed (its figure mixes group sizes). Returns the
    members lost while they were told (repaired before the next epoch, as the checkpoint's)."""
    rule, elastic = run.policies.batch, run.fleet.elastic
    if rule is None:
        return []
    members, before, at = len(run.fleet.group.ranks), elastic.batch.value, run.ledger.totals.steps
    grown = None if run.ledger.epoch.disturbed else rule.decide(diversity, members, before, run.cfg.data.accumulate)
    lost: list[MemberLost] = []
    if grown is not None:
        try:
            lr = elastic.rebatch(max(run.ledger.progress.values(), default=0), grown[0], run.rate_base())
        except MemberLost as exc:  # the others were told (one fan-out); the newcomer is told as it joins
            lr, lost = {}, [exc]
        starting.estimate_steps(run)  # the display's
        run.report.event("batch_size_changed", epoch=seg.epoch, batch_from=before, batch_to=grown[0],
                         global_batch=grown[0] * members, noise_scale=round(grown[1], 1),
                         gradient_diversity=round(diversity, 4), **lr)
        rows, rate = grown[0] * run.cfg.data.accumulate * members, lr.get("lr_target", "(told as replicas join)")
        run.report.say(f"batch {before} -> {grown[0]} per replica (gradient noise scale {grown[1]:.0f} rows >= "
                       f"{rows}); learning rate -> {rate}")
    run.report.metrics([("batch_size", elastic.batch.value, at)])
    return lost


def step_metric_rows(progress: list[ProgressRow]) -> list[tuple[str, float, int]]:
    """MLflow rows of the per-step measurements in the replicas' progress rows: each replica's
    `replica<r>/<figure>` (compute, communication and waiting seconds per step, its batch
    rows), and `gradient_diversity` and `busy_spread` (the same on every replica: rank 0's)."""
    out = [(f"replica{p.rank}/{k}", p.figure(k), p.step) for p in progress for k in STEP_FIGURES
           if p.figure(k) is not None]
    ranks = sorted({p.rank for p in progress})
    out += [(k, p.figure(k), p.step) for p in progress if ranks and p.rank == ranks[0]
            for k in ("gradient_diversity", "busy_spread") if p.figure(k) is not None]
    return out


def step_figures(progress: list[ProgressRow]) -> dict:
    """The epoch's per-step measurements for its `epoch_end` event: `step_figures` {rank: mean
    compute_s, comm_s, wait_s, batch_rows per step}, and the mean `gradient_diversity` and
    `busy_spread`; {} when the rows have none."""
    by_rank: dict[int, dict[str, list[float]]] = {}
    shared: dict[str, list[float]] = {"gradient_diversity": [], "busy_spread": []}
    ranks = sorted({p.rank for p in progress})
    for p in progress:
        mine = by_rank.setdefault(p.rank, {k: [] for k in STEP_FIGURES})
        for k in STEP_FIGURES:
            if p.figure(k) is not None:
                mine[k].append(float(p.figure(k)))
        if p.rank == ranks[0]:
            for k in shared:
                if p.figure(k) is not None:
                    shared[k].append(float(p.figure(k)))
    mean = lambda v: round(sum(v) / len(v), 6) if v else None  # noqa: E731
    figures = {str(r): {k: mean(v) for k, v in f.items() if v} for r, f in sorted(by_rank.items())}
    figures = {r: f for r, f in figures.items() if f}
    out: dict = {"step_figures": figures} if figures else {}
    out.update({k: mean(v) for k, v in shared.items() if v})
    return out
