"""Sharded parameters: how the flat parameter vector is cut, and what one shard does with it.

The model's parameters are viewed as one flat float32 vector (`FlatParams`). Shards own
contiguous, near-equal slices of it (`shard_bounds`): balanced by bytes, a large tensor is
split across shards, small ones are packed together. `ShardState` is everything a shard holds
(its slice, a version counter, the server-side optimizer, per-replica clocks) and every update
it applies; the `ParameterShard` actor is a thin Ray wrapper around it, and tests use it
directly without Ray.

Recovery (orchestrator/fleet/shard_group.py, ShardGroup): `ShardState.snapshot()` is a plain picklable dict
(numpy arrays, no tensors) that `ShardState.from_snapshot` / `restore` turn back into the same
state bit for bit, server-optimizer state included; `replay_gradient` / `replay_elastic`
re-apply an update logged by a replica with exactly the step it had the first time, so a shard
restored from a snapshot and given the same updates in the same order ends identical.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from policies.rules.recipe import make_optimizer, shardable


def shard_bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of the flat vector, one per shard, sizes differing by at most one."""
    if shards < 1:
        raise ValueError("shards must be >= 1")
    if shards > numel:
        raise ValueError(f"{shards} shards for {numel} parameters")
    edges = np.linspace(0, numel, shards + 1).round().astype(np.int64)
    return [(int(edges[i]), int(edges[i + 1])) for i in range(shards)]


class FlatParams:
    """Makes a model's parameters (and their grads) views into two flat tensors, so a whole
    model moves as one buffer: pulls write straight into the parameters, pushes read straight
    from the gradients, with no per-tensor work. The flat tensors live on the parameters'
    device (a GPU replica keeps them on its GPU); only the shard boundary crosses to numpy."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        params = [p for p in params if p.requires_grad]
        if any(p.dtype != torch.float32 for p in params):
            raise TypeError("parameter-server modes need float32 parameters")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"parameter-server modes need every parameter on one device, got {sorted(map(str, devices))}")
        device = devices.pop()
        n = sum(p.numel() for p in params)
        self.params = torch.empty(n, dtype=torch.float32, device=device)
        self.grads = torch.zeros(n, dtype=torch.float32, device=device)
        offset = 0
        for p in params:
            k = p.numel()
            self.params[offset : offset + k].copy_(p.detach().reshape(-1))
            p.data = self.params[offset : offset + k].view_as(p)
            p.grad = self.grads[offset : offset + k].view_as(p)
            offset += k
        self.numel = n
        self.device = device
        self._views = params

    def rebind(self, values: torch.Tensor) -> None:
        """Make the parameters views into `values` (the same layout; hogwild: the shared vector)
        instead of the flat tensor they view now. Nothing is copied: they take its contents."""
        if values.numel() != self.numel or values.dtype != torch.float32:
            raise ValueError(f"rebind to {values.numel()} {values.dtype} values; the parameters are {self.numel} float32")
        offset = 0
        for p in self._views:
            k = p.numel()
            p.data = values[offset : offset + k].view_as(p)
            offset += k
        self.params = values


def average_buffers(by_rank: dict[int, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The reference model's buffers from the replicas' own: floating buffers (running means and
    variances) averaged, integer ones (batch counters) the largest."""
    if not by_rank:
        return {}
    states = list(by_rank.values())
    out = {}
    for name in states[0]:
        values = np.stack([np.asarray(s[name]) for s in states])
        merged = values.mean(0).astype(values.dtype) if np.issubdtype(values.dtype, np.floating) else values.max(0)
        out[name] = np.asarray(merged, dtype=values.dtype)
    return out


