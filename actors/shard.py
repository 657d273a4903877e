"""ParameterShard: a Ray actor holding one slice of the reference parameters (policies/sharding.py
ShardState); RayShardClient: how a replica talks to all shards. The driver creates, snapshots
and rebuilds them with orchestrator/shard_group.py: ShardGroup.

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
  waiting clients raise policies.modes.Interrupted; the controller restarts the round), module
  buffers and SSP clocks newer than the snapshot (buffers are re-sent at each epoch end; clocks
  restart: a rank is waited for again once its client reconnects or pushes).
"""
from __future__ import annotations

import asyncio
import os
import time
import uuid
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from actors.incarnation import wait_for_successor
from policies.modes import Interrupted
from policies.sharding import ShardState, average_buffers

INLINE_BYTES = 100 * 1024  # push slices up to this size are copied into the client's log, larger ones put once


def _view(array: np.ndarray) -> torch.Tensor:
    """A tensor over an array from the object store (read-only, zero-copy); we only read it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _host(t: torch.Tensor) -> np.ndarray:
    """The shard boundary: a flat tensor as a numpy array (copied off a GPU, a view on the CPU)."""
    return t.detach().cpu().numpy()


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
        self.seen = self.state.version  # the predecessor's newest version a reconnecting client saw
        self._rounds: dict[int, _Round] = {}

    # ---- replicas ------------------------------------------------------------------------
    async def pull(self) -> tuple[int, np.ndarray]:
        return self.state.version, self.state.values.numpy()

    async def push(self, grad: np.ndarray, version_seen: int, rank: int, step: int, staleness_lr: bool,
                   resent: bool = False) -> tuple[int, int, int, int]:
        """Apply a gradient; returns (its staleness, the slowest replica's step, the version it
        made, the newest confirmed snapshot version). `resent`: a push whose acknowledgement was
        lost with a previous incarnation (counted for the recovery report)."""
        staleness = self.state.apply_gradient(_view(grad), version_seen, staleness_lr)
        self.resent += bool(resent)
        return staleness, self.state.report_clock(rank, step), self.state.version, self.durable

    async def elastic(self, x: np.ndarray, alpha: float, resent: bool = False) -> tuple[np.ndarray, float, int, int]:
        """Asynchronous EASGD exchange: (d, ||x - c||^2, the version it made, the newest
        confirmed snapshot version)."""
        d, sq = self.state.elastic_exchange(_view(x), alpha)
        self.resent += bool(resent)
        return d.numpy(), sq, self.state.version, self.durable

    async def sync_round(self, round_id: int, x: np.ndarray, replicas: int, beta: float, has_data: bool,
                         timeout_s: float) -> tuple[np.ndarray, int]:
        """(center before the round, replicas with a batch); (empty, -1) if the round was aborted."""
        rnd = self._rounds.setdefault(round_id, _Round())
        if self.state.sync_contribute(round_id, _view(x), replicas, beta, has_data):
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
        if generation == self.generation - 1 or generation in self.lineage:
            self.seen = max(self.seen, last_seen)
        self.dropped += dropped
        out: list[Optional[int]] = []
        for (gen, version, kind, _, staleness, staleness_lr), payload in zip(entries, payloads):
            if self.restored_from is None or gen == self.generation or version <= self.lineage.get(gen, -1):
                out.append(None)  # already part of this shard's state
                continue
            if kind == "grad":
                out.append(self.state.replay_gradient(_view(payload), staleness, staleness_lr))
            else:
                out.append(self.state.replay_elastic(_view(payload)))
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
                "resent": self.resent, "dropped": self.dropped, "seen": self.seen, "version": self.state.version}

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

    async def observed_max_lead(self) -> int:
        return self.state.max_lead


# ---- replicas' side ------------------------------------------------------------------------
@dataclass
class ShardDirectory:
    """What a replica needs to reach the shards: small and picklable. `names` None: plain
    handles that cannot be looked up again (no recovery)."""

    names: Optional[list[str]]
    namespace: Optional[str]
    bounds: list[tuple[int, int]]
    handles: list
    generations: list[int]
    log_limit_bytes: int = 512 * 2**20  # the client's replay log, over all shards


@dataclass
class _Entry:
    """An update a shard acknowledged to this client, kept until a confirmed snapshot holds it."""

    generation: int
    version: int
    kind: str  # "grad" | "elastic"
    payload: Any  # numpy array or ObjectRef
    staleness: int
    staleness_lr: bool
    nbytes: int


@dataclass
class _Push:
    """One shard's part of a push still in flight."""

    shard: int
    handle: Any
    generation: int
    payload: Any
    version_seen: int
    rank: int
    step: int
    staleness_lr: bool
    nbytes: int
    ref: Any = None
    acknowledged: bool = False  # by an incarnation that died before the reply was read


