"""The replica group: the ModelReplica actors, their ranks, the membership generation, the
process group's rendezvous, spares and state transfer. The controller decides when; this
class does it, with a timeout on every call.

Ranks are stable names: a replacement takes the rank of the replica it replaces, so the
partition ledger's queue, the test slice and the metrics all follow it. Group ranks (positions
in the torch.distributed group) are the members' positions in rank order, recomputed each
generation. Each generation meets at a fresh TCP store (a new port on the new group rank 0):
re-initialising on the old store would hang in its barrier.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import ray

from orchestrator.config import JobConfig
from orchestrator.errors import Interrupts, MemberLost, TrainingError
from orchestrator.fleet.outcomes import DIED, HUNG, OK, RAISED, Outcome, settle, outcome_of
from orchestrator.fleet.spares import SparePool, kill as _kill
from policies.decisions.failure import error_detail
from policies.rules.modes import Diverged
from policies.rules.registry import mode_spec

READY_TIMEOUT_S = 120.0  # a new actor imports torch and builds the model
LIVENESS_TIMEOUT_S = 5.0  # after a call failed: how long members get to show they are alive
WAIT_SLICE_S = 0.5  # a wait on replicas is cut into slices of this, with on_wait between them


class ReplicaGroup:
    def __init__(self, config: JobConfig, shards: Any = None, strategy: Optional[dict[str, Any]] = None,
                 interrupts: Optional[Interrupts] = None) -> None:
        self.cfg = config
        self.interrupts = interrupts or Interrupts()  # the run's: a fan-out of calls goes out whole
        self.raw = config.model_dump()
        self.raw["multi_phase"] = len(config.strategy.plan()) > 1
        self.set_strategy(strategy or config.strategy.plan()[0])
        self.shards = shards  # the shard directory replicas resolve shards through (sharded modes)
        self.members: dict[int, Any] = {}  # rank -> ModelReplica
        self.pids: dict[int, int] = {}
        self.nodes: dict[int, str] = {}  # rank -> the Ray node its replica runs on
        self.joining: dict[int, Any] = {}  # rank -> a replica started for a grow, not yet a member
        self.replacements: set[int] = set()  # ranks whose actor replaced a failed one
        self.generation = 0
        self.spare_pool = SparePool(lambda: self._actor(None, spare=True))  # orchestrator/fleet/spares.py
        self.on_wait: Optional[Callable[[], bool]] = None  # called while the driver waits on replicas; True: a rebuild
        self.timeout_s = config.strategy.timeout_s

    def set_strategy(self, strategy: dict[str, Any], probation_until: int = -1) -> None:
        """The phase that runs now: new actors and spares put to use take its update rule, and
        its switch's probation (the last epoch in which a non-finite loss skips the step)."""
        self.raw["strategy"], self.raw["probation_until"] = strategy, probation_until
        self.spec = mode_spec(strategy["mode"])

    # ---- actors --------------------------------------------------------------------------
    def _actor(self, rank: Optional[int], spare: bool = False):
        from actors.replica.model_replica import ModelReplica

        s = self.cfg.scaling
        return ModelReplica.options(**replica_resources(s.cpus_per_replica, s.gpus_per_replica, spare),
                                    max_restarts=0).remote(rank, s.replicas, self.raw, self.shards)

    def launch(self) -> None:
        """Ask Ray for the replicas and spares and return at once (their processes boot meanwhile)."""
        n = self.cfg.scaling.replicas
        self.members = {rank: self._actor(rank) for rank in range(n)}
        self.spare_pool.launch(self.cfg.fault_tolerance.spares)

    @property
    def spares(self) -> list[Any]:
        """The idle pre-started replicas (orchestrator/fleet/spares.py)."""
        return self.spare_pool.actors

    def wait_ready(self) -> None:
        ranks = sorted(self.members)
        pids = self._get([self.members[r].pid.remote() for r in ranks], "replicas starting", READY_TIMEOUT_S, ranks)
        self.pids = dict(zip(ranks, pids))
        self._locate(ranks)

    def _locate(self, ranks: list[int]) -> None:
        nodes = self._get([self.members[r].node_id.remote() for r in ranks], "replica nodes", self.timeout_s, ranks)
        self.nodes.update(zip(ranks, nodes))

    # ---- a grow: replicas started now, members at the next epoch boundary -------------------
    def start_joining(self, ranks: list[int]) -> dict[int, Any]:
        """Start replicas for `ranks` in the phase that runs now; returns each one's pid() call
        (ready once it resolves)."""
        for rank in ranks:
            self.joining[rank] = self._actor(rank)
        return {rank: self.joining[rank].pid.remote() for rank in ranks}

    def admit(self, ready: dict[int, Any], method: Optional[str] = None, *args: Any,
              what: str = "state for new replicas") -> tuple[list[int], dict[int, str]]:
        """Replicas started for a grow become members, last: each that answered its pid() call
        (`ready`: rank -> that call) is first given its state by `method(*args)` (load_state of a
        member's export, sync_from_shards; none: the caller gives it after) and only those that
        took it join. Returns (the ranks that joined, {rank: what happened} for newcomers that
        died, hung or failed: stopped and forgotten, each on its own; the members are not looked
        at). A member whose death left the state unavailable (the donor of `args`) is MemberLost,
        and the newcomers stay started, not members, for the grow to be carried out again. One
        whose rank was filled meanwhile (a replacement took it) is stopped: a member is never
        overwritten and orphaned."""
        for rank in [r for r in ready if r in self.joining and r in self.members]:
            _kill(self.joining.pop(rank))
        ranks = [r for r in ready if r in self.joining]
        actors = {r: self.joining[r] for r in ranks}
        started = self._outcomes({r: ready[r] for r in ranks}, actors, "new replicas", self.timeout_s)
        failed = {r: _said(o) for r, o in started.items() if not o.ok}
        alive = [r for r in ranks if started[r].ok]
        if method is not None and alive:
            with self.interrupts.whole():
                refs = {r: getattr(actors[r], method).remote(*args) for r in alive}
            given = self._outcomes(refs, {r: actors[r] for r in alive}, what, self.timeout_s)
            if any(o.actor_error and o.status == RAISED for o in given.values()):
                lost = self.lost_members()  # the donor, gone or unreachable: the newcomers wait for the next try
                if lost:
                    raise MemberLost(list(lost), what, causes=lost)
            failed.update({r: _said(o) for r, o in given.items() if not o.ok})
            alive = [r for r in alive if given[r].ok]
        for rank in failed:
            _kill(self.joining.pop(rank))
        for rank in alive:
            self.members[rank] = self.joining.pop(rank)
            self.pids[rank] = started[rank].value
        self._locate(alive)
        return alive, failed

    def abandon_joining(self, ranks: list[int]) -> None:
        for rank in ranks:
            _kill(self.joining.pop(rank, None))

    @property
    def ranks(self) -> list[int]:
        return sorted(self.members)

    def handles(self) -> list[Any]:
        return [self.members[r] for r in self.ranks]

    def remove(self, rank: int) -> None:
        """Stop the actor of `rank` (already dead, hung or failed) and forget it."""
        actor = self.members.pop(rank, None)
        self.pids.pop(rank, None)
        self.nodes.pop(rank, None)
        _kill(actor)

    def replace(self, rank: int, draining: tuple[str, ...] = ()) -> tuple[str, float]:
        """Put a new replica in `rank`'s place: a spare at once if one is ready and not on a node
        in `draining` (a new spare is then started in the background), else a new actor.
        Returns (how, seconds taken)."""
        t0 = time.perf_counter()
        how = "new_actor"
        actor = None
        _kill(self.joining.pop(rank, None))  # a grow's replica of the same rank: the rank is this one's
        for spare in self.spare_pool.take(draining):  # the pool keeps its size whatever this one does
            try:
                self.pids[rank] = self._get(spare.assign.remote(rank, self.cfg.scaling.replicas, self.raw["strategy"],
                                                                self.raw["probation_until"]),
                                            "spare", self.timeout_s)
                actor, how = spare, "spare"
                break
            except TrainingError:  # the spare itself died: try the next, or a new actor
                _kill(spare)
        if actor is None:
            actor = self.members[rank] = self._actor(rank)  # a member already: its death is a MemberLost
            self.pids[rank] = self._get(actor.pid.remote(), f"replacement for replica {rank}", READY_TIMEOUT_S, [rank])
        self.members[rank] = actor
        self.replacements.add(rank)
        self._locate([rank])
        return how, time.perf_counter() - t0

    # ---- membership ----------------------------------------------------------------------
    def form(self) -> int:
        """Start a new generation over the current members: the process group (modes that use
        one) re-formed at a fresh store, or the members told the new size (lock-step EASGD's
        rounds). Survivors stay the same processes. Returns the generation."""
        self.generation += 1
        ranks, world = self.ranks, len(self.members)
        if self.spec.process_group:
            head = self.members[ranks[0]]
            addr, port = self._get(head.rendezvous_address.remote(), "rendezvous", self.timeout_s, ranks[:1])
            timeout = self.cfg.fault_tolerance.hang_timeout_s
            with self.interrupts.whole():  # a rendezvous every member must reach
                refs = [self.members[r].join_group.remote(addr, port, i, world, self.generation, timeout)
                        for i, r in enumerate(ranks)]
            self._get(refs, f"process group generation {self.generation}", self.timeout_s + 60, ranks)
        else:
            self.call(ranks, "regroup", world, self.generation, what="regroup")
        return self.generation

    def transfer_state(self, donor: int, to: list[int]) -> None:
        """allreduce: `to` become copies of `donor` (parameters, buffers, optimizer state, step),
        through the object store."""
        if not to:
            return
        state = self.members[donor].export_state.remote()
        self.call(to, "load_state", state, what=f"state from replica {donor}", peers=False)

    def call(self, ranks: list[int], method: str, *args: Any, what: str = "", timeout_s: Optional[float] = None,
             per_rank: Optional[Callable[[int], tuple]] = None, peers: bool = True) -> list[Any]:
        """Call `method` on the replicas of `ranks` (arguments per rank from `per_rank`); their
        answers in rank order, or MemberLost naming every member that died or stayed silent
        (`outcomes` says what each came to). Every member does the same work, so with `peers`
        (the default) a member still silent fault_tolerance.hang_timeout_s after the first answer
        is hung, whatever is left of the call's timeout (a replica stopped at an epoch's end
        surfaces in seconds, not after strategy.timeout_s). `peers=False` for members that may
        still be starting (newcomers: one may boot later than another)."""
        outs = self.outcomes(ranks, method, *args, what=what, timeout_s=timeout_s, per_rank=per_rank, peers=peers)
        return self.settle(outs, what or method)

    def outcomes(self, ranks: list[int], method: str, *args: Any, what: str = "", timeout_s: Optional[float] = None,
                 per_rank: Optional[Callable[[int], tuple]] = None, peers: bool = True) -> dict[int, Outcome]:
        """`call` without a verdict: what the call came to on each rank."""
        with self.interrupts.whole():
            refs = {r: getattr(self.members[r], method).remote(*(per_rank(r) if per_rank else args)) for r in ranks}
        timeout = timeout_s or self.timeout_s
        after_first = self.cfg.fault_tolerance.hang_timeout_s if peers and len(refs) > 1 else None
        return self._outcomes(refs, {r: self.members[r] for r in ranks}, what or method, timeout, after_first)

    def _outcomes(self, refs: dict[Any, Any], actors: dict[Any, Any], what: str, timeout: float,
                  after_first: Optional[float] = None) -> dict[Any, Outcome]:
        """Wait for every ref of `refs` (key -> the call's ref; `actors`: key -> the actor asked)
        and say what each came to: ok(value), died (its actor is gone: checked, not guessed from
        the error), hung (no answer in time), raised (the call failed, or an input it was given
        came from an actor that died)."""
        silence = ""
        try:
            self._wait_all(list(refs.values()), timeout, after_first)
        except ray.exceptions.GetTimeoutError as exc:
            silence = str(exc)
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=0)
        ready = set(ready)
        outs: dict[Any, Outcome] = {}
        suspects = []
        for key, ref in refs.items():
            if ref not in ready:
                outs[key] = Outcome(HUNG, detail=silence)
                continue
            try:
                outs[key] = Outcome(OK, ray.get(ref, timeout=0))
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
                # its actor died or is unreachable, or the node holding its answer went (ObjectLostError), or an
                # input's maker did: the actor itself is asked below (died, hung), else the call raised
                outs[key] = Outcome(RAISED, detail=outcome_of(exc).detail, actor_error=True)
                suspects.append(key)
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                outs[key] = Outcome(RAISED, detail=error_detail(type(cause).__name__, str(cause)), traceback=str(exc),
                                    fatal=isinstance(cause, Diverged))
        for key, status in self._lost({k: actors[k] for k in suspects if k in actors}).items():
            outs[key] = Outcome(status, detail=outs[key].detail)
        return outs

    def settle(self, outs: dict[int, Outcome], what: str) -> list[Any]:
        """Members' outcomes as answers in rank order, or the failure they came to
        (orchestrator/fleet/outcomes.py: settle)."""
        return settle(outs, what, self.lost_members)

    def _wait_all(self, refs, timeout: float, after_first: Optional[float] = None) -> None:
        """Wait for `refs` in slices, calling `on_wait` between them (the driver's shard watch: a
        replica may be waiting for a shard the driver has to rebuild); GetTimeoutError past
        `timeout`, or once some have answered and the rest stay silent `after_first` seconds
        longer (counted again from a server's or shard's rebuild that `on_wait` reports)."""
        refs = list(refs) if isinstance(refs, (list, tuple)) else [refs]
        deadline, first = time.monotonic() + timeout, None
        while True:
            until = deadline if first is None else min(deadline, first + after_first)
            left = until - time.monotonic()
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, min(WAIT_SLICE_S, left)))
            if len(ready) == len(refs):
                return
            now = time.monotonic()
            if ready and first is None and after_first is not None:
                first = now
            if now >= deadline:
                raise ray.exceptions.GetTimeoutError(f"no answer within {timeout:.0f}s")
            if first is not None and now >= first + after_first:
                raise ray.exceptions.GetTimeoutError(
                    f"{len(refs) - len(ready)} of {len(refs)} silent {after_first:.0f}s after the others answered "
                    f"(fault_tolerance.hang_timeout_s)")
            if self.on_wait is not None and self.on_wait() and first is not None:
                first = time.monotonic()  # waiting on a server or shard being rebuilt is no hang

    def dead_members(self, timeout_s: float = LIVENESS_TIMEOUT_S) -> list[int]:
        """The members whose actors are gone (asked: a fresh call to each reads `died`)."""
        return sorted(r for r, status in self._lost(dict(self.members), timeout_s).items() if status == DIED)

    def lost_members(self, timeout_s: float = LIVENESS_TIMEOUT_S) -> dict[int, str]:
        """The members whose actors are gone (or unreachable), asked: rank -> died (outcome_of)."""
        return self._lost(dict(self.members), timeout_s)

    @staticmethod
    def _lost(actors: dict[Any, Any], timeout_s: float = LIVENESS_TIMEOUT_S) -> dict[Any, str]:
        """The keys of `actors` whose actor a fresh call finds gone, as outcomes.outcome_of reads
        it (an unreachable one too): key -> died. One that does not answer in time (busy,
        stopped) is not known to be lost."""
        if not actors:
            return {}
        refs = {k: a.pid.remote() for k, a in actors.items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        lost = {}
        for key, ref in refs.items():
            try:
                ray.get(ref, timeout=0)
            except Exception as exc:  # not answered yet (GetTimeoutError: no actor error in it) is not lost
                out = outcome_of(exc)
                if out.actor_error and out.status in (DIED, HUNG):
                    lost[key] = out.status
        return dict(sorted(lost.items()))

    def shutdown(self) -> None:
        for actor in list(self.members.values()) + list(self.joining.values()):
            _kill(actor)
        self.spare_pool.shutdown()
        self.members, self.joining = {}, {}

    def _get(self, refs, what: str, timeout: float, ranks: Optional[list[int]] = None):
        """Wait for `refs` (one ref or a list): their values, or the failure they came to. With
        `ranks` (the members asked, in the refs' order) a member that died or hung is MemberLost;
        without (a spare, a newcomer: not members) any failure is a TrainingError: it says
        nothing about the members."""
        single = not isinstance(refs, (list, tuple))
        refs = [refs] if single else list(refs)
        if ranks is not None:
            values = self.settle(self._outcomes(dict(zip(ranks, refs)), {r: self.members[r] for r in ranks},
                                                what, timeout), what)
        else:
            outs = self._outcomes(dict(enumerate(refs)), {}, what, timeout)
            bad = next((o for o in outs.values() if o.status != OK), None)
            if bad is not None:
                raise TrainingError(f"{what}: {bad.status}" + (f" ({bad.detail})" if bad.detail else ""))
            values = [outs[i].value for i in range(len(refs))]
        return values[0] if single else values


def _said(out: Outcome) -> str:
    return out.status + (f" ({out.detail})" if out.detail else "")


def replica_resources(cpus_per_replica: float, gpus_per_replica: float, spare: bool) -> dict[str, float]:
    """What a replica reserves. A spare holds memory, not CPU; but with GPUs it holds its GPU
    too: Ray gives a process only the GPUs it reserved (CUDA_VISIBLE_DEVICES), a replica builds
    its model on its device at start, and an actor's resources cannot change once it runs."""
    return {"num_cpus": 0 if spare else cpus_per_replica, "num_gpus": gpus_per_replica}
