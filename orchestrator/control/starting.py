"""Starting: the run's first state. The mode's shards are launched beside the driver, the data
placed (in-memory partitions put into the object store once, or a file source's plan), the
partition server started, the replicas' process group formed and their data given, a resumed
run's checkpoint loaded (each part of its position back to its owner: orchestrator/persistence/run_state.py),
and the first epoch's segment opened."""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Optional

from orchestrator.control.reconfig import phase_switch
from orchestrator.fleet.model_state import for_loading
from orchestrator.fleet.cluster import beside_driver
from orchestrator.data.placement import place_data
from orchestrator.persistence.run_state import UNSAVED, Position, resolve_probation
from orchestrator.persistence.resume import FROM_MEMORY
from orchestrator.control.states import EpochSegment, Guard, Pending
from policies.decisions.leases import MAX_GRANT
from policies.messages import Probation, SavedState
from policies.rules.gradient_tasks import partition_tasks
from policies.rules.registry import mode_spec

if TYPE_CHECKING:
    from orchestrator.control.context import RunContext


def launch(run: "RunContext") -> None:
    """Ask Ray for the actors the mode needs and return at once: their worker processes boot
    (import torch, build the model) while the caller does other start-up work."""
    if run.fleet.needs_shards:
        launch_shards(run)
        run.fleet.group.shards = run.fleet.shard_group.directory()
    run.fleet.group.launch()


def launch_shards(run: "RunContext") -> None:
    """ParameterShards holding the initial parameters (the same factory and seed as every
    replica), cut into balanced slices of the flat vector, snapshotted for rebuilds."""
    import torch

    from orchestrator.fleet.shard_group import ShardGroup
    from orchestrator.models import build_model
    from policies.rules.sharding import shard_bounds

    cfg = run.cfg
    model = build_model(cfg.model.factory, cfg.model.kwargs, cfg.data.seed)
    initial = torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad]).numpy()
    bounds = shard_bounds(initial.size, cfg.scaling.shards)
    first_sharded = next(p for p in run.policies.switch.plan if mode_spec(p["mode"]).sharded)
    name, lr, momentum, weight_decay = run.shard_optimizer(first_sharded)
    run.fleet.shard_group = ShardGroup.create(initial, bounds, name, lr, momentum, weight_decay, cfg.scaling.replicas,
                                         cfg.fault_tolerance.shard_snapshot_every_s,
                                         name_prefix=f"eo-{uuid.uuid4().hex[:12]}", placement=beside_driver(),
                                         hang_s=cfg.fault_tolerance.hang_timeout_s / 2)

def start(run: "RunContext") -> EpochSegment:
    from orchestrator.fleet.server_link import ServerLink

    if not run.fleet.group.members:
        launch(run)
    cfg, n = run.cfg, run.cfg.scaling.replicas
    # in-memory data: partitions put once; a file source: only its plan (orchestrator/data/placement.py)
    run.fleet.data = place_data(run.dataset, cfg.data.partitions or 4 * n, cfg.data.seed)
    rows = run.fleet.data.rows
    shuffle = cfg.data.shuffle
    if run.phase.spec.coordinated and cfg.strategy.task_rows is not None:  # sandblaster: tasks smaller than a partition
        run.phase.tasks = partition_tasks(rows, cfg.strategy.task_rows)
        rows = [hi - lo for _, lo, hi in run.phase.tasks]  # the server leases tasks,
        shuffle = False  # in their partitions' order: a replica reads a partition once for the tasks it takes in a row
    run.phase.lease_plan = (rows, n, cfg.data.seed, run.phase.pinned, shuffle)
    estimate_steps(run)
    # a run that can switch modes (or checkpoints inside its epochs) is granted one partition at a
    # time: every partition boundary is a point where a replica can hear a pause (two at a time
    # saves calls otherwise)
    ck = cfg.checkpoint
    run.phase.max_grant = 1 if len(run.policies.switch.plan) > 1 or ck.every_steps or ck.every_s else MAX_GRANT
    # sandblaster: a late partition gets a backup copy (one mode for the whole run, so set once)
    run.phase.backups = bool(run.phase.spec.coordinated and cfg.strategy.backup_tasks)
    run.fleet.server = ServerLink(*run.phase.lease_plan, run.phase.max_grant, placement=beside_driver(),
                             hang_s=cfg.fault_tolerance.hang_timeout_s / 2, timeout_s=cfg.strategy.timeout_s,
                             backups=run.phase.backups)
    run.fleet.pause.server = run.fleet.server
    run.fleet.group.wait_ready()
    run.fleet.group.form()
    run.fleet.group.spare_pool.warm(run.fleet.data.sample)
    run.ledger.t_train_wall = time.time()
    run.give_data(run.fleet.group.ranks)
    run.ledger.totals.startup_s = time.perf_counter() - run.ledger.t0
    run.ledger.train_started = time.perf_counter()
    run.phase.phases = [{"phase": run.policies.switch.current, "mode": run.phase.spec.name, "start_step": 0, "start_s": 0.0,
                    "start_epoch": 1}]
    if run.resume is not None:
        restore(run, run.resume)
        estimate_steps(run)  # data.adaptive_batch: at the batch it had grown to
    parts = run.fleet.data.rows
    tasks = {} if run.phase.tasks is None else {"tasks": len(run.phase.tasks)}  # sandblaster's strategy.task_rows
    run.report.event("started", metric=run.metric, task=cfg.task.name, replicas=n, spares=cfg.fault_tolerance.spares,
                      steps_per_epoch=run.ledger.steps_per_epoch, partitions=len(parts),
                      rows_per_partition=[min(parts), max(parts)], **tasks,
                      startup_s=round(run.ledger.totals.startup_s, 3))
    run.report.say(f"started {n} replicas ({len(parts)} partitions"
                   + (f" in {tasks['tasks']} gradient tasks" if tasks else "")
                   + f", ~{run.ledger.steps_per_epoch} steps/epoch per replica) in {run.ledger.totals.startup_s:.1f}s")
    at = run.ledger.totals.steps
    run.report.metrics([("replicas_alive", n, at), ("replica_restarts", run.ledger.totals.replica_restarts, at),
                         ("mode", phase_switch.MODE_CODES[run.phase.spec.name], at)])
    return run.begin_epoch(run.ledger.totals.epochs + 1)


