"""ParameterShard: a Ray actor holding one slice of the reference parameters (policies/rules/sharding.py
ShardState). A replica talks to all shards through actors/shards/client.py: RayShardClient; the
driver creates, snapshots and rebuilds them with orchestrator/fleet/shard_group.py: ShardGroup.

Shards are asyncio actors: every method runs on one event loop, so each update is applied
atomically, and the synchronous EASGD barrier can wait without blocking other replicas' calls.
They take no CPU reservation, so they fit beside replicas on a small machine. Buffers travel as
flat numpy arrays through the object store (one message per shard per push or pull, zero-copy
reads on the receiving side); nothing is pickled per tensor.

Recovery (nothing acknowledged is lost):
- The driver's `ShardGroup.poll()` snapshots every shard each `snapshot_every_s`. A snapshot is
  the return value of `ParameterShard.snapshot`, so the driver owns it and it outlives the shard.
  Once the driver holds a completed snapshot it tells the shard (`confirm_snapshot`), and the
  shard reports that version in its replies.
- Each `RayShardClient` keeps a log of the updates each shard acknowledged to it (Downpour
  gradients with the staleness they were applied at, asynchronous EASGD moves d) after the
  shard's latest confirmed snapshot; older entries are dropped as replies report newer snapshots.
- `poll()` notices a dead shard (a ping or snapshot call failing) and starts a new actor with
  the same name from the latest snapshot. A client whose call fails with the actor gone looks the
  name up again (for at most `timeout_s`), replays its own logged entries that the snapshot does
  not hold, in its order, then re-sends the calls that were never acknowledged. Replayed
  gradients take exactly the step they took the first time; with several clients only the
  interleaving between clients can differ (exact for plain SGD up to float rounding).
- Not replayed: synchronous EASGD rounds (a rebuild aborts open rounds on every shard and the
  waiting clients raise policies.rules.modes.Interrupted; the controller restarts the round), module
  buffers and SSP clocks newer than the snapshot (buffers are re-sent at each epoch end; clocks
  restart: a rank is waited for again once its client reconnects or pushes).
"""
from __future__ import annotations

import asyncio
import os
from typing import Any, Optional

import numpy as np
import ray
import torch

from actors.buffers import array_view
from policies.rules.gradient_tasks import GradientPass
from policies.rules.sandblaster import SliceVectors
from policies.rules.sharding import ShardState, average_buffers


class _Round:
    """A synchronous EASGD round being waited for on one shard."""

    __slots__ = ("event", "aborted")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.aborted = False


