"""RayShardClient: how a replica talks to every ParameterShard (actors/shards/parameter_shard.py): pushes in the
background, pulls, elastic exchanges and synchronous rounds, with a log of what each shard
acknowledged so a rebuilt shard can be replayed to (the protocol is in actors/shards/parameter_shard.py's
docstring). ShardDirectory: the names and bounds a client finds the shards by."""
from __future__ import annotations

import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from actors.buffers import array_view, host_array
from actors.incarnation import wait_for_successor
from policies.rules.modes import Interrupted

INLINE_BYTES = 100 * 1024  # push slices up to this size are copied into the client's log, larger ones put once


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
    """policies.rules.modes.ShardClient over ParameterShard actors; pushes go out in the background
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
        """The shards' values into `into`, holding every push this client sent before: each
        shard's pull waits for this client's pushes to it still in flight (Ray runs a call once
        the calls its arguments name have run), so a replica reads its own writes. Without that
        a pull, which carries no payload, can overtake a push whose gradient still travels
        through the object store, and the next gradient is computed one update late."""
        handles = list(self.handles)
        refs = [h.pull.remote(*[item[i].ref for item in self.in_flight if item[i].handle is h])
                for i, h in enumerate(handles)]
        versions = []
        for i, ((lo, hi), ref) in enumerate(zip(self.bounds, refs)):
            version, values = self._get(i, handles[i], ref, "pull")
            into[lo:hi].copy_(array_view(values))  # host -> the replica's device
            self._seen[i] = max(self._seen[i], version)
            versions.append(version)
        return versions

    def push(self, grad: torch.Tensor, versions: list[int], rank: int, step: int, staleness_lr: bool) -> None:
        flat = host_array(grad)
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
        flat = host_array(x)
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
        flat = host_array(x)
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

    def add_gradient(self, pass_id: int, task_id: int, grad_sum: torch.Tensor, loss_sum: float, rows: int) -> bool:
        """sandblaster: a task's gradient sum to every shard (its slice), with the task's loss sum
        and rows, waited for; True if some shard counted it (False: every shard already had it).
        A shard rebuilt meanwhile is reconnected to and sent it again (its pass's sums were lost
        with it; the coordinator has the missing tasks computed again)."""
        flat = host_array(grad_sum)
        handles = list(self.handles)
        refs = [h.add_gradient.remote(pass_id, task_id, flat[lo:hi], loss_sum, rows)
                for h, (lo, hi) in zip(handles, self.bounds)]
        return any([self._get(i, handles[i], ref, "add_gradient", pass_id, task_id, flat[lo:hi], loss_sum, rows)
                    for i, ((lo, hi), ref) in enumerate(zip(self.bounds, refs))])

    def task_held(self, pass_id: int, task_id: int, timeout_s: float = 2.0) -> bool:
        """sandblaster: whether every shard holds task `task_id` of pass `pass_id` (another copy of
        it is in). An unanswered or dead shard counts as not holding it: the caller goes on
        computing its copy, which is never wrong, only late."""
        refs = [h.gradient_held.remote() for h in list(self.handles)]
        try:
            held = ray.get(refs, timeout=min(timeout_s, self.timeout_s))
        except (RayActorError, ray.exceptions.GetTimeoutError):
            return False
        return all(p == pass_id and task_id in tasks for p, tasks, _, _ in held)

    def set_buffers(self, rank: int, buffers: dict) -> None:
        self._call(0, "set_buffers", rank, buffers)

    def buffers(self) -> dict:
        return self._call(0, "buffers")

    def shared_values(self) -> Optional[tuple[torch.Tensor, int]]:
        """hogwild: (the one shard's values mapped into this process, the pid holding them), or
        None when this process is on another node (or there are several shards, or the mapping
        cannot be opened): it then pushes and pulls as downpour does."""
        if len(self.handles) != 1:
            return None
        node, pid, fd, n = self._call(0, "mapping")
        if node != ray.get_runtime_context().get_node_id():
            return None
        try:
            return torch.from_file(f"/proc/{pid}/fd/{fd}", shared=True, size=n, dtype=torch.float32), pid
        except (OSError, RuntimeError):  # not readable from here (another user, a different /proc)
            return None

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

