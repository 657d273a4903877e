"""The one registry of synchronization modes: what each mode needs and how its worker is built.

Everything that differs between modes outside its update rule is a field here, so the driver
and the replicas never branch on a mode's name:
- `sharded`: its reference parameters live in ParameterShards (downpour's server copy, EASGD's
  center); evaluation and checkpoints use them;
- `lock_step(strategy)`: every replica takes the same steps (allreduce, local SGD, synchronous EASGD); a
  failure interrupts every member and the group is re-formed before anyone steps again; in the
  other modes the survivors keep stepping while a replacement joins;
- `pinned`: partitions are each replica's own (one grant call per epoch) rather than shared
  (`leases_pinned(strategy, shares)`: not with backup replicas, not while strategy.balance splits the work
  unevenly: allreduce's batch, local_sgd's periods, the mode's `balanced_share`);
- `process_group`: the replicas form a torch.distributed process group;
- `server_optimizer(optimizer_name)`: what the shards apply;
- `build_worker(...)`: the update rule (policies/rules/<mode>.py) wired to a replica's transport;
- `metrics(stats)`: the mode's own per-epoch figures, combined across replicas;
- `epoch_events(stats)`: the mode's own events of the epoch (allreduce: `backup_drops`);
- `shard_metrics(shards)`: figures the shards observed (downpour: the largest lead over the
  slowest replica at a push, `max_lead`);
- `global_batch`: each update is the mean gradient over every replica's batch (allreduce), so
  the learning rate follows the replica count on a resize (scaling.lr_scaling);
- `holds_reference` (a worker's attribute, hogwild): the model's parameters are the shards'
  shared vector itself, so loading or evaluating the reference moves nothing;
- `split_state`: the parameters, gradients and optimizer state are split across the replicas
  (fsdp): state leaves them whole through a collective on every member, and after a failure
  every member goes on from the last checkpoint (a lost slice exists nowhere else);
- `coordinated`: the replicas only compute the pass's gradient, in tasks the shards sum; the
  driver's coordinator moves the shards' values at every epoch's end (sandblaster);
- `survivors_keep_state`: after a failure in a lock-step mode only newcomers copy a survivor
  (local_sgd: replicas differ between rounds by design, and step counts with balanced periods;
  the first round in the new group reconciles them); else a survivor that applied a step the
  donor did not copies it too (allreduce).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from policies.messages import SegmentEnd
from policies.rules.allreduce import AllReduceWorker
from policies.rules.downpour import DownpourWorker
from policies.rules.easgd import EasgdWorker, default_alpha
from policies.rules.factory import make_optimizer
from policies.rules.fsdp import FsdpWorker, fsdp_metrics
from policies.rules.gossip import GossipWorker, gossip_metrics
from policies.rules.hogwild import HogwildWorker, hogwild_metrics
from policies.rules.local_sgd import LocalSgdWorker, local_sgd_metrics
from policies.rules.gradient_tasks import SandblasterWorker, sandblaster_metrics
from policies.rules.sharding import FlatParams


@dataclass(frozen=True)
class Transport:
    """What a replica gives its worker to talk through: a torch.distributed reducer
    (allreduce) or a shard client (downpour, easgd)."""

    reducer: Any = None
    client: Any = None
    task: Any = None  # the loss every mode's rule calls (policies/rules/tasks.py)
    recipe: Any = None  # the step's micro-batches, precision and clipping (policies/rules/recipe.py)
    rebuild: Any = None  # fsdp: a fresh model from the factory (a regroup shards a new one)
    adopt: Any = None  # fsdp: hands the replica the model it now trains
    sample: Any = None  # fsdp: one row to take an empty step on before any batch was seen
    fetch: Any = None  # fsdp: a tensor sent by reference (an object store ref) -> the tensor
    where: Any = None  # sandblaster: () -> the (partition, rows) of the batch being trained (the reader's)
    reader: Any = None  # sandblaster: () -> the replica's PartitionReader (its pass's tail, dropping a partition)


@dataclass(frozen=True)
class ModeSpec:
    name: str
    sharded: bool
    pinned: bool
    process_group: bool
    lock_step: Callable[[dict[str, Any]], bool]
    server_optimizer: Callable[[str], str]
    build_worker: Callable[..., Any]
    metrics: Callable[[list[SegmentEnd]], dict[str, float]]
    shard_metrics: Callable[[Any], dict[str, float]] = lambda shards: {}
    global_batch: bool = False  # one update from every replica's batch: the rate follows replicas x batch
    balanced_share: str = "batch_rows"  # strategy.balance splits the batch (rows a step) or local SGD's "period"
    survivors_keep_state: bool = False  # after a failure survivors keep their own state (the next round reconciles)
    epoch_events: Callable[[list[SegmentEnd]], list[dict[str, Any]]] = lambda stats: []  # the mode's own events
    coordinated: bool = False  # sandblaster: the replicas compute gradient tasks; the driver's coordinator
    # moves x on the shards at each epoch's end (one L-BFGS iteration per pass: orchestrator/control/passes.py)
    split_state: bool = False  # the model's state is split across the replicas (fsdp): it leaves them only whole, through
    # a collective on every member; a failure loses a slice, so every member goes on from the last checkpoint
    named_optimizer: bool = True  # the replicas step their own optimizer over the model's named parameters
    # (optimizer.no_decay's groups); False: shards update flat slices (downpour, hogwild's fallback, sandblaster)

    def leases_pinned(self, strategy: dict[str, Any], shares: Optional[list[int]] = None) -> bool:
        """Pinned leasing, unless the strategy balances the work (strategy.balance) and the
        replicas' `shares` are uneven (allreduce's rows a step, local SGD's periods: the mode's
        `balanced_share`): then a faster replica reads more partitions, from one shared queue. Backup
        replicas (allreduce's strategy.backup_replicas) always share one queue, so the rows a
        late replica drops are not the same partitions every epoch."""
        if self.pinned and strategy.get("backup_replicas"):
            return False
        if not self.pinned or not strategy.get("balance"):
            return self.pinned
        return not shares or len(set(shares)) == 1


def _allreduce_worker(model, flat, cfg, rank, world, transport):
    opt = cfg["optimizer"]
    optimizer = make_optimizer(opt, model)
    s = cfg["strategy"]
    balance = ({"window": s["balance_window"], "min_share": s["balance_min_share"], "max_share": s["balance_max_share"]}
               if s.get("balance") else None)
    return AllReduceWorker(model, optimizer, int(s["bucket_mb"] * 2**20), transport.reducer, transport.task,
                           batch=int(cfg["data"]["batch_size"]) * int(cfg["data"].get("accumulate", 1)),
                           balance=balance, compression=s.get("compression", "none"),
                           powersgd_rank=s.get("powersgd_rank", 2), backups=int(s.get("backup_replicas", 0)),
                           recipe=transport.recipe)


def _local_sgd_worker(model, flat, cfg, rank, world, transport):
    opt, s = cfg["optimizer"], cfg["strategy"]
    optimizer = make_optimizer(opt, model)
    balance = {"min_share": s["balance_min_share"], "max_share": s["balance_max_share"]} if s.get("balance") else None
    return LocalSgdWorker(model, optimizer, transport.reducer, s["period"], s["outer_lr"], s["outer_momentum"],
                          transport.task, balance=balance, recipe=transport.recipe)


def _gossip_worker(model, flat, cfg, rank, world, transport):
    return GossipWorker(model, make_optimizer(cfg["optimizer"], model), transport.reducer,
                        cfg["strategy"]["period"], transport.task, recipe=transport.recipe)


def _fsdp_worker(model, flat, cfg, rank, world, transport):
    return FsdpWorker(model, cfg["optimizer"], transport.reducer, transport.task, transport.recipe,
                      rebuild=transport.rebuild, adopt=transport.adopt, sample=transport.sample,
                      fetch=transport.fetch)


def _downpour_worker(model, flat, cfg, rank, world, transport):
    s, opt = cfg["strategy"], cfg["optimizer"]
    return DownpourWorker(model, flat, transport.client, rank, lr=opt["lr"], n_fetch=s["n_fetch"], n_push=s["n_push"],
                          max_staleness=s["max_staleness"], staleness_lr=s["staleness_lr"],
                          warmstart_steps=s["warmstart_steps"], timeout_s=s["timeout_s"], task=transport.task,
                          **({"recipe": transport.recipe} if transport.recipe is not None else {}))


def _hogwild_worker(model, flat, cfg, rank, world, transport):
    """Direct writes into the shard's shared vector, or (another node, a GPU) downpour's pushes
    and pulls every step (policies/rules/hogwild.py)."""
    s = cfg["strategy"]
    fallback = {**cfg, "strategy": {**s, "n_fetch": 1, "n_push": 1, "max_staleness": None, "staleness_lr": False,
                                    "warmstart_steps": 0}}
    return HogwildWorker(model, flat, make_optimizer(cfg["optimizer"], model.parameters()), transport.client.shared_values,
                         _downpour_worker(model, flat, fallback, rank, world, transport), transport.task,
                         **({"recipe": transport.recipe} if transport.recipe is not None else {}))


def _sandblaster_worker(model, flat, cfg, rank, world, transport):
    """A gradient worker: partition sums to the shards; the driver's coordinator moves x."""
    return SandblasterWorker(model, flat, transport.client, transport.where, transport.task, transport.recipe,
                             transport.reader)


def _easgd_worker(model, flat, cfg, rank, world, transport):
    s, opt = cfg["strategy"], cfg["optimizer"]
    if opt["name"] == "sgd":  # EAMSGD when strategy.momentum > 0
        local = make_optimizer({**opt, "momentum": s["momentum"], "kwargs": {**opt.get("kwargs", {}),
                                                                              "nesterov": s["momentum"] > 0}}, model)
    else:
        local = make_optimizer({**opt, "momentum": 0.0}, model)
    alpha = s["alpha"] if s["alpha"] is not None else default_alpha(world)
    return EasgdWorker(model, flat, local, transport.client, world, alpha, s["tau"], s["variant"], task=transport.task,
                       **({"recipe": transport.recipe} if transport.recipe is not None else {}))


def _allreduce_metrics(stats: list[SegmentEnd]) -> dict[str, float]:
    """Backup replicas: the epoch's dropped gradients and their rows, across replicas."""
    modes = [s.mode for s in stats if "dropped_steps" in s.mode]
    if not modes:
        return {}
    return {"backup_dropped_steps": sum(m["dropped_steps"] for m in modes),
            "backup_dropped_rows": sum(m["dropped_rows"] for m in modes)}


def _allreduce_events(stats: list[SegmentEnd]) -> list[dict[str, Any]]:
    """A `backup_drops` event for an epoch in which a late replica's gradient was dropped."""
    by_rank = {s.rank: s.mode["dropped_steps"] for s in stats if s.mode.get("dropped_steps")}
    if not by_rank:
        return []
    rows = {s.rank: s.mode["dropped_rows"] for s in stats if s.mode.get("dropped_steps")}
    return [{"kind": "backup_drops", "dropped_steps_by_rank": by_rank, "dropped_rows_by_rank": rows,
             "dropped_steps": sum(by_rank.values()), "dropped_rows": sum(rows.values())}]


def _downpour_metrics(stats: list[SegmentEnd]) -> dict[str, float]:
    modes = [s.mode for s in stats]
    slowest = max(s.train_s for s in stats)
    pushes = sum(m["pushes"] for m in modes)
    return {"staleness_mean": sum(m["staleness_mean"] * m["pushes"] for m in modes) / max(pushes, 1),
            "staleness_max": max(m["staleness_max"] for m in modes),
            "pushes_per_s": pushes / max(slowest, 1e-9)}


def _easgd_metrics(stats: list[SegmentEnd]) -> dict[str, float]:
    modes = [s.mode for s in stats]
    slowest = max(s.train_s for s in stats)
    return {"elastic_distance": sum(m["elastic_distance"] for m in modes) / len(modes),
            "elastic_distance_mean": sum(m["elastic_distance_mean"] for m in modes) / len(modes),
            "exchanges_per_s": sum(m["exchanges"] for m in modes) / max(slowest, 1e-9)}


MODES: dict[str, ModeSpec] = {
    "allreduce": ModeSpec("allreduce", sharded=False, pinned=True, process_group=True, lock_step=lambda s: True,
                          server_optimizer=lambda name: name, build_worker=_allreduce_worker,
                          metrics=_allreduce_metrics, epoch_events=_allreduce_events, global_batch=True),
    "downpour": ModeSpec("downpour", sharded=True, pinned=False, process_group=False, lock_step=lambda s: False,
                         server_optimizer=lambda name: name, build_worker=_downpour_worker,
                         metrics=_downpour_metrics, named_optimizer=False,
                         shard_metrics=lambda shards: {"max_lead": shards.observed_max_lead()}),
    "easgd": ModeSpec("easgd", sharded=True, pinned=False, process_group=False,
                      lock_step=lambda s: s["variant"] == "sync",
                      server_optimizer=lambda name: "sgd",  # the shards only hold the center
                      build_worker=_easgd_worker, metrics=_easgd_metrics),
    "local_sgd": ModeSpec("local_sgd", sharded=False, pinned=True, process_group=True, lock_step=lambda s: True,
                          server_optimizer=lambda name: name, build_worker=_local_sgd_worker,
                          metrics=local_sgd_metrics, balanced_share="period", survivors_keep_state=True),
    "gossip": ModeSpec("gossip", sharded=False, pinned=True, process_group=True, lock_step=lambda s: True,
                       server_optimizer=lambda name: name, build_worker=_gossip_worker, metrics=gossip_metrics,
                       survivors_keep_state=True),
    "hogwild": ModeSpec("hogwild", sharded=True, pinned=False, process_group=False, lock_step=lambda s: False,
                        server_optimizer=lambda name: name, build_worker=_hogwild_worker, metrics=hogwild_metrics,
                        named_optimizer=False),
    "fsdp": ModeSpec("fsdp", sharded=False, pinned=True, process_group=True, lock_step=lambda s: True,
                     server_optimizer=lambda name: name, build_worker=_fsdp_worker, metrics=fsdp_metrics,
                     global_batch=True, split_state=True),
    "sandblaster": ModeSpec("sandblaster", sharded=True, pinned=False, process_group=False, lock_step=lambda s: False,
                            server_optimizer=lambda name: "sgd",  # the shards' optimizer is never applied: x moves by
                            build_worker=_sandblaster_worker,    # the coordinator's operations
                            metrics=sandblaster_metrics, coordinated=True, named_optimizer=False),
}


def mode_spec(name: str) -> ModeSpec:
    return MODES[name]


def build_worker(model: torch.nn.Module, cfg: dict[str, Any], rank: int, world: int,
                 transport: Transport) -> tuple[Any, Optional[FlatParams]]:
    """(The mode's worker, the flat parameter view sharded modes push and pull through)."""
    spec = MODES[cfg["strategy"]["mode"]]
    flat = FlatParams(list(model.parameters())) if spec.sharded else None
    return spec.build_worker(model, flat, cfg, rank, world, transport), flat
