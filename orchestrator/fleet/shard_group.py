"""ShardGroup: the driver's parameter shards (actors/shards/parameter_shard.py ParameterShard). It creates them,
snapshots each every `snapshot_every_s`, and rebuilds a dead or stopped one from its latest
snapshot under the next incarnation's name; the replicas' clients replay what the snapshot does
not hold (the recovery protocol is described in actors/shards/parameter_shard.py)."""
from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np
import ray
from ray.exceptions import RayActorError

from actors.incarnation import incarnation_name
from actors.shards.parameter_shard import ParameterShard
from actors.shards.client import ShardDirectory
from orchestrator.fleet.shard_slots import Slot, rebuild_event
from orchestrator.errors import TrainingError
from orchestrator.fleet.outcomes import DIED, HUNG, RAISED, Outcome, describe, gather, outcome_of
from policies.messages import FleetEvent

ATTEMPTS = 3  # a call every shard must answer: asked again after a rebuild at most this many times
REBUILD_WAIT_S = 60.0  # the least a rebuild is waited for: a new actor's process start, seconds to tens on a loaded host


class ShardGroup:
    """The driver's parameter shards: named actors `{name_prefix}-shard-{i}`, snapshotted every
    `snapshot_every_s` and rebuilt from their latest snapshot when they die (see the module doc).

    The controller calls `poll()` from its loop (it never blocks on a shard: tens of ms), hands
    `directory()` to replicas, and logs the events `poll()` returns. `handles[i]` is always the
    current incarnation of shard i."""

    def __init__(self, handles: list, bounds: list[tuple[int, int]], names: list[str], namespace: str,
                 shard_args: tuple, snapshot_every_s: float, settle_s: float, log_limit_bytes: int) -> None:
        self.bounds, self.names, self.namespace = bounds, names, namespace
        self._args = shard_args  # (optimizer, lr, momentum, weight_decay, replicas)
        self.snapshot_every_s, self.settle_s, self.log_limit_bytes = snapshot_every_s, settle_s, log_limit_bytes
        self._slots = [Slot(h) for h in handles]
        self._membership: dict[int, Optional[int]] = {}  # rank -> None (forgotten) | step it was welcomed at
        self.rebuilds = 0
        self.placement: Any = None  # the scheduling strategy shards (and their rebuilds) are started with
        self.hang_s: Optional[float] = None  # a shard whose ping goes unanswered this long is killed and rebuilt
        self._held: list[FleetEvent] = []  # events of rebuilds done while a control call waited: the next poll() reports them

    @classmethod
    def create(cls, initial: np.ndarray, bounds: list[tuple[int, int]], optimizer: str, lr: float, momentum: float,
               weight_decay: float, replicas: int, snapshot_every_s: float, name_prefix: str,
               namespace: Optional[str] = None, settle_s: float = 10.0, log_limit_bytes: int = 512 * 2**20,
               timeout_s: float = 60.0, placement: Any = None, hang_s: Optional[float] = None) -> "ShardGroup":
        """One named ParameterShard per bound, each given its slice; returns once every shard
        answered its first snapshot (snapshot 0: a rebuild never lacks one). `settle_s`: how
        long after a rebuild poll() waits for clients to replay before reporting what is lost."""
        namespace = namespace or ray.get_runtime_context().namespace
        names = [f"{name_prefix}-shard-{i}" for i in range(len(bounds))]
        args = (optimizer, lr, momentum, weight_decay, replicas)
        handles = [ParameterShard.options(name=name, namespace=namespace, max_restarts=0,
                                          scheduling_strategy=placement).remote(initial[lo:hi], *args)
                   for name, (lo, hi) in zip(names, bounds)]
        group = cls(handles, bounds, names, namespace, args, snapshot_every_s, settle_s, log_limit_bytes)
        group.placement, group.hang_s = placement, hang_s
        try:
            all_answers(group.snapshot_now(timeout_s), "the shards did not start")
        except BaseException:
            group.shutdown()
            raise
        return group

    @property
    def handles(self) -> list:
        return [s.handle for s in self._slots]

    @property
    def generations(self) -> list[int]:
        """Each shard's incarnation (a rebuild starts a new one)."""
        return [s.generation for s in self._slots]

    def directory(self) -> ShardDirectory:
        """What replicas build their RayShardClient from (picklable; current handles as hints)."""
        return ShardDirectory(list(self.names), self.namespace, list(self.bounds), self.handles,
                              [s.generation for s in self._slots], self.log_limit_bytes)

    # ---- snapshots -----------------------------------------------------------------------
    def snapshot_now(self, timeout_s: float = 60.0, only: Optional[list[int]] = None) -> dict[int, Outcome]:
        """Snapshot every live shard (or those of `only`) and wait for all, at most `timeout_s`
        in all; what each came to (ok: its version, kept as its latest snapshot)."""
        taken = {}
        for i, slot in enumerate(self._slots):
            if slot.state == "up" and (only is None or i in only):
                taken[i] = tuple(slot.handle.snapshot.remote())
        outs = gather({i: refs[0] for i, refs in taken.items()}, timeout_s)
        now = time.monotonic()
        for i, out in outs.items():
            if out.ok:
                self._keep_snapshot(self._slots[i], out.value, taken[i][1], now)
        return outs

    def snapshot_soon(self) -> None:
        """Start a snapshot of every live shard now, without waiting (poll() keeps it when it
        completes); one already pending is superseded."""
        now = time.monotonic()
        for slot in self._slots:
            if slot.state == "up":
                slot.pending_snapshot, slot.last_snapshot_at = tuple(slot.handle.snapshot.remote()), now

    def _keep_snapshot(self, slot: Slot, version: int, snap_ref, now: float) -> None:
        slot.snapshot_ref, slot.snapshot_version = snap_ref, version
        slot.pending_snapshot, slot.last_snapshot_at = None, now
        slot.known_version = max(version, slot.known_version or 0)
        slot.handle.confirm_snapshot.remote(version)

    # ---- the controller's loop -----------------------------------------------------------
    def poll(self, now: Optional[float] = None) -> list[FleetEvent]:
        """Snapshot shards that are due, notice dead ones, rebuild them, and report each rebuild
        once a client has reconnected and nothing the clients saw is missing (or `settle_s`
        passed): one `shard_rebuilt` event per rebuild (shard_slots.rebuild_event: its shard,
        generation, detected_by, snapshot_version, version_at_death, replayed_updates,
        resent_updates, lost_updates, recovery_s).
        lost_updates = the newest version the driver or a reconnecting client saw - (snapshot
        version + replayed), plus log entries clients had to drop; 0 when nothing acknowledged was
        lost. Never waits on a shard."""
        now = time.monotonic() if now is None else now
        events, self._held = self._held, []
        for i, slot in enumerate(self._slots):
            if slot.state == "up":
                self._check(i, slot, now)
            if slot.state == "dead":
                self._rebuild(i, slot, now)
            if slot.state == "starting":
                self._check_started(i, slot, now)
            if slot.state == "up" and slot.settling:
                event = self._check_settled(i, slot, now)
                if event:
                    events.append(event)
        return events

    @property
    def repairing(self) -> bool:
        """A shard is dead, starting again, or waiting for its clients' replay: a replica may be
        waiting on it."""
        return any(slot.state != "up" or slot.settling for slot in self._slots)

    def unconfirmed(self, now: Optional[float] = None) -> bool:
        """A live shard has answered no ping sent in the last `hang_s` seconds: whether it is
        stopped is not known yet (the driver was busy elsewhere, e.g. a repair, and its pings went
        unchecked), so a replica waiting on it is not to be taken for hung until it is."""
        if self.hang_s is None:
            return False
        now = time.monotonic() if now is None else now
        return any(s.state == "up" and now - s.answered_at > self.hang_s for s in self._slots)

    def settle_all(self, timeout_s: float = 5.0) -> list[FleetEvent]:
        """The events of rebuilds still waiting for their clients' replay, as they stand now
        (the run is ending: no more replay will come), after any a control call's rebuild left."""
        events, self._held = self._held, []
        for i, slot in enumerate(self._slots):
            if slot.state == "up" and slot.settling:
                if slot.info is None:
                    slot.info = slot.handle.recovery_info.remote()
                ray.wait([slot.info], timeout=timeout_s)
                event = self._check_settled(i, slot, float("inf"))
                if event:
                    events.append(event)
        return events

    def _check(self, i: int, slot: Slot, now: float) -> None:
        try:
            if slot.pending_snapshot is not None:
                version_ref, snap_ref = slot.pending_snapshot
                if ray.wait([version_ref], timeout=0, fetch_local=False)[0]:
                    self._keep_snapshot(slot, ray.get(version_ref), snap_ref, now)
        except RayActorError as exc:
            if outcome_of(exc).status == DIED:
                return self._died(i, slot, "snapshot", now)
            slot.pending_snapshot = None  # not known gone: asked again when the next one is due
        try:
            if slot.ping is not None and ray.wait([slot.ping], timeout=0)[0]:
                _, version, _ = ray.get(slot.ping)
                slot.known_version = max(version, slot.known_version or 0)
                slot.ping, slot.answered_at = None, slot.ping_at
        except RayActorError as exc:
            if outcome_of(exc).status == DIED:
                return self._died(i, slot, "ping", now)
            # not known gone: asked again, its silence counted from the first unanswered ping
            slot.ping = slot.handle.status.remote()
        if slot.ping is not None and self.hang_s is not None and now - slot.ping_at > self.hang_s:
            # stopped (SIGSTOP), stuck: its clients would wait on it; a rebuild replaces it
            return self._stop(i, slot, f"no answer to a ping for {self.hang_s:.0f}s", now)
        if slot.ping is None:
            slot.ping, slot.ping_at = slot.handle.status.remote(), now
        if slot.pending_snapshot is None and now - slot.last_snapshot_at >= self.snapshot_every_s:
            slot.pending_snapshot = tuple(slot.handle.snapshot.remote())
            slot.last_snapshot_at = now

    def _stop(self, i: int, slot: Slot, detected_by: str, now: float) -> None:
        """A live shard that does not answer: killed, then dead (rebuilt at the next poll)."""
        try:
            ray.kill(slot.handle, no_restart=True)
        except Exception:
            pass
        self._died(i, slot, detected_by, now)

    def _died(self, i: int, slot: Slot, detected_by: str, now: float) -> None:
        slot.state, slot.dead_at, slot.detected_by = "dead", time.monotonic(), detected_by
        slot.version_at_death = slot.known_version
        slot.ping = slot.pending_snapshot = slot.info = None
        slot.settling = False
        for other in self._slots:  # a synchronous round cannot close without this shard
            if other is not slot and other.state == "up":
                other.handle.abort_rounds.remote()

    def _rebuild(self, i: int, slot: Slot, now: float) -> None:
        try:
            handle = ParameterShard.options(name=incarnation_name(self.names[i], slot.generation + 1),
                                            namespace=self.namespace, max_restarts=0,
                                            scheduling_strategy=self.placement).remote(
                None, *self._args, snapshot=slot.snapshot_ref, generation=slot.generation + 1)
        except ValueError:  # the name is held (an incarnation left from an earlier driver): skip it
            slot.generation += 1
            return
        slot.handle, slot.generation, slot.state = handle, slot.generation + 1, "starting"
        slot.rebuilt_from = slot.known_version = slot.snapshot_version  # versions restart from the snapshot
        for rank, step in self._membership.items():  # the snapshot may predate these
            if step is None:
                handle.forget_replica.remote(rank)
            else:
                handle.welcome_replica.remote(rank, step)
        slot.starting = handle.status.remote()
        self.rebuilds += 1

    def _check_started(self, i: int, slot: Slot, now: float) -> None:
        if not ray.wait([slot.starting], timeout=0)[0]:
            return
        try:
            ray.get(slot.starting)
        except RayActorError as exc:
            if outcome_of(exc).status == DIED:
                slot.state = "dead"  # the new incarnation died too: try again (same snapshot)
            else:  # not known gone: asked again
                slot.starting = slot.handle.status.remote()
            return
        slot.recovery_s = time.monotonic() - slot.dead_at
        slot.state, slot.starting, slot.settling = "up", None, True
        slot.settle_deadline = now + self.settle_s
        slot.last_snapshot_at = now  # its restored state is the latest snapshot

    def _check_settled(self, i: int, slot: Slot, now: float) -> Optional[dict]:
        if slot.info is None:
            slot.info = slot.handle.recovery_info.remote()
            return None
        if not ray.wait([slot.info], timeout=0)[0]:
            return None
        try:
            info = ray.get(slot.info)
        except RayActorError as exc:  # died again (_check notices), or not known gone: asked again
            if outcome_of(exc).status == HUNG:
                slot.info = None
            return None
        slot.info = None
        event = rebuild_event(i, slot, info, now)
        if event is not None:
            slot.settling = False
        return event

    # ---- control calls: per-shard outcomes, never a raw Ray error -------------------------
    def outcomes(self, method: str, *args, per_shard: Optional[Any] = None, timeout_s: float = 10.0,
                 only: Optional[list[int]] = None) -> dict[int, Outcome]:
        """Call every shard (or those of `only`; `per_shard(i)`: shard i's arguments), waiting
        at most `timeout_s` in all (not per shard); what each came to: ok(value), died (gone, or
        down and being rebuilt), hung (no answer in time: stopped, its node gone), raised."""
        which = range(len(self._slots)) if only is None else only
        refs = {i: getattr(self._slots[i].handle, method).remote(*(per_shard(i) if per_shard else args))
                for i in which if self._slots[i].state == "up"}
        outs = gather(refs, timeout_s)
        for i in which:
            if i not in refs:
                outs[i] = Outcome(DIED, detail=f"being rebuilt ({self._slots[i].detected_by})")
        return {i: outs[i] for i in sorted(outs)}

    def _all(self, method: str, *args, timeout_s: float = 10.0) -> list:
        """A call every live shard may miss: None in a dead or silent shard's place, left to
        poll() to find and rebuild (never an error of the caller's)."""
        return [o.value if o.ok else None for o in self.outcomes(method, *args, timeout_s=timeout_s).values()]

    def on_every_shard(self, method: str, per_shard: Any, what: str, timeout_s: float = 60.0,
                       snapshot: bool = True) -> dict[int, Any]:
        """A call every shard must answer (a switch's reseed, a resume's optimizer states): a
        shard that died or does not answer is rebuilt now from its snapshot (waited for) and
        asked again, up to ATTEMPTS times; with `snapshot`, each shard is snapshotted once it
        answered (a rebuild after that keeps what the call gave it; one whose snapshot fails
        is asked again). A call that raised is the caller's error (TrainingError). Shard ->
        answer."""
        todo, answers = list(range(len(self._slots))), {}
        for _ in range(ATTEMPTS):
            outs = self.outcomes(method, per_shard=per_shard, timeout_s=timeout_s, only=todo)
            raised = {f"shard {i}": o for i, o in outs.items() if o.status == RAISED}
            if raised:
                raise TrainingError(f"{what}: {describe(raised)}")
            answered = [i for i, o in outs.items() if o.ok]
            answers.update({i: outs[i].value for i in answered})
            if snapshot and answered:
                snaps = self.snapshot_now(timeout_s, only=answered)
                answered = [i for i in answered if i in snaps and snaps[i].ok]
            todo = [i for i in todo if i not in answered]
            if not todo:
                return answers
            self.rebuild_now(todo, f"{what}: no answer", timeout_s)
        raise TrainingError(f"{what}: shards {todo} did not answer after {ATTEMPTS} rebuilds")

    def rebuild_now(self, indices: list[int], why: str, timeout_s: float) -> None:
        """Rebuild shards `indices` now (a live one that did not answer is stopped first) and wait
        until each is up again, at most `timeout_s` or REBUILD_WAIT_S, whichever is longer (the
        call's own timeout bounds an answer, not a process start); their rebuild events come
        with the next poll()."""
        now = time.monotonic()
        for i in indices:
            slot = self._slots[i]
            if slot.state == "up":  # stopped (SIGSTOP), stuck: a rebuild replaces it
                self._stop(i, slot, why, now)
        timeout_s = max(timeout_s, REBUILD_WAIT_S)
        deadline = time.monotonic() + timeout_s
        while any(self._slots[i].state != "up" for i in indices):
            if time.monotonic() > deadline:
                raise TrainingError(f"{why}: shards {[i for i in indices if self._slots[i].state != 'up']} "
                                    f"not rebuilt within {timeout_s:g}s")
            self._held += self.poll()
            time.sleep(0.05)

    def forget_replica(self, rank: int, timeout_s: float = 10.0, wait: bool = True) -> None:
        """A replica died: no shard's staleness clock waits for `rank` again (kept across rebuilds),
        and every shard is snapshotted now. The replica's replay log died with it, so the updates
        it had acknowledged since the last snapshot live only in the shards until the next one:
        a shard dying in that window would lose them."""
        self._membership[rank] = None
        self.snapshot_soon()
        if wait:
            self._all("forget_replica", rank, timeout_s=timeout_s)
        else:
            for s in self._slots:
                if s.state == "up":
                    s.handle.forget_replica.remote(rank)

    def welcome_replica(self, rank: int, step: int, timeout_s: float = 10.0) -> None:
        """A replacement replica takes `rank` at clock `step` on every shard (kept across rebuilds)."""
        self._membership[rank] = step
        self._all("welcome_replica", rank, step, timeout_s=timeout_s)

    def observed_max_lead(self, timeout_s: float = 10.0) -> int:
        """The largest lead over the slowest replica shard 0 saw at a push (SSP check). Shard 0
        only: its clocks are the ones max_staleness holds replicas to. Another shard can see one
        step more, when a slow replica's push has reached shard 0 and not yet it (measured: 5
        with max_staleness 3 and 2 shards). 0 while shard 0 is down or silent."""
        out = self.outcomes("observed_max_lead", timeout_s=timeout_s, only=[0])[0]
        return int(out.value or 0) if out.ok else 0

    def abort_rounds(self, timeout_s: float = 10.0) -> int:
        """Abort every open synchronous EASGD round on every shard (ParameterShard.abort_rounds)."""
        return sum(v or 0 for v in self._all("abort_rounds", timeout_s=timeout_s))

    def reseed(self, values: Optional[np.ndarray], optimizer: tuple, clocks: dict[int, int],
               timeout_s: float = 60.0) -> None:
        """A phase switch: every shard takes its slice of `values` (None: keeps its own), a fresh
        server optimizer (name, lr, momentum, weight_decay) and the replicas' clocks, then a
        snapshot, so a rebuild starts from the new contents. A shard lost on the way is rebuilt
        and reseeded (`on_every_shard`): with `values` None from its snapshot, what it held."""
        self._args = (*optimizer, self._args[-1])
        for rank, step in clocks.items():  # a shard rebuilt in the middle takes them from its membership
            self._membership[rank] = step
        self.on_every_shard("reseed", lambda i: (None if values is None else values[slice(*self.bounds[i])],
                                                 optimizer, clocks), "reseeding the shards", timeout_s)

    def optimizer_states(self, timeout_s: float = 30.0) -> list[dict]:
        """Each shard's server-optimizer state (a checkpoint's `shards` part); TrainingError naming
        each shard that did not answer (the checkpoint goes without the part and says so)."""
        return all_answers(self.outcomes("optimizer_state", timeout_s=timeout_s))

    def load_optimizer_states(self, states: list[dict], timeout_s: float = 60.0) -> None:
        """A resumed run: each shard goes on with the server-optimizer state a checkpoint kept,
        then a snapshot, so a rebuild keeps it too (a shard lost on the way: rebuilt, loaded again)."""
        if len(states) != len(self._slots):
            raise ValueError(f"the checkpoint holds {len(states)} shards' optimizer states, the run has "
                             f"{len(self._slots)} shards")
        self.on_every_shard("load_optimizer_state", lambda i: (states[i],), "loading the shards' optimizer states",
                            timeout_s)

    def values(self, timeout_s: float = 30.0) -> np.ndarray:
        """The reference parameters, concatenated (TrainingError naming a shard that is down)."""
        return np.concatenate(all_answers(self.outcomes("values", timeout_s=timeout_s), "the shards' values"))

    def buffers(self, timeout_s: float = 30.0) -> dict:
        out = self.outcomes("buffers", timeout_s=timeout_s, only=[0])[0]
        if not out.ok:
            raise TrainingError(f"the shards' buffers: shard 0 {out.status} ({out.detail})")
        return out.value

    def shutdown(self) -> None:
        """Kill every shard (their snapshots go with the group)."""
        for slot in self._slots:
            try:
                ray.kill(slot.handle, no_restart=True)
            except Exception:
                pass
            slot.snapshot_ref = slot.pending_snapshot = slot.ping = slot.info = slot.starting = None


def all_answers(outs: dict[int, Outcome], what: str = "") -> list:
    """Every shard's answer in shard order, or TrainingError naming each shard that gave none."""
    if not all(o.ok for o in outs.values()):
        missing = describe({f"shard {i}": o for i, o in outs.items()})
        raise TrainingError(f"{what}: {missing}" if what else missing)
    return [o.value for o in outs.values()]
