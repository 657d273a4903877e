"""fsdp: sharded data parallel with torch's own `fully_shard` (FSDP2), the whole rule in one file.

The update is allreduce's: each step applies the mean gradient over every row the replicas
trained on that step, so an fsdp run takes the same steps as an allreduce run (and as one
process on the union of the batches). What differs is where the state lives. Every parameter
is a DTensor split in dim 0 across the p replicas of the process group; its gradient and the
optimizer's state (momentum, Adam's moments) are split the same way, so a replica holds
about 1/p of the parameters, gradients and optimizer state (`state_bytes`):

    forward / backward of a unit:  all-gather its parameters, compute, free them again
    after the unit's backward:     reduce-scatter its gradients (summed: divide factor 1)
    the step:                      g = (sum of the replicas' summed-loss gradients) / rows,
                                   clipped on its global norm, then the optimizer on each slice

Units (`shard_units`): each child of the model that holds parameters, descending into
ModuleList / ModuleDict; the root takes what is left. A unit's full parameters exist only while
it runs, so a replica's peak is its slice plus the largest unit (`estimate_bytes`).

Lock step as allreduce: a step first sums three floats (this replica's rows, "another batch
follows", "pause"); a replica whose data ran out takes part in the collectives with one row
of its last batch weighted zero, and when no replica has a row left the step is skipped by
all alike. The step's loss sum is one more float summed after the backward pass.

State leaves a replica in slices (`share`: its own rows of each split tensor, no collective;
the driver joins the members', policies/rules/split_state.py) and enters it the same way:
`load_full` takes a whole state (its tensors one object each) and, once the worker has sharded
a fresh model over its group, keeps only its rows, one tensor at a time. A regroup (a failure,
a resize) rebuilds the model from the factory, shards it over the new group, and loads the
state the controller sends (the last checkpoint's after a failure: a lost replica's slice
exists nowhere else). Evaluation runs the sharded model in lock step (`in_lock_step`): each replica its own test
slice, padded with forwards on one row so every member gathers each unit as often.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from policies.rules.allreduce import reducer_group
from policies.rules.batches import rows as batch_rows, slice_rows
from policies.rules.outputs import run_model
from policies.rules.modes import Interrupted, StepResult
from policies.rules.recipe import Recipe, make_optimizer
from policies.rules.split_state import load_sliced, resolved, slices
from policies.rules.tasks import Classification, Task

CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)
PEER_GONE = ("connection", "timed out", "timeout", "broken pipe", "reset by peer", "closed", "aborted")


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules sharded as units, in order: each child holding parameters (a ModuleList's or
    ModuleDict's children in its place)."""
    units: list[torch.nn.Module] = []
    for child in model.children():
        if isinstance(child, CONTAINERS):
            units.extend(shard_units(child))
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units


def optimizer_slots(spec: dict[str, Any]) -> int:
    """Tensors of a parameter's size the optimizer keeps per parameter (SGD with momentum 1,
    Adam 2, ...), found by one step of the class on a probe parameter."""
    probe = torch.nn.Parameter(torch.zeros(3))
    opt = make_optimizer({**spec, "no_decay": []}, [probe])
    probe.grad = torch.ones(3)
    opt.step()
    return sum(1 for v in opt.state[probe].values() if torch.is_tensor(v) and v.numel() == 3)


def estimate_bytes(model: torch.nn.Module, spec: dict[str, Any], replicas: int, split: bool) -> int:
    """A replica's bytes of parameters, gradients and optimizer state: (2 + slots) x the model's
    trainable parameters, divided by `replicas` when `split` (fsdp), plus the largest unit's
    parameters and gradients whole while it runs."""
    params = [p for p in model.parameters() if p.requires_grad]
    size = sum(p.numel() * p.element_size() for p in params)
    per = (2 + optimizer_slots(spec)) * size
    if not split:
        return per
    largest = max((sum(p.numel() * p.element_size() for p in u.parameters() if p.requires_grad)
                   for u in shard_units(model)), default=0)
    return math.ceil(per / max(1, replicas)) + 2 * largest