def _two_args(args: tuple, kwargs: dict) -> tuple[int, float]:
    """(max_in_flight, timeout_s) given positionally or by keyword."""
    values = dict(zip(("max_in_flight", "timeout_s"), args), **kwargs)
    if set(values) != {"max_in_flight", "timeout_s"} or len(args) > 2:
        raise TypeError("RayShardClient(directory, max_in_flight, timeout_s)")
    return int(values["max_in_flight"]), float(values["timeout_s"])


class RayShardClient:
    """policies.modes.ShardClient over ParameterShard actors; pushes go out in the background
    with at most `max_in_flight` outstanding.

    Guarantee: when a shard dies and the driver's ShardGroup rebuilds it within `timeout_s`, every
    call this client makes still completes: the client reconnects by name, replays the updates
    the dead shard acknowledged to it after its last confirmed snapshot, re-sends its
    unacknowledged pushes / exchanges, and retries the call (sync_round excepted: it raises
    Interrupted). If no shard answers under the name within `timeout_s`, the original
    RayActorError is raised. The log holds at most `directory.log_limit_bytes`; entries dropped
    beyond that are reported to the rebuilt shard as lost.

    `RayShardClient(directory, max_in_flight, timeout_s)`; the old form
    `RayShardClient(handles, bounds, max_in_flight, timeout_s)` still works, without recovery."""

    def __init__(self, directory, *args, **kwargs) -> None:
        if not isinstance(directory, ShardDirectory):  # (handles, bounds, max_in_flight, timeout_s)
            handles, (bounds, *args) = list(directory), args
            directory = ShardDirectory(None, None, list(bounds), handles, [0] * len(handles))
        max_in_flight, timeout_s = _two_args(args, kwargs)
        self.directory = directory
        self.handles = list(directory.handles)
        self.bounds = list(directory.bounds)
        self.generations = list(directory.generations)
        self.max_in_flight, self.timeout_s = max_in_flight, timeout_s
        self.client_id = uuid.uuid4().hex
        self.in_flight: deque[list[_Push]] = deque()
        self._stale: list[int] = []
        self._min_clock = 0
        n = len(self.handles)
        self._logging = directory.names is not None
        self._log: list[deque[_Entry]] = [deque() for _ in range(n)]
        self._log_bytes = [0] * n
        self._dropped = [0] * n
        self._seen = [0] * n  # newest version seen from the current incarnation of each shard
        self._clock: Optional[tuple[int, int]] = None  # (rank, step) last pushed; None while idle
        self.reconnects = 0

    @property
    def shards(self) -> list:
        return self.handles

    # ---- ShardClient ---------------------------------------------------------------------
    def pull(self, into: torch.Tensor) -> list[int]:
        handles = list(self.handles)
        refs = [h.pull.remote() for h in handles]
        versions = []
        for i, ((lo, hi), ref) in enumerate(zip(self.bounds, refs)):
            version, values = self._get(i, handles[i], ref, "pull")
            into[lo:hi].copy_(_view(values))  # host -> the replica's device
            self._seen[i] = max(self._seen[i], version)
            versions.append(version)
        return versions

    def push(self, grad: torch.Tensor, versions: list[int], rank: int, step: int, staleness_lr: bool) -> None:
        flat = _host(grad)
        item = []
        for i, ((lo, hi), v) in enumerate(zip(self.bounds, versions)):
            part = flat[lo:hi]
            if not self._logging:
                payload = part  # serialized by .remote() below; nothing keeps it
            elif part.nbytes > INLINE_BYTES:
                payload = ray.put(part)  # the copy .remote() would make anyway, kept for a replay
            else:
                payload = part.copy()
            p = _Push(i, self.handles[i], self.generations[i], payload, v, rank, step, staleness_lr, part.nbytes)
            p.ref = p.handle.push.remote(payload, v, rank, step, staleness_lr)
            item.append(p)
        self._clock = (rank, step)
        self.in_flight.append(item)
        while len(self.in_flight) > self.max_in_flight:
            self._record(self.in_flight[0])
            self.in_flight.popleft()

    def _record(self, item: list[_Push]) -> None:
        """Wait for one push's replies (the item stays in flight meanwhile, so a reconnect
        re-sends it), log what was acknowledged."""
        replies = []
        for p in item:
            for _ in range(3):
                try:
                    replies.append(ray.get(p.ref, timeout=self.timeout_s))
                    break
                except RayActorError as e:
                    self._reconnect(p.shard, p.handle, e)  # re-sends p
            else:
                raise RuntimeError(f"shard {p.shard} died three times during one push")
        for p, (staleness, _, version, durable) in zip(item, replies):
            self._stale.append(staleness)
            self._acknowledged(p.shard, p.generation, version, durable, "grad", p.payload, staleness,
                               p.staleness_lr, p.nbytes)
        self._min_clock = max(self._min_clock, replies[0][1])

    def completed(self) -> tuple[list[int], int]:
        while self.in_flight:
            refs = [p.ref for p in self.in_flight[0]]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(ready) < len(refs):
                break
            self._record(self.in_flight[0])
            self.in_flight.popleft()
        out, self._stale = self._stale, []
        return out, self._min_clock

    def drain(self) -> None:
        while self.in_flight:
            self._record(self.in_flight[0])
            self.in_flight.popleft()

    def min_clock(self) -> int:
        self._min_clock = self._call(0, "min_clock")
        return self._min_clock

    def version(self) -> int:
        return self._call(0, "version")

    def idle(self, rank: int) -> None:
        self._clock = None
        self._call(0, "idle", rank)

    def elastic(self, x: torch.Tensor, alpha: float) -> tuple[torch.Tensor, float]:
        flat = _host(x)
        handles = list(self.handles)
        refs = [h.elastic.remote(flat[lo:hi], alpha) for h, (lo, hi) in zip(handles, self.bounds)]
        ds, total = [], 0.0
        for i, ((lo, hi), ref) in enumerate(zip(self.bounds, refs)):
            generation = self.generations[i]
            try:
                d, sq, version, durable = ray.get(ref, timeout=self.timeout_s)
            except RayActorError as e:
                self._reconnect(i, handles[i], e)
                generation = self.generations[i]
                d, sq, version, durable = self._call(i, "elastic", flat[lo:hi], alpha, True)
            self._acknowledged(i, generation, version, durable, "elastic", d, 0, False, d.nbytes)
            ds.append(d)
            total += sq
        return torch.from_numpy(np.concatenate(ds)).to(x.device), total

    def sync_round(self, round_id: int, x: torch.Tensor, replicas: int, beta: float,
                   has_data: bool) -> tuple[torch.Tensor, int]:
        """The barrier; raises Interrupted if a shard died during the round (after reconnecting
        to its replacement) or the round was aborted. Rounds are not replayed."""
        flat = _host(x)
        handles = list(self.handles)
        refs = [h.sync_round.remote(round_id, flat[lo:hi], replicas, beta, has_data, self.timeout_s)
                for h, (lo, hi) in zip(handles, self.bounds)]
        index = {ref: i for i, ref in enumerate(refs)}
        replies: list = [None] * len(refs)
        pending, deadline = list(refs), time.monotonic() + self.timeout_s + 5
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise GetTimeoutError(f"sync round {round_id}: no answer from the shards in {self.timeout_s + 5:.0f}s")
            i = index[ready[0]]
            try:
                replies[i] = ray.get(ready[0])
            except RayActorError as e:
                self._reconnect(i, handles[i], e)
                raise Interrupted(f"shard {i} was lost during synchronous round {round_id}") from e
            if replies[i][1] == -1:
                raise Interrupted(f"synchronous round {round_id} was aborted on shard {i}")
        return torch.from_numpy(np.concatenate([c for c, _ in replies])).to(x.device), replies[0][1]

    def set_buffers(self, rank: int, buffers: dict) -> None:
        self._call(0, "set_buffers", rank, buffers)

    def buffers(self) -> dict:
        return self._call(0, "buffers")

    def reconnect(self) -> int:
        """Ask every shard for its status, reconnecting to (and replaying into) any that was
        rebuilt; returns how many were. A replica with nothing else to send calls this so its log
        still reaches a rebuilt shard."""
        before = self.reconnects
        for i in range(len(self.handles)):
            self._call(i, "status")
        return self.reconnects - before

    # ---- recovery ------------------------------------------------------------------------
    def _get(self, i: int, handle, ref, method: str, *args):
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except RayActorError as e:
            self._reconnect(i, handle, e)
            return self._call(i, method, *args)

    def _call(self, i: int, method: str, *args):
        """Call shard i and wait for the reply, reconnecting if it has been rebuilt."""
        for _ in range(3):
            handle = self.handles[i]
            try:
                return ray.get(getattr(handle, method).remote(*args), timeout=self.timeout_s)
            except RayActorError as e:
                self._reconnect(i, handle, e)
        raise RuntimeError(f"shard {i} died three times during one {method} call")

    def _acknowledged(self, i: int, generation: int, version: int, durable: int, kind: str, payload,
                      staleness: int, staleness_lr: bool, nbytes: int) -> None:
        if generation != self.generations[i]:
            return  # from an incarnation already replaced: the reconnect re-sent this update
        self._seen[i] = max(self._seen[i], version)
        if not self._logging:
            return
        log = self._log[i]
        log.append(_Entry(generation, version, kind, payload, staleness, staleness_lr, nbytes))
        self._log_bytes[i] += nbytes
        while log and (log[0].version <= durable or self._log_bytes[i] > self.directory.log_limit_bytes / len(self._log)):
            dropped = log.popleft()
            self._log_bytes[i] -= dropped.nbytes
            if dropped.version > durable:
                self._dropped[i] += 1  # over the limit: lost if this shard dies before its next snapshot

    def _reconnect(self, i: int, failed, error: BaseException) -> None:
        """Shard i's actor `failed` is gone: wait (at most timeout_s) for a new actor under its
        name, replay the log into it, re-send every push in flight to the old one, use it."""
        if self.handles[i]._actor_id != failed._actor_id:
            return  # an earlier call already reconnected
        if self.directory.names is None:
            raise error
        found = wait_for_successor(self.directory.names[i], self.directory.namespace, self.generations[i], failed,
                                   self.timeout_s, lambda h: h.incarnation.remote())
        if found is None:
            raise error
        handle, generation = found
        self._harvest(i, failed)
        log = list(self._log[i])
        entries = [(e.generation, e.version, e.kind, e.payload, e.staleness, e.staleness_lr) for e in log]
        new_versions, _ = ray.get(handle.replay.remote(self.client_id, self.generations[i], self._seen[i], entries,
                                                       self._dropped[i], self._clock),
                                  timeout=max(self.timeout_s, 1.0))
        self._log[i] = deque()
        self._log_bytes[i] = 0
        for e, v in zip(log, new_versions):
            if v is not None:  # replayed: now part of the new incarnation, until its next snapshot
                e.generation, e.version = generation, v
                self._log[i].append(e)
                self._log_bytes[i] += e.nbytes
        self._dropped[i] = 0
        self.handles[i], self.generations[i] = handle, generation
        self._seen[i] = max([v for v in new_versions if v is not None], default=0)
        for item in self.in_flight:  # pushes never acknowledged: send again, in their order
            for p in item:
                if p.shard == i and p.handle._actor_id == failed._actor_id and not p.acknowledged:
                    p.handle, p.generation = handle, generation
                    p.ref = handle.push.remote(p.payload, p.version_seen, p.rank, p.step, p.staleness_lr, True)
        self.reconnects += 1

    def _harvest(self, i: int, failed) -> None:
        """Pushes in flight to the dead actor that it did acknowledge (their replies not read
        yet) go into the log, to be replayed like the others; the rest will be re-sent."""
        mine = [p for item in self.in_flight for p in item
                if p.shard == i and p.handle._actor_id == failed._actor_id and not p.acknowledged]
        if not mine:
            return
        ray.wait([p.ref for p in mine], num_returns=len(mine), timeout=2.0)  # the dead actor's calls settle
        for p in mine:
            try:
                staleness, _, version, durable = ray.get(p.ref, timeout=0)
            except (RayActorError, GetTimeoutError):
                break  # applied in order: nothing after the first unacknowledged one was either
            p.acknowledged = True  # _record reads the reply again but logs nothing (old generation)
            self._acknowledged(i, p.generation, version, durable, "grad", p.payload, staleness, p.staleness_lr,
                               p.nbytes)


def create_shards(initial: np.ndarray, bounds: list[tuple[int, int]], optimizer: str, lr: float, momentum: float,
                  weight_decay: float, replicas: int) -> list:
    """One anonymous ParameterShard per bound, each given its slice (one object-store put per
    shard). No snapshots and no recovery: ShardGroup.create replaces this."""
    return [ParameterShard.remote(initial[lo:hi], optimizer, lr, momentum, weight_decay, replicas)
            for lo, hi in bounds]