@ray.remote(num_cpus=0)
class ParameterShard:
    """One shard. Built from initial `values`, or (a rebuild) from a `snapshot` taken of a
    predecessor, as incarnation `generation` of its slot.

    Versions count updates applied. `lineage` maps every earlier incarnation whose state this
    one holds to the version it held it up to, so a replayed entry (generation, version) is
    applied only if the restored state does not already contain it."""

    def __init__(self, values: Optional[np.ndarray], optimizer: str, lr: float, momentum: float,
                 weight_decay: float, replicas: int, snapshot: Optional[dict] = None, generation: int = 0) -> None:
        if snapshot is None:
            self.state = ShardState(torch.from_numpy(np.array(values, dtype=np.float32)), optimizer, lr, momentum,
                                    weight_decay)
            self.state.init_clocks(replicas)
            self.lineage: dict[int, int] = {}
            self.restored_from: Optional[int] = None
        else:
            self.state = ShardState.from_snapshot(snapshot)
            self.state.clocks = {}  # stale by up to a snapshot interval: ranks report again on reconnecting
            self.lineage = dict(snapshot.get("lineage", {}))
            self.restored_from = self.state.version
        self.generation = generation
        self.durable = self.state.version  # the newest snapshot of this lineage the driver holds
        self.replayed = self.resent = self.dropped = 0
        self.clients: set[str] = set()  # the clients that reconnected (replayed their logs) to this incarnation
        self.seen = self.state.version  # the predecessor's newest version a reconnecting client saw
        self._rounds: dict[int, _Round] = {}
        self._memfd: Optional[int] = None  # hogwild: the shared-memory file the values live in (`mapping`)
        self._lbfgs: Optional[tuple[SliceVectors, GradientPass]] = None  # sandblaster: this slice's vectors

    # ---- replicas ------------------------------------------------------------------------
    async def pull(self, *after: Any) -> tuple[int, np.ndarray]:
        """(version, values). `after`: the replies of the caller's pushes still in flight, passed
        only so that Ray runs this pull once they have been applied (RayShardClient.pull)."""
        return self.state.version, self.state.values.numpy()

    async def push(self, grad: np.ndarray, version_seen: int, rank: int, step: int, staleness_lr: bool,
                   resent: bool = False) -> tuple[int, int, int, int]:
        """Apply a gradient; returns (its staleness, the slowest replica's step, the version it
        made, the newest confirmed snapshot version). `resent`: a push whose acknowledgement was
        lost with a previous incarnation (counted for the recovery report)."""
        staleness = self.state.apply_gradient(array_view(grad), version_seen, staleness_lr)
        self.resent += bool(resent)
        return staleness, self.state.report_clock(rank, step), self.state.version, self.durable

    async def elastic(self, x: np.ndarray, alpha: float, resent: bool = False) -> tuple[np.ndarray, float, int, int]:
        """Asynchronous EASGD exchange: (d, ||x - c||^2, the version it made, the newest
        confirmed snapshot version)."""
        d, sq = self.state.elastic_exchange(array_view(x), alpha)
        self.resent += bool(resent)
        return d.numpy(), sq, self.state.version, self.durable

    async def sync_round(self, round_id: int, x: np.ndarray, replicas: int, beta: float, has_data: bool,
                         timeout_s: float) -> tuple[np.ndarray, int]:
        """(center before the round, replicas with a batch); (empty, -1) if the round was aborted."""
        rnd = self._rounds.setdefault(round_id, _Round())
        if self.state.sync_contribute(round_id, array_view(x), replicas, beta, has_data):
            rnd.event.set()
        await asyncio.wait_for(rnd.event.wait(), timeout_s)
        if rnd.aborted:
            return np.empty(0, np.float32), -1
        center, active = self.state.sync_center_before(round_id)
        if round_id not in self.state._closed:
            self._rounds.pop(round_id, None)
        return center.numpy(), active

    async def abort_rounds(self) -> int:
        """Every sync_round call now waiting returns at once with active = -1, and the open
        rounds' contributions are dropped (calls arriving later start the round afresh).
        Rounds already closed keep their effect. Returns how many rounds were aborted."""
        aborted = set(self.state.abort_open_rounds())
        for round_id in aborted:
            rnd = self._rounds.pop(round_id, None)
            if rnd is not None:
                rnd.aborted = True
                rnd.event.set()
        return len(aborted)

    async def replay(self, client_id: str, generation: int, last_seen: int, entries: list, dropped: int,
                     clock: Optional[tuple[int, int]]) -> tuple[list[Optional[int]], int]:
        """A reconnecting client's log: [(generation, version, kind, payload, staleness,
        staleness_lr)] in the order the client's updates were acknowledged. Entries the restored
        state already holds are skipped (None in the reply); the others are applied in order
        (kind "grad": the same optimizer step; "elastic": c += d) and get the new version they
        made. `last_seen`: the newest version the client saw from incarnation `generation`;
        `dropped`: logged entries it had to discard (lost); `clock`: its (rank, step) if it is
        training. Returns (the new versions, the confirmed snapshot version)."""
        payloads = [p for _, _, _, p, _, _ in entries]
        refs = [p for p in payloads if isinstance(p, ray.ObjectRef)]
        if refs:
            resolved = iter(await asyncio.gather(*refs))
            payloads = [next(resolved) if isinstance(p, ray.ObjectRef) else p for p in payloads]
        self.clients.add(client_id)
        if generation == self.generation - 1 or generation in self.lineage:
            self.seen = max(self.seen, last_seen)
        self.dropped += dropped
        out: list[Optional[int]] = []
        for (gen, version, kind, _, staleness, staleness_lr), payload in zip(entries, payloads):
            if self.restored_from is None or gen == self.generation or version <= self.lineage.get(gen, -1):
                out.append(None)  # already part of this shard's state
                continue
            if kind == "grad":
                out.append(self.state.replay_gradient(array_view(payload), staleness, staleness_lr))
            else:
                out.append(self.state.replay_elastic(array_view(payload)))
            self.replayed += 1
        if clock is not None:
            self.state.report_clock(*clock)
        return out, self.durable

    async def min_clock(self) -> int:
        return min(self.state.clocks.values(), default=0)

    async def idle(self, rank: int) -> None:
        self.state.idle(rank)

    async def version(self) -> int:
        return self.state.version

    async def set_buffers(self, rank: int, buffers: dict) -> None:
        self.state.buffers[rank] = buffers

    async def buffers(self) -> dict:
        return average_buffers(self.state.buffers)

    async def mapping(self) -> tuple[str, int, int, int]:
        """hogwild (policies/rules/hogwild.py): (this shard's node, its pid, the fd of the memory
        file its values live in, how many) for replicas on the same node to map and write in place.
        The first call moves the values into an anonymous memory file (memfd: nothing on disk,
        gone with the last process that maps it); replicas open it as /proc/<pid>/fd/<fd>."""
        n = self.state.values.numel()
        if self._memfd is None:
            fd = os.memfd_create(f"shard-g{self.generation}")
            os.ftruncate(fd, max(4 * n, 4))
            self.state.share(torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=n, dtype=torch.float32))
            self._memfd = fd
        return ray.get_runtime_context().get_node_id(), os.getpid(), self._memfd, n

    # ---- sandblaster (policies/rules/sandblaster.py, gradient_tasks.py) --------------------
    def _sandblaster(self) -> tuple[SliceVectors, GradientPass]:
        """This slice's L-BFGS vectors ("x" is the shard's own values, moved in place) and the
        current pass's gradient sum; made on first use."""
        if self._lbfgs is None:
            self._lbfgs = (SliceVectors(self.state.values), GradientPass(self.state.values.numel()))
        vectors, grads = self._lbfgs
        vectors.v["x"] = self.state.values  # the values tensor itself (hogwild or a reseed may have replaced it)
        return vectors, grads

    async def gradient_pass(self, pass_id: int) -> None:
        """Open the gradient pass `pass_id`: task gradients of any other pass are dropped from now on."""
        self._sandblaster()[1].begin(pass_id)

    async def add_gradient(self, pass_id: int, task_id: int, grad_sum: np.ndarray, loss_sum: float = 0.0,
                           rows: int = 0) -> bool:
        """A task's gradient summed over its rows, this shard's slice of it (with the task's
        loss sum and rows): True if it counted (the first copy of the task in this pass), False
        if dropped."""
        return self._sandblaster()[1].add(pass_id, task_id, torch.tensor(np.asarray(grad_sum), dtype=torch.float32),
                                          loss_sum, rows)

    async def gradient_held(self) -> tuple[int, list[int], float, int]:
        """(the open pass, the tasks it holds, their loss sum, their rows)."""
        return self._sandblaster()[1].held()

    async def finish_gradient(self, rows: int) -> list[int]:
        """"g" <- the pass's gradient sum / rows; returns the tasks it holds (the caller checks
        that every task of the pass is there, once)."""
        vectors, grads = self._sandblaster()
        g, tasks = grads.finish(rows)
        vectors.set("g", g)
        return tasks

    async def lbfgs(self, ops: list) -> list[float]:
        """Run the coordinator's operations on this slice (SliceVectors.run): its partial scalars."""
        out = self._sandblaster()[0].run(ops)
        if any(op[0] == "axpy" and op[1] == "x" for op in ops):
            self.state.version += 1  # the values moved: a pull sees a new version
        return out

    async def lbfgs_forget(self) -> None:
        """Drop every vector but x (the direction, the last gradient, the s/y history); the
        open pass's task sums are kept."""
        if self._lbfgs is not None:
            self._lbfgs[0].v = {"x": self.state.values}

    # ---- driver --------------------------------------------------------------------------
    async def pid(self) -> int:
        return os.getpid()

    async def incarnation(self) -> int:
        """This actor's generation (a reconnecting client's probe, actors/incarnation.py)."""
        return self.generation

    async def status(self) -> tuple[int, int, int]:
        """(generation, version, newest confirmed snapshot version): the driver's ping."""
        return self.generation, self.state.version, self.durable

    @ray.method(num_returns=2)
    async def snapshot(self) -> tuple[int, dict]:
        """(version, ShardState.snapshot() plus this shard's lineage). Two objects, so the
        driver reads the version without fetching the values."""
        snap = self.state.snapshot()
        snap["lineage"] = {**self.lineage, self.generation: self.state.version}
        return self.state.version, snap

    async def confirm_snapshot(self, version: int) -> None:
        """The driver holds a completed snapshot at `version`: clients may drop older log entries."""
        self.durable = max(self.durable, version)

    async def recovery_info(self) -> dict[str, Any]:
        return {"generation": self.generation, "restored_from": self.restored_from, "replayed": self.replayed,
                "resent": self.resent, "dropped": self.dropped, "seen": self.seen, "version": self.state.version,
                "clients": len(self.clients)}

    async def forget_replica(self, rank: int) -> None:
        self.state.forget(rank)

    async def welcome_replica(self, rank: int, step: int) -> None:
        """A replacement replica takes `rank` (forgotten or not): active again at clock `step`."""
        self.state.welcome(rank, step)

    async def values(self) -> np.ndarray:
        return self.state.values.numpy()

    async def reseed(self, values: Optional[np.ndarray], optimizer: tuple, clocks: dict[int, int]) -> int:
        """A phase switch: take `values` (None: keep the current ones), start the server
        optimizer `optimizer` (name, lr, momentum, weight_decay) afresh, and set the replicas'
        clocks. Returns the version."""
        self.state.reseed(None if values is None else torch.from_numpy(np.array(values, dtype=np.float32)),
                          optimizer[0], clocks, *optimizer[1:])
        return self.state.version

    async def optimizer_state(self) -> dict:
        return self.state.optimizer_state()

    async def load_optimizer_state(self, state: dict) -> None:
        self.state.load_optimizer_state(state)

    async def observed_max_lead(self) -> int:
        return self.state.max_lead


def create_shards(initial: np.ndarray, bounds: list[tuple[int, int]], optimizer: str, lr: float, momentum: float,
                  weight_decay: float, replicas: int) -> list:
    """One anonymous ParameterShard per bound, each given its slice (one object-store put per
    shard). No snapshots and no recovery: orchestrator/fleet/shard_group.py ShardGroup.create adds them."""
    return [ParameterShard.remote(initial[lo:hi], optimizer, lr, momentum, weight_decay, replicas)
            for lo, hi in bounds]