def collective_failed(exc: BaseException) -> bool:
    """Whether `exc` is a collective of the group failing (a peer died or left), not the step's own error."""
    import torch.distributed as dist

    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or any(k in text for k in PEER_GONE)


@contextlib.contextmanager
def collectives(what: str):
    """A failed collective inside the block is `Interrupted` (the replica regroups), not an error."""
    try:
        yield
    except Interrupted:
        raise
    except RuntimeError as exc:
        if not collective_failed(exc):
            raise
        raise Interrupted(f"fsdp {what}: a collective failed ({str(exc).splitlines()[0][:200]})") from None


def local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class FsdpWorker:
    """The replica-side loop body of fsdp (policies/rules/modes.py's shape). `rebuild()`: a fresh
    unsharded model from the factory; `adopt(model)`: the replica takes it as its model (after a
    regroup); `sample()`: one row (x, y) to step on when this replica never had a batch;
    `fetch(x)`: a tensor sent by reference (an object store ref) as the tensor, else x."""

    lock_step = True

    def __init__(self, model: torch.nn.Module, spec: dict[str, Any], reducer: Any, task: Optional[Task] = None,
                 recipe: Optional[Recipe] = None, rebuild: Optional[Callable[..., torch.nn.Module]] = None,
                 adopt: Optional[Callable[[torch.nn.Module], None]] = None,
                 sample: Optional[Callable[[], tuple[Any, Any]]] = None,
                 fetch: Optional[Callable[[Any], Any]] = None) -> None:
        self.model, self.spec, self.reducer = model, spec, reducer
        self.fetch = fetch or (lambda x: x)
        self.task, self.recipe = task or Classification(), recipe or Recipe()
        self.rebuild, self.adopt, self.sample = rebuild, adopt, sample
        self.optimizer = make_optimizer(spec, model)  # the unsharded model's until the first step
        self.group: Optional[tuple[int, int]] = None
        self.sharded = False
        self.pending: Optional[dict[str, Any]] = None  # a full state to load when (re)sharding
        self.dummy: Optional[tuple[Any, Any]] = None  # one row of the last batch: an empty step's input
        self.last: dict[str, Any] = {}

    # ---- sharding ----------------------------------------------------------------------
    def _fit_group(self) -> None:
        """At the first step in a group: shard the model over it (a regroup: a fresh model from
        the factory), then load the pending whole state's rows this rank holds."""
        group = reducer_group(self.reducer)
        if group == self.group:
            return
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self.sharded:
            if self.pending is None:
                raise RuntimeError("fsdp: the group changed and no full state was loaded to shard over it")
            self.model = self.rebuild()
            self.adopt(self.model)
        device = next(self.model.parameters()).device
        mesh = DeviceMesh.from_group(self.reducer.pg, device.type)
        for unit in shard_units(self.model):
            fully_shard(unit, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        for unit in self.model.modules():  # summed, not averaged: the step divides by its rows
            if isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no pre-multiplied one
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.optimizer = make_optimizer(self.spec, self.model)
        for g, h in zip(self.optimizer.param_groups, hyper):
            g.update(h)  # the rate the replica set, the schedule's
        if self.pending is not None:
            load_sliced(self.model, self.optimizer, self.pending, group[0], group[1], self.fetch)
        self.pending, self.group, self.sharded = None, group, True

    def share(self) -> dict[str, Any]:
        """This replica's part of the model's state, no collective: once sharded, its slices
        ({"slices": {"model", "optimizer"}, "rank"}: split_state.slices, joined by the driver);
        before (a state loaded, or the model as built, not sharded yet) the whole state it
        holds ({"whole": ...}: any member's will do)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        if self.pending is not None:  # loaded and not yet sharded: that state is this replica's
            return {"whole": resolved(self.pending, self.fetch)}
        if not self.sharded:
            return {"whole": {"model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
                              "optimizer": get_optimizer_state_dict(self.model, self.optimizer)}}
        return {"slices": {"model": slices(get_model_state_dict(self.model)),
                           "optimizer": slices(get_optimizer_state_dict(self.model, self.optimizer))},
                "rank": self.group[0]}

    def load_full(self, state: Optional[dict[str, Any]]) -> None:
        """Take `state` (a whole state, FQN-keyed, its tensors or refs to them; None: the
        factory's initial model, a fresh optimizer) at the next (re)sharding."""
        self.pending = state if state is not None else {"model": self.rebuild().state_dict(), "optimizer": None}
        self.group = None  # re-shard at the next step even in a group of the same shape

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Evaluation's setting, entered by every member alike: the model this replica holds now
        (a state loaded since the last step, or a new group, is sharded in first, as a step
        would), then gradients off through `no_grad`, not `inference_mode`: FSDP keeps the
        parameters it gathers for a forward, and ones made under inference mode could not be
        written by the training steps after it."""
        self._fit_group()
        with torch.no_grad():
            yield

    def in_lock_step(self, batches: Iterable[tuple[Any, Any]]) -> Iterator[tuple[Any, Any]]:
        """Evaluation's batches with every member running as many forwards (each unit's
        parameters are gathered for its forward, as in training): before each, a 1-float sum of
        "I have another batch"; a member whose slice ran out runs a row of padding, yielded with
        targets None (not counted). A failed collective is an interruption."""
        it = iter(batches)
        with collectives("evaluation"):
            while True:
                batch = next(it, None)
                (holding,) = self._sum([float(batch is not None)])
                if holding == 0:
                    return
                if batch is not None:
                    yield batch
                else:
                    yield (self.dummy if self.dummy is not None else self.sample())[0], None

    def state_bytes(self) -> int:
        """This replica's bytes of parameters, gradients and optimizer state (its slices)."""
        total = 0
        for p in self.model.parameters():
            t = local(p)
            total += t.numel() * t.element_size()
            if p.grad is not None:
                g = local(p.grad)
                total += g.numel() * g.element_size()
        for st in self.optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    t = local(v)
                    total += t.numel() * t.element_size()
        return total

    # ---- the step ----------------------------------------------------------------------
    def _sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        self.reducer.wait(self.reducer.start(t))
        return t.tolist()

    def step(self, x: Any, y: Any, more: bool = False, pause: bool = False) -> StepResult:
        self._fit_group()
        t0 = time.perf_counter()
        n = batch_rows(y) if x is not None else 0
        rows, more_total, pause_total = self._sum([float(n), float(more), float(pause)])
        comm_s = time.perf_counter() - t0
        if rows == 0:  # nobody had a row: every replica skips alike
            return StepResult(0.0, comm_s, 0, more_total > 0, pause_total > 0)
        with collectives("step"):
            return self._step(x, y, n, rows, more_total, pause_total, comm_s)

    def _step(self, x: Any, y: Any, n: int, rows: float, more_total: float, pause_total: float,
              comm_s: float) -> StepResult:
        self.optimizer.zero_grad(set_to_none=True)
        if x is not None:
            self.dummy = (slice_rows(x, 0, 1), slice_rows(y, 0, 1))
            loss_sum = self.recipe.backward(self.model, self.task, x, y, summed=True) * n
        else:  # the collectives of a step, on one row weighted zero
            dx, dy = self.dummy if self.dummy is not None else self.sample()
            with self.recipe.autocast():
                (self.task.loss(run_model(self.model, self.task, dx, dy), dy).float() * 0.0).backward()
            loss_sum = 0.0
        t1 = time.perf_counter()
        (total_loss,) = self._sum([loss_sum])
        comm_s += time.perf_counter() - t1
        mean_loss = total_loss / rows
        if self.recipe.finite(mean_loss):
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(rows)
            self.recipe.apply(self.optimizer, [p for p in self.model.parameters() if p.requires_grad])
        return StepResult(mean_loss, comm_s, int(rows), more_total > 0, pause_total > 0)

    def release(self) -> None:
        pass

    def end_epoch(self) -> dict[str, Any]:
        return {"state_bytes": self.state_bytes()}


def fsdp_metrics(stats: list[Any]) -> dict[str, float]:
    """The largest replica's parameters, gradients and optimizer state (MB) at the epoch's end."""
    sizes = [s.mode["state_bytes"] for s in stats if s.mode and "state_bytes" in s.mode]
    return {"replica_state_mb": max(sizes) / 1e6} if sizes else {}
