"""ModelReplica: one model copy in a Ray actor. It holds state and moves tensors; the update
rule it runs lives in policies/rules/<mode>.py (a *Worker), the decisions in the driver.

A replica runs a whole epoch on its own (`run_epoch`) and is never called per step; it streams
progress rows back to the driver as a Ray streaming generator while the epoch runs. (A second
concurrency group for polling was tried first: running the step loop off the actor's main
thread cost ~10% of step throughput.)

Membership changes: a step that cannot complete because a peer died (a failed collective, an
aborted EASGD round) raises `Interrupted`; the replica leaves its process group at once (which
fails its peers' pending collectives too, so nobody waits for the collective timeout), keeps
its place in the epoch (the interrupted batch is taken again), and ends the segment with an
"interrupted" item. The controller then re-forms the group (`join_group` with a fresh store per
generation), hands state to newcomers (`export_state` / `load_state` / `sync_from_shards`), and
calls `run_epoch(..., resume=True)`. A spare is a replica built with `rank=None`: its process
and model exist, it holds no CPU and no data until `assign` gives it a rank.

Actors import only `actors` and `policies`, never the driver package.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import numpy as np
import ray
import torch
import torch.distributed as dist

from actors.replica import epoch_loop
from actors.replica.heap import keep_heap, return_big_buffers
from actors.partitions.reader import PartitionReader
from actors.replica.rates import Rates
from actors.replica.reducer import EmulatedLink, ProcessGroupReducer, free_port, group_backend, new_process_group
from actors.partitions.reading import StreamPlan, count_kept, read_range, eval_pieces
from actors.shards.client import RayShardClient
from policies.messages import ModeSet
from policies.rules.factory import build_model, carry_optimizer_state, momentum_buffers, set_momentum_buffers
from policies.rules.outputs import run_model
from policies.rules.batches import as_tensors, forward, rows as batch_rows, slice_rows, to_device, tree_map
from policies.rules.recipe import Recipe
from policies.rules.registry import Transport, build_worker, mode_spec
from policies.rules.tasks import add_stats, load_task
from actors.replica.reference import load_reference, reference_loaded
from actors.replica.rehearsal import rehearse
from actors.replica.straggler import replica_device, sleep_unless_late, straggler_delay

@ray.remote
class ModelReplica:
    def __init__(self, rank: Optional[int], world_size: int, config: dict[str, Any], shards: Any = None) -> None:
        """`rank` None: a spare (see `assign`). `shards`: the shard directory (sharded modes)."""
        self.cfg = config
        torch.set_num_threads(max(1, int(config["scaling"]["cpus_per_replica"])))
        self.device = replica_device(config["scaling"]["gpus_per_replica"])
        # a step's activations are reused, not given back and faulted in again; fsdp on the CPU gives its
        # gathered units back instead (actors/replica/heap.py)
        split = mode_spec(config["strategy"]["mode"]).split_state and self.device.type == "cpu"
        (return_big_buffers if split else keep_heap)()
        self.model = build_model(config["model"]["factory"], config["model"]["kwargs"], config["data"]["seed"]).to(self.device)
        if config["model"].get("compile"):  # once per replica process: a switch or a reload keeps the compiled forward
            self.model.forward = torch.compile(self.model.forward)  # the module's own state_dict keys stay
        self.task = load_task(config["task"]["name"], config["task"]["kwargs"])
        self.base_optimizer = dict(config["optimizer"])
        self._take_strategy(config["strategy"])
        self.shards = shards
        self.flat = None
        self.client = None
        self.worker = None
        self.reducer = None
        self.slow: list[dict[str, Any]] = []
        self.t_train_wall = time.time()  # when the run's training started (faults.slow_replicas from_s/to_s)
        self.rank, self.world_size = None, world_size
        self.step = 0
        self.generation = 0
        self.cursor: Optional[dict[str, Any]] = None  # the epoch in progress: its batches and where we are
        self.has_buffers = any(True for _ in self.model.buffers())
        self.rates = Rates(config["optimizer"].get("schedule"), config.get("schedule_steps", 1))  # schedule x ramp
        self.recipe = Recipe.from_config(config, self.device)  # micro-batches, precision, clipping (policies/rules/recipe.py)
        self.probation_until = config.get("probation_until", -1)  # a switch's: non-finite losses skipped (set_mode)
        if config.get("multi_phase"):  # torch.optim's first use imports ~1 s of modules: not in a switch
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
        if rank is not None:
            self.assign(rank, world_size)

    def assign(self, rank: int, world_size: int, strategy: Optional[dict[str, Any]] = None,
               probation_until: int = -1) -> int:
        """Take a rank: build the mode's worker (a spare does this when put to use). `strategy`,
        `probation_until`: the phase's strategy when not the one the replica was built with, and its
        switch's probation (set_mode). Returns the process id (the controller and faults address it)."""
        if strategy is not None:
            self._take_strategy(strategy)
            self.probation_until = probation_until
        self.rank, self.world_size, faults = rank, world_size, self.cfg["faults"]
        link = EmulatedLink(faults["link_gbps"], faults["link_latency_us"]) if faults.get("link_gbps") else None
        self.reducer = ProcessGroupReducer(link)
        self.slow = [w for w in self.cfg["faults"]["slow_replicas"] if w["rank"] == rank]
        self._build_worker()
        return os.getpid()

    def _take_strategy(self, strategy: dict[str, Any]) -> None:
        """The phase's strategy, its mode, and the optimizer settings with the phase's overrides."""
        self.cfg["strategy"] = strategy
        self.cfg["optimizer"] = {**self.base_optimizer, **(strategy.get("optimizer") or {})}
        self.spec = mode_spec(strategy["mode"])

    def _build_worker(self) -> None:
        s = self.cfg["strategy"]
        if self.spec.sharded and self.client is None:
            self.client = RayShardClient(self.shards, s["max_in_flight"], s["timeout_s"])
        self.worker, self.flat = build_worker(self.model, self.cfg, self.rank, self.world_size,
                                              Transport(self.reducer, self.client if self.spec.sharded else None, self.task,
                                                        self.recipe, rebuild=self._fresh_model, adopt=self._adopt,
                                                        sample=self._one_row, fetch=self._fetch,
                                                        where=lambda: self.reader.out[0],
                                                        reader=lambda: self.reader))
        self.apply_lr()
        if self.slow and getattr(self.worker, "straggles_inside", False):
            self.worker.straggle = self.slow_down  # backups: the delay before the gradient is ready, cut short when late

    def set_mode(self, strategy: dict[str, Any], load_reference: bool, probation_until: int = -1) -> ModeSet:
        """Change the update rule in place (a phase switch): the old worker lets go of the model
        (allreduce's gradient hooks removed), the new mode's worker is built over the same model,
        data cursor and step count. `load_reference`: first copy the shards' reference
        parameters and buffers into the model (downpour's server copy, EASGD's center), so every
        replica starts the new phase from the same point. The old worker's local optimizer
        state (momentum buffers) is carried into the new one's when both keep one of the same
        kind (`carry_optimizer_state`); into allreduce the controller then averages it across
        the replicas (`momentum` / `set_momentum`). `probation_until`: the last epoch the switch's
        guard looks at; until its end a non-finite loss skips the step (Recipe.finite). Returns
        what was carried, for the event."""
        old, self.probation_until = self.worker, probation_until
        release = getattr(old, "release", None)
        if release is not None:
            release()
        self._take_strategy(strategy)
        if load_reference:
            self._load_reference()
        self._build_worker()
        if hasattr(self.worker, "step_count"):
            self.worker.step_count = self.step
        carried = carry_optimizer_state(getattr(old, "optimizer", None), getattr(self.worker, "optimizer", None))
        return ModeSet(self.rank, self.step, carried)

    def momentum(self) -> Optional[dict[str, np.ndarray]]:
        """The local optimizer's per-element state (momentum buffers, Adam's moments), flat per
        state key (None: it keeps none)."""
        flat = momentum_buffers(getattr(self.worker, "optimizer", None))
        return None if flat is None else {k: v.cpu().numpy() for k, v in flat.items()}

    def set_momentum(self, flat: dict[str, np.ndarray]) -> None:
        set_momentum_buffers(self.worker.optimizer, {k: torch.from_numpy(v).to(self.device) for k, v in flat.items()})

    def _load_reference(self) -> None:
        load_reference(self)

    def _fresh_model(self) -> torch.nn.Module:
        """The factory's model (fsdp: a regroup shards a fresh one)."""
        m = self.cfg["model"]
        return build_model(m["factory"], m["kwargs"], self.cfg["data"]["seed"]).to(self.device)

    def _fetch(self, x: Any) -> Any:
        """A tensor sent by reference (fsdp's state, one object a tensor) as the tensor."""
        return ray.get(x, timeout=self.cfg["strategy"]["timeout_s"]) if isinstance(x, ray.ObjectRef) else x

    def _adopt(self, model: torch.nn.Module) -> None:
        self.model = model

    def _one_row(self) -> tuple[Any, Any]:
        """One row of this replica's test slice: an empty fsdp step's input before any batch."""
        x, y = next(self.test_batches())
        return slice_rows(x, 0, 1), slice_rows(y, 0, 1)

    def slow_down(self, step_s: float, late: Optional[Callable[[], bool]] = None) -> None:
        """faults.slow_replicas: sleep as the windows active now say (a deliberate straggler;
        actors/replica/straggler.py). `late`: True ends the sleep (a backup replica whose
        gradient the step no longer needs stops working)."""
        sleep_unless_late(straggler_delay(self.slow, self.step, time.time() - self.t_train_wall, step_s), late)

    def node_id(self) -> str:
        """The Ray node this replica runs on (the controller checks it when the replica dies)."""
        return ray.get_runtime_context().get_node_id()

    def set_lr_scale(self, ramp: dict[str, float]) -> Optional[float]:
        """From now on, modes with a global batch step at optimizer.lr times the factor the
        resize schedule gives (policies/decisions/lr_scaling.py: a ramp from `start` at step `from_step` to
        `target` over `steps` steps), on `batch_size` rows (data.adaptive_batch). Returns the rate
        the next step uses (None: no local optimizer)."""
        self.rates.ramp = {k: v for k, v in ramp.items() if k != "batch_size"}
        epoch_loop.rebatch(self, int(ramp.get("batch_size") or self.cfg["data"]["batch_size"]))
        self.apply_lr()
        return self.current_lr()

    @property
    def lr_moves(self) -> bool:
        return self.rates.moving

    def apply_lr(self) -> None:
        """The rate for the next step into the mode's worker (actors/replica/rates.py)."""
        self.rates.apply(self.worker, self.cfg["optimizer"]["lr"], self.step, self.spec.global_batch)

    def current_lr(self) -> Optional[float]:
        return Rates.current(self.worker, self.cfg["optimizer"]["lr"])

    def pid(self) -> int:
        return os.getpid()

    def current_step(self) -> int:
        return self.step

    def warm_up(self, sample: list, rows: int = 32) -> dict[str, float]:
        """A spare's rehearsal (actors/replica/rehearsal.py): one step on `rows` rows of `sample` (a
        ref in a list) and a one-member gloo group, the model put back as it was. Returns its
        seconds and the CPU seconds this process has used since it started (its whole start-up:
        imports, model, rehearsal), what a new spare costs the node it starts on."""
        seconds = rehearse(self, sample, rows)
        return {"rehearsal_s": seconds, "cpu_s": time.process_time()}

    # ---- process group -------------------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        """Where this replica, as group rank 0, will host the TCP store the group meets at (a
        new port each generation: a fresh store)."""
        return ray.util.get_node_ip_address(), free_port()

    def join_group(self, addr: str, port: int, group_rank: int, world_size: int, generation: int,
                   timeout_s: float) -> int:
        """Join generation `generation` of the process group: a fresh TCP store (hosted by group
        rank 0 on a new port) and a new process group over it, in this same process: NCCL when
        this replica has a GPU of its own, gloo on the CPU or a shared GPU (`group_backend`).
        `timeout_s` bounds every collective: a peer that stops answering fails the step."""
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(addr, port, world_size, group_rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore(f"generation-{generation}", store)
        backend = group_backend(self.device, self.cfg["scaling"]["gpus_per_replica"])
        pg = new_process_group(prefixed, group_rank, world_size, backend, timeout, default=self.spec.split_state)
        self.reducer.configure(prefixed, pg, timeout_s, keep=store)  # group rank 0 hosts the store: kept with the group
        self.generation, self.world_size = generation, world_size
        return group_rank

    def leave_group(self) -> None:
        """This generation is over for this replica: tell the other members (they leave their
        waits within a slice); the group itself is abandoned when the next one is formed."""
        if getattr(self, "reducer", None) is not None and self.reducer.pg is not None:
            self.reducer.abort()

    def regroup(self, world_size: int, generation: int) -> None:
        """Modes without a process group: the new membership (e.g. synchronous EASGD's round size)."""
        self.generation, self.world_size = generation, world_size
        regroup = getattr(self.worker, "regroup", None)
        if regroup is not None:
            regroup(world_size, generation)

    # ---- state transfer ------------------------------------------------------------------
    def export_state(self) -> dict[str, Any]:
        """This replica's own parameters, buffers and optimizer state, and its step count (fsdp:
        its slices of the model's, the driver joins the members': policies/rules/split_state.py)."""
        share = getattr(self.worker, "share", None)
        if share is not None:
            return {**share(), "step": self.step, "worker": None, "recipe": self.recipe.state_dict()}
        opt = getattr(self.worker, "optimizer", None)
        return {"model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
                "optimizer": opt.state_dict() if opt is not None else None, "step": self.step,
                "worker": self._worker_state(), "recipe": self.recipe.state_dict()}

    def _worker_state(self) -> Optional[dict[str, Any]]:
        """What the mode's worker keeps beside the model (local SGD's global model and outer
        momentum), for a copy of this replica; None when it keeps nothing."""
        export = getattr(self.worker, "export", None)
        return export() if export is not None else None

    def load_state(self, state: Optional[dict[str, Any]]) -> int:
        """Become a copy of the replica `state` was exported from (allreduce's state transfer; fsdp:
        the whole model's, sharded at the next step; None: the factory's initial model at step 0)."""
        opt = getattr(self.worker, "optimizer", None)
        if hasattr(self.worker, "load_full"):
            self.worker.load_full(None if state is None else {"model": state["model"], "optimizer": state["optimizer"]})
            state = state or {"step": 0}
        else:
            self.model.load_state_dict(state["model"])
            if opt is not None and state["optimizer"] is not None:
                opt.load_state_dict(state["optimizer"])
        load = getattr(self.worker, "load", None)
        if load is not None:
            load(state.get("worker"))
        self.recipe.load_state_dict(state.get("recipe"))
        self.step = state["step"]
        self.apply_lr()
        return self.step

    def sync_from_shards(self, step: int) -> int:
        """Sharded modes: start from the shards' reference parameters (Downpour's server copy,
        EASGD's center) and the module buffers averaged there, at step `step`."""
        self._load_reference()
        self.step = step
        if hasattr(self.worker, "step_count"):
            self.worker.step_count = step
        self.apply_lr()
        return step

    # ---- data ----------------------------------------------------------------------------
    def set_data(self, server, train_parts: list, test_part: list, test_slice: tuple[int, int],
                 t_train_wall: Optional[float] = None, tasks: Optional[list] = None) -> int:
        """The PartitionServer to lease train partitions from, the train partitions' refs, and
        this replica's slice of the test split (refs wrapped in lists so Ray passes them through
        unresolved). `t_train_wall`: when the run's training started (wall clock). `tasks`:
        sandblaster's tasks as slices of partitions (strategy.task_rows; PartitionReader)."""
        if t_train_wall is not None:
            self.t_train_wall = t_train_wall
        data = self.cfg["data"]
        self.reader = PartitionReader(server, train_parts[0], self.rank, data["batch_size"] * data.get("accumulate", 1),
                                      data["shuffle"],
                                      self.device, self.cfg["strategy"]["timeout_s"], data.get("prefetch_partitions", 2),
                                      tasks=tasks)
        return self.set_test_slice(test_part, test_slice)

    def set_test_slice(self, test_part: list, test_slice: Any) -> int:
        """In memory: the test split's ref (in a list) and this replica's [lo, hi) slice of it,
        copied here. A file source: the test plan and this replica's list of position ranges,
        read a piece at a time by each evaluation (actors/partitions/reading.py). Returns the test rows."""
        if isinstance(test_part[0], StreamPlan):
            self.test_plan, self.test_ranges = test_part[0], list(test_slice)
            self.test_x = self.test_y = None
            return sum(count_kept(self.test_plan, lo, hi) for lo, hi in self.test_ranges)
        self.test_plan = None
        test = ray.get(test_part[0], timeout=self.cfg["strategy"]["timeout_s"])
        lo, hi = test_slice
        self.test_x = as_tensors(tree_map(lambda a: a[lo:hi].copy(), test["x"]))
        self.test_y = as_tensors(tree_map(lambda a: a[lo:hi].copy(), test["y"]))
        return hi - lo

    def test_batches(self) -> Iterator[tuple[Any, Any]]:
        """This replica's share of the test split in batches of data.batch_size (inputs,
        targets; each a tensor or a dict of tensors), on the replica's device. A file source's
        share is read a piece at a time (memory bounded by the piece, not the share)."""
        batch = self.cfg["data"]["batch_size"]
        pieces = ([(self.test_x, self.test_y)] if self.test_plan is None else
                  ((as_tensors(p["x"]), as_tensors(p["y"]))
                   for p in (read_range(self.test_plan, lo, hi) for lo, hi in eval_pieces(self.test_plan, self.test_ranges))))
        for x, y in pieces:
            for lo in range(0, batch_rows(y), batch):
                yield (to_device(slice_rows(x, lo, lo + batch), self.device),
                       to_device(slice_rows(y, lo, lo + batch), self.device))

    # ---- training ------------------------------------------------------------------------
    def run_epoch(self, epoch: int, log_every: int, trace_ids: "bool | str" = False,
                  first_grant: Optional[dict] = None, resume: bool = False,
                  announce: bool = False) -> Iterator[dict[str, Any]]:
        """Lease partitions and take steps of the mode's rule until the server has no more for
        this replica this epoch; a Ray streaming generator of progress rows and the segment's end
        (the loop and its arguments: actors/replica/epoch_loop.py)."""
        yield from epoch_loop.run_epoch(self, epoch, log_every, trace_ids, first_grant, resume, announce)

    def gradient_tasks(self, pass_id: int, partitions: list[int]) -> list[bool]:
        """sandblaster: tasks (partitions) of pass `pass_id` computed here, outside the epoch's
        loop, and pushed to the shards: the coordinator's fill-in of tasks no shard holds. For
        each, whether it counted."""
        return [self.worker.fill(pass_id, p, self.reader.task_batches(p)) for p in partitions]

    def evaluate(self) -> dict[str, Any]:
        """The task's evaluation sums (policies/rules/tasks.py) over this replica's slice of the test
        split; the driver adds every replica's and finishes them into metrics. Batches of
        data.batch_size: small batches stay in cache and run ~2x faster than one big one on CPU.
        Under inference mode, or the rule's own setting (fsdp: `evaluating`)."""
        setting = getattr(self.worker, "evaluating", None)
        with (torch.inference_mode() if setting is None else setting()):
            self.model.eval()  # (after the setting: fsdp may have sharded in a new model)
            sums: dict[str, Any] = {}
            lock_step = getattr(self.worker, "in_lock_step", None)  # fsdp: every member runs as many forwards
            for x, y in (self.test_batches() if lock_step is None else lock_step(self.test_batches())):
                if y is None:  # (fsdp's padding: no rows of this replica's; the forward keeps the lock step)
                    forward(self.model, x)
                else:
                    sums = add_stats(sums, self.task.evaluate(run_model(self.model, self.task, x, y), y))
        return sums

    # ---- state ---------------------------------------------------------------------------
    def flat_parameters(self) -> np.ndarray:
        """The trainable parameters as one flat vector: the layout of the shards and FlatParams
        (a frozen parameter is in neither)."""
        return torch.cat([p.detach().reshape(-1).cpu() for p in self.model.parameters() if p.requires_grad]).numpy()

    def local_buffers(self) -> dict[str, np.ndarray]:
        """This replica's module buffers (e.g. BatchNorm running statistics) as numpy arrays."""
        return {name: b.detach().cpu().numpy().copy() for name, b in self.model.named_buffers()}

    def evaluate_reference(self) -> dict[str, Any]:
        """Sharded modes: evaluate the mode's reference model (Downpour's server copy, EASGD's
        center, with the replicas' buffers averaged) on this replica's test slice, then put the
        local parameters and buffers back."""
        with self._reference_loaded():
            return self.evaluate()

    def state(self) -> dict[str, Any]:
        """The mode's reference model (plus this replica's optimizer) for a checkpoint (fsdp: this
        replica's slices: export_state)."""
        if self.spec.split_state:
            return self.export_state()
        with self._reference_loaded():
            model = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        opt = getattr(self.worker, "optimizer", None)
        return {"model": model, "optimizer": opt.state_dict() if opt is not None else None, "step": self.step,
                "worker": self._worker_state(), "recipe": self.recipe.state_dict()}

    def _reference_loaded(self):
        return reference_loaded(self)