def resumed_pending(resumed: Optional[SavedState]) -> Pending:
    """What the run carries into its first epoch: nothing pending, or (resumed from a checkpoint
    taken while a switch was on probation) that switch's guard, still judging: the epoch ends it
    has left roll the switch back if the loss rose, as they would have without the restart (the
    replicas were started on probation until its last epoch: RunContext). `resumed`: the
    checkpoint the run goes on from, if any."""
    held = resumed.probation if resumed is not None else None
    return Pending(guard=Guard.from_saved(Probation.of(resolve_probation(held))))


def estimate_steps(run: "RunContext") -> None:
    """The display's steps per epoch per replica: every partition (sandblaster's task) leased cut
    into steps of the batch (x data.accumulate), shared among the replicas."""
    b = run.fleet.elastic.batch.value * run.cfg.data.accumulate
    n = len(run.fleet.group.ranks) or run.cfg.scaling.replicas
    run.ledger.steps_per_epoch = -(-sum(-(-r // b) for r in run.phase.lease_plan[0]) // n)


def restore(run: "RunContext", state: dict[str, Any]) -> None:
    """Go on from a checkpoint: every replica loads its model, optimizer state and step; the
    shards (if any) take its parameters; then each part of the run's position goes back to
    its owner (orchestrator/persistence/run_state.py)."""
    saved = SavedState.of(state)
    ranks, step = run.fleet.group.ranks, saved.step
    payload = for_loading(saved.loadable(), run.phase.spec.split_state)
    run.fleet.group.call(ranks, "load_state", payload, what="state from the checkpoint", peers=False)
    if run.fleet.shard_group is not None:
        values = run.fleet.group.call([ranks[0]], "flat_parameters", what="parameters")[0]
        run.fleet.shard_group.reseed(values, run.shard_optimizer(run.phase.strategy), {r: step for r in ranks},
                                timeout_s=run.cfg.strategy.timeout_s)
        if run.phase.spec.sharded:
            run.fleet.group.call(ranks, "sync_from_shards", step, what="state from the shards", peers=False)
    run.ledger.progress.clear()  # in place: the elasticity reads the same dict
    run.ledger.progress.update({r: step for r in ranks})
    run.checkpoints.resumed(step)  # checkpoint.every_steps counts from the checkpoint gone on from
    missing = run.position.load(saved.run)
    unsaved = Position.unsaved(saved.run)  # parts the checkpoint was written without, and why
    if "failure" in missing:  # a checkpoint from before the budget was kept: the count
        run.policies.failure.load_state_dict({"restarts": run.ledger.totals.replica_restarts, "in_a_row": 0})
    place = run.ledger.in_epoch.loaded  # a checkpoint taken inside an epoch: the run goes on inside it
    inside = {"in_epoch": {"epoch": place.epoch, "partitions_done": len(place.done),
                           "partitions_begun": len(place.skips), "rows_trained": place.counts.samples}} if place else {}
    run.report.event("resumed", epoch=run.ledger.totals.epochs, step=run.ledger.totals.steps, replica_step=step, **inside,
                      phase=run.policies.switch.current, mode=run.phase.spec.name,
                      **({"parts_missing": missing} if missing else {}), **({UNSAVED: unsaved} if unsaved else {}),
                      **({"probation_until": saved.probation_until} if saved.probation else {}),
                      **({FROM_MEMORY: state[FROM_MEMORY]} if state.get(FROM_MEMORY) else {}))
    for name, why in unsaved.items():
        run.report.say(f"resumed without the checkpoint's {name} part (not saved: {why}); it starts afresh")
    where = (f"inside epoch {place.epoch} ({len(place.done)} partitions done, {len(place.skips)} begun)"
             if place else f"after epoch {run.ledger.totals.epochs}")
    run.report.say(f"resumed {where} (step {run.ledger.totals.steps + (place.counts.steps if place else 0)}) in "
                   f"{run.phase.spec.name}")