@dataclass
class ShardState:
    """One shard: a slice of the reference parameters (Downpour's server copy, EASGD's center)."""

    values: torch.Tensor  # float32 [hi - lo]
    optimizer: "str | dict" = "sgd"  # the server-side rule: a torch.optim name, or {name, kwargs} (policies/rules/recipe.py)
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    version: int = 0  # updates applied so far
    clocks: dict[int, int] = field(default_factory=dict)  # active replica rank -> last step it reported
    gone: set = field(default_factory=set)  # ranks that died: never waited for again
    max_lead: int = 0  # the largest lead over the slowest active replica seen at a push (SSP check)
    buffers: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # rank -> module buffers
    _opt: Optional[torch.optim.Optimizer] = None
    _param: Optional[torch.nn.Parameter] = None
    _sync: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # round -> contributions
    _closed: dict[int, list] = field(default_factory=dict)  # round -> [center before, readers left]

    def __post_init__(self) -> None:
        self._param = torch.nn.Parameter(self.values, requires_grad=False)
        self._param.grad = torch.zeros_like(self.values)
        # adagrad is DistBelief's stabilizer: eta_i = gamma / sqrt(sum of squared updates of parameter i);
        # any element-wise optimizer does to this slice exactly what it does to the whole vector
        spec = self.optimizer if isinstance(self.optimizer, dict) else {"name": self.optimizer}
        why = shardable(spec["name"])
        if why is not None:
            raise ValueError(f"a shard cannot apply {spec['name']} to its slice: it {why}")
        self._opt = make_optimizer({"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                                    **spec}, [self._param])

    # ---- Downpour ------------------------------------------------------------------------
    def apply_gradient(self, grad: np.ndarray | torch.Tensor, version_seen: int, staleness_lr: bool = False) -> int:
        """Apply one pushed (accumulated) gradient; returns its staleness: the updates applied
        since the version the gradient was computed from. With `staleness_lr` the step is
        eta / staleness (eta when the gradient is fresh)."""
        staleness = max(0, self.version - version_seen)  # < 0 only for a version seen before a rebuild
        self._step(grad, staleness, staleness_lr)
        return staleness

    def _step(self, grad: np.ndarray | torch.Tensor, staleness: int, staleness_lr: "bool | tuple") -> None:
        """`staleness_lr`: divide the rate by the staleness; or (that, factor): also multiply it
        by the pushing replica's schedule factor at the push (policies/rules/recipe.py Schedule)."""
        by_staleness, factor = staleness_lr if isinstance(staleness_lr, (tuple, list)) else (staleness_lr, 1.0)
        lr = self.lr * float(factor)
        self._param.grad.copy_(torch.as_tensor(grad))
        for group in self._opt.param_groups:
            group["lr"] = lr / max(1, staleness) if by_staleness else lr
        self._opt.step()
        self.version += 1

    def replay_gradient(self, grad: np.ndarray | torch.Tensor, staleness: int, staleness_lr: bool) -> int:
        """Re-apply a gradient this shard's predecessor acknowledged: the same optimizer step
        (the learning rate it had at `staleness`), whatever the version now. Returns the new
        version."""
        self._step(grad, staleness, staleness_lr)
        return self.version

    def share(self, values: torch.Tensor) -> None:
        """Keep the slice in `values` from now on (hogwild: a shared-memory mapping other processes
        write too): the contents copied in, the optimizer's state kept."""
        values.copy_(self.values)
        self.values = values
        self._param.data = values

    def welcome(self, rank: int, step: int) -> None:
        """A replacement replica takes a rank: active again (even if forgotten) at clock `step`."""
        self.gone.discard(rank)
        self.clocks[rank] = step

    def reseed(self, values: Optional[torch.Tensor], optimizer: str, clocks: dict[int, int], lr: float,
               momentum: float, weight_decay: float) -> None:
        """A phase switch: new contents (None: keep them), the server optimizer `optimizer`
        started afresh (its state belonged to the previous phase's updates), the replicas'
        clocks set to where they are. Versions go on counting."""
        if values is not None:
            self.values.copy_(values)
        self.optimizer, self.lr, self.momentum, self.weight_decay = optimizer, lr, momentum, weight_decay
        self.__post_init__()
        self.clocks = dict(clocks)
        self.gone = set()
        self.max_lead = 0

    def optimizer_state(self) -> dict:
        """The server optimizer's state_dict as tensor copies (a checkpoint's part: momentum
        buffers or Adagrad sums and steps), loadable with torch.load(weights_only=True)."""
        return copy.deepcopy(self._opt.state_dict())

    def load_optimizer_state(self, state: dict) -> None:
        """Go on with the server optimizer state `optimizer_state()` returned (a resumed run)."""
        self._opt.load_state_dict(copy.deepcopy(state))

    def init_clocks(self, replicas: int) -> None:
        self.clocks = {r: 0 for r in range(replicas)}

    def forget(self, rank: int) -> None:
        """A replica died: the slowest-replica clock never waits for it again."""
        self.clocks.pop(rank, None)
        self.gone.add(rank)
        self.buffers.pop(rank, None)

    def idle(self, rank: int) -> None:
        """A replica has no more partitions this epoch: nobody waits for it until it reports
        again (otherwise a fast replica finishing the epoch's last partitions would wait for a
        replica that has nothing left to do)."""
        self.clocks.pop(rank, None)

    def report_clock(self, rank: int, step: int) -> int:
        """Record a replica's step; returns the slowest active replica's step (for SSP). Also
        records how far ahead of the slowest other active replica the pushing one is (the
        bound `max_staleness` enforces, observed here rather than by the replica itself)."""
        if rank not in self.gone:
            self.clocks[rank] = max(step, self.clocks.get(rank, step))
            others = [c for r, c in self.clocks.items() if r != rank]
            if others:
                self.max_lead = max(self.max_lead, self.clocks[rank] - min(others))
        return min(self.clocks.values(), default=step)

    # ---- EASGD ---------------------------------------------------------------------------
    def elastic_exchange(self, x: np.ndarray | torch.Tensor, alpha: float) -> tuple[torch.Tensor, float]:
        """Asynchronous EASGD, atomically on this shard: d = alpha (x - c); c <- c + d.
        Returns (d, ||x - c||^2) so the replica applies x <- x - d."""
        diff = torch.as_tensor(x) - self.values
        d = diff.mul_(alpha)
        sq = float(d.pow(2).sum()) / (alpha * alpha) if alpha else 0.0
        self.values.add_(d)
        self.version += 1
        return d, sq

    def replay_elastic(self, d: np.ndarray | torch.Tensor) -> int:
        """Re-apply an acknowledged asynchronous EASGD move: c <- c + d. Returns the new version."""
        self.values.add_(torch.as_tensor(d))
        self.version += 1
        return self.version

    def sync_contribute(self, round_id: int, x: np.ndarray | torch.Tensor, replicas: int, beta: float,
                        has_data: bool = True) -> bool:
        """Synchronous EASGD: collect x_i (and whether replica i has a batch for this step) for
        a round; when all `replicas` are in and at least one has a batch, set
        c <- (1 - beta) c + beta mean_i x_i (a round where none has is only the vote that ends
        the epoch: the center stays). Returns True when this call closed the round."""
        bucket = self._sync.setdefault(round_id, [])
        bucket.append((torch.as_tensor(x).clone(), bool(has_data)))
        if len(bucket) < replicas:
            return False
        active = sum(h for _, h in bucket)
        self._closed[round_id] = [self.values.clone(), replicas, active]
        if active:
            mean = torch.stack([v for v, _ in bucket]).mean(0)
            self.values.mul_(1 - beta).add_(mean, alpha=beta)
            self.version += 1
        del self._sync[round_id]
        return True

    def sync_center_before(self, round_id: int) -> Optional[tuple[torch.Tensor, int]]:
        """(The center as it was when a closed round started: every replica's x_i moves toward
        the same c; how many replicas had a batch), or None while the round is still open."""
        entry = self._closed.get(round_id)
        if entry is None:
            return None
        entry[1] -= 1
        if entry[1] == 0:
            del self._closed[round_id]
        return entry[0], entry[2]

    def abort_open_rounds(self) -> list[int]:
        """Drop the contributions of every open synchronous round (closed rounds keep their
        effect). Returns the aborted round ids."""
        aborted = sorted(self._sync)
        self._sync.clear()
        return aborted

    # ---- snapshots -----------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Everything needed to rebuild this shard, as a picklable dict of copies (numpy arrays,
        no tensors, nothing shared with the live state): values, version, the server optimizer's
        state_dict (momentum buffer / Adagrad sums and step), hyper-parameters, clocks, gone,
        max_lead and buffers. Open synchronous rounds are not included (they are aborted, not
        replayed, when a shard is rebuilt)."""
        return {
            "values": self.values.detach().numpy().copy(),
            "version": self.version,
            "optimizer": self.optimizer, "lr": self.lr, "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "opt_state": _to_numpy(self._opt.state_dict()),
            "clocks": dict(self.clocks), "gone": set(self.gone), "max_lead": self.max_lead,
            "buffers": {r: {k: np.array(v, copy=True) for k, v in b.items()} for r, b in self.buffers.items()},
        }

    def restore(self, snapshot: dict) -> None:
        """Make this shard exactly the one `snapshot` was taken of (its values are copied in
        place, so the optimizer keeps working on the same tensor)."""
        values = torch.tensor(np.asarray(snapshot["values"], dtype=np.float32))
        if values.shape != self.values.shape:
            raise ValueError(f"snapshot holds {tuple(values.shape)} values, this shard {tuple(self.values.shape)}")
        if snapshot["optimizer"] != self.optimizer:
            raise ValueError(f"snapshot of a {snapshot['optimizer']} shard restored into a {self.optimizer} one")
        self.values.copy_(values)
        self.version = int(snapshot["version"])
        self.lr, self.momentum, self.weight_decay = snapshot["lr"], snapshot["momentum"], snapshot["weight_decay"]
        self._opt.load_state_dict(_to_torch(snapshot["opt_state"]))
        self.clocks = dict(snapshot["clocks"])
        self.gone = set(snapshot["gone"])
        self.max_lead = int(snapshot["max_lead"])
        self.buffers = {r: {k: np.array(v, copy=True) for k, v in b.items()} for r, b in snapshot["buffers"].items()}
        self._sync.clear()
        self._closed.clear()

    @classmethod
    def from_snapshot(cls, snapshot: dict) -> "ShardState":
        """A new shard identical to the one `snapshot` was taken of."""
        state = cls(torch.tensor(np.asarray(snapshot["values"], dtype=np.float32)), snapshot["optimizer"],
                    snapshot["lr"], snapshot["momentum"], snapshot["weight_decay"])
        state.restore(snapshot)
        return state


def _to_numpy(obj):
    """An optimizer state_dict with every tensor as a numpy copy (0-d tensors stay 0-d arrays)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_numpy(v) for v in obj)
    return obj


def _to_torch(obj):
    """The inverse of _to_numpy: numpy arrays back to tensors of the same dtype and shape."""
    if isinstance(obj, np.ndarray):
        return torch.tensor(obj)
    if isinstance(obj, dict):
        return {k: _to_torch(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_torch(v) for v in obj)
    return obj
