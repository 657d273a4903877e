"""Starting: the run's first state. The mode's shards are launched beside the driver, the data
placed (in-memory partitions put into the object store once, or a file source's plan), the
partition server started, the replicas' process group formed and their data given, a resumed
run's checkpoint loaded (each part of its position back to its owner: orchestrator/run_state.py),
and the first epoch's segment opened."""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

import ray

from orchestrator import switching
from orchestrator.cluster import beside_driver
from orchestrator.placement import place_data
from orchestrator.run_state import UNSAVED, Position
from orchestrator.states import EpochSegment
from policies.leases import MAX_GRANT
from policies.registry import mode_spec

if TYPE_CHECKING:
    from orchestrator.controller import Controller


def launch_shards(ctl: "Controller") -> None:
    """ParameterShards holding the initial parameters (the same factory and seed as every
    replica), cut into balanced slices of the flat vector, snapshotted for rebuilds."""
    import torch

    from orchestrator.shard_group import ShardGroup
    from orchestrator.factory import build_model
    from policies.sharding import shard_bounds

    cfg = ctl.cfg
    model = build_model(cfg.model.factory, cfg.model.kwargs, cfg.data.seed)
    initial = torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad]).numpy()
    bounds = shard_bounds(initial.size, cfg.scaling.shards)
    first_sharded = next(p for p in ctl.switch_policy.plan if mode_spec(p["mode"]).sharded)
    name, lr, momentum, weight_decay = ctl.shard_optimizer(first_sharded)
    ctl.shard_group = ShardGroup.create(initial, bounds, name, lr, momentum, weight_decay, cfg.scaling.replicas,
                                         cfg.fault_tolerance.shard_snapshot_every_s,
                                         name_prefix=f"eo-{uuid.uuid4().hex[:12]}", placement=beside_driver(),
                                         hang_s=cfg.fault_tolerance.hang_timeout_s / 2)

def start(ctl: "Controller") -> EpochSegment:
    from orchestrator.server_link import ServerLink

    if not ctl.group.members:
        ctl.launch()
    cfg, n = ctl.cfg, ctl.cfg.scaling.replicas
    # in-memory data: partitions put once; a file source: only its plan (orchestrator/placement.py)
    ctl.data = place_data(ctl.dataset, cfg.data.partitions or 4 * n, cfg.data.seed)
    rows = ctl.data.rows
    bs = cfg.data.batch_size
    ctl.steps_per_epoch = -(-sum(-(-r // bs) for r in rows) // n)  # the display's estimate
    ctl.lease_plan = (rows, n, cfg.data.seed, ctl.pinned, cfg.data.shuffle)
    # a run that can switch modes is granted one partition at a time: every partition boundary
    # is a point where a replica can hear a pause (two at a time saves calls otherwise)
    ctl.max_grant = 1 if len(ctl.switch_policy.plan) > 1 else MAX_GRANT
    ctl.server = ServerLink(*ctl.lease_plan, ctl.max_grant, placement=beside_driver(),
                             hang_s=cfg.fault_tolerance.hang_timeout_s / 2, timeout_s=cfg.strategy.timeout_s)
    ctl.group.wait_ready()
    ctl.group.form()
    ctl.group.warm_spares(ctl.data.sample)
    ctl.t_train_wall = time.time()
    ctl.give_data(ctl.group.ranks)
    ctl.totals.startup_s = time.perf_counter() - ctl.t0
    ctl.train_started = time.perf_counter()
    ctl.phases = [{"phase": ctl.switch_policy.current, "mode": ctl.spec.name, "start_step": 0, "start_s": 0.0,
                    "start_epoch": 1}]
    if ctl.resume is not None:
        restore(ctl, ctl.resume)
    ctl.report.event("started", metric=ctl.metric, task=cfg.task.name, replicas=n, spares=cfg.fault_tolerance.spares,
                      steps_per_epoch=ctl.steps_per_epoch, partitions=len(rows),
                      rows_per_partition=[min(rows), max(rows)], startup_s=round(ctl.totals.startup_s, 3))
    ctl.report.say(f"started {n} replicas ({len(rows)} partitions, ~{ctl.steps_per_epoch} steps/epoch per "
                    f"replica) in {ctl.totals.startup_s:.1f}s")
    at = ctl.totals.steps
    ctl.report.metrics([("replicas_alive", n, at), ("replica_restarts", ctl.totals.replica_restarts, at),
                         ("mode", switching.MODE_CODES[ctl.spec.name], at)])
    return ctl.begin_epoch(ctl.totals.epochs + 1)

def restore(ctl: "Controller", state: dict[str, Any]) -> None:
    """Go on from a checkpoint: every replica loads its model, optimizer state and step; the
    shards (if any) take its parameters; then each part of the run's position goes back to
    its owner (orchestrator/run_state.py)."""
    ranks, step = ctl.group.ranks, state["step"]
    payload = ray.put({"model": state["model"], "optimizer": state["optimizer"], "step": step,
                       "recipe": state.get("recipe"), "worker": state.get("worker")})
    ctl.group.call(ranks, "load_state", payload, what="state from the checkpoint", peers=False)
    if ctl.shard_group is not None:
        values = ctl.group.call([ranks[0]], "flat_parameters", what="parameters")[0]
        ctl.shard_group.reseed(values, ctl.shard_optimizer(ctl.strategy), {r: step for r in ranks},
                                timeout_s=ctl.cfg.strategy.timeout_s)
        if ctl.spec.sharded:
            ctl.group.call(ranks, "sync_from_shards", step, what="state from the shards", peers=False)
    ctl.progress = {r: step for r in ranks}
    missing = ctl.position.load(state["run"])
    unsaved = Position.unsaved(state["run"])  # parts the checkpoint was written without, and why
    if "failure" in missing:  # a checkpoint from before the budget was kept: the count
        ctl.failure_policy.restore({"restarts": ctl.totals.replica_restarts, "in_a_row": 0})
    ctl.report.event("resumed", epoch=ctl.totals.epochs, step=ctl.totals.steps, replica_step=step,
                      phase=ctl.switch_policy.current, mode=ctl.spec.name,
                      **({"parts_missing": missing} if missing else {}), **({UNSAVED: unsaved} if unsaved else {}))
    for name, why in unsaved.items():
        ctl.report.say(f"resumed without the checkpoint's {name} part (not saved: {why}); it starts afresh")
    ctl.report.say(f"resumed after epoch {ctl.totals.epochs} (step {ctl.totals.steps}) in {ctl.spec.name}")
