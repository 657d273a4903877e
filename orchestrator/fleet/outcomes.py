"""What a call to one actor came to, as a value: the group's calls to many replicas return one
per rank (the failure policy is handed every death and hang among them, none guessed from an
exception that happened to surface first), the shard group's one per shard (a dead or silent
shard is rebuilt, not an error of the run), the partition server's link one for the server.
Every exception such a call raises is read here, once (`outcome_of`), so a replica's epoch
stream, the group's calls, the shards and the server agree on what died and what hung."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import ray

from orchestrator.errors import MemberLost, TrainingError
from policies.decisions.failure import ReplicaFailure, error_detail

OK, DIED, HUNG, RAISED = "ok", "died", "hung", "raised"


@dataclass(frozen=True)
class Outcome:
    status: str  # ok | died (its actor is gone) | hung (no answer in time, or unreachable) | raised (the call failed)
    value: Any = None  # the answer, when ok
    detail: str = ""  # what went wrong, otherwise
    actor_error: bool = False  # an actor's death or unreachability in it (its own, an input's maker's, a callee's)
    traceback: str = ""  # raised: the replica's traceback, as Ray carried it back
    fatal: bool = False  # raised an error no replica is to blame for (the model diverged): the run's end

    @property
    def ok(self) -> bool:
        return self.status == OK


def gather(refs: dict[Any, Any], timeout_s: float) -> dict[Any, Outcome]:
    """Wait once, at most `timeout_s` in all, for every call of `refs` (key -> the call's ref)
    and say what each came to: ok(value), died (its actor is gone), hung (no answer in time),
    raised (the call itself failed). For actors that are their own inputs' only source (a
    shard, the partition server): an actor error is that actor's death. Never raises a Ray error."""
    if not refs:
        return {}
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    ready = set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=0)[0])
    outs: dict[Any, Outcome] = {}
    for key, ref in refs.items():
        if ref not in ready:
            outs[key] = Outcome(HUNG, detail=f"no answer within {timeout_s:g}s")
            continue
        try:
            outs[key] = Outcome(OK, ray.get(ref, timeout=0))
        except ray.exceptions.RayError as exc:
            outs[key] = outcome_of(exc)
    return outs


def outcome_of(exc: BaseException) -> Outcome:
    """What the exception a call to one actor raised (its `ray.get`) says the call came to: the
    one reading of Ray's errors, for every caller (the group's calls, a replica's epoch stream,
    the shards, the partition server).

        RayActorError (ActorDiedError,  died: the actor's process is gone, or the node that held
        ActorUnavailableError),         its answer; an actor unreachable (its node removed or cut
        ObjectLostError                 off) is taken for gone too: Ray says it may come back but
                                        not when, and the call may or may not have run, which a
                                        lock-step group cannot wait out. A task error with an
                                        actor's death joined to it reads the same (the caller
                                        asks the actor when the death may be an input's maker's:
                                        ReplicaGroup)
        RayTaskError                    raised: the actor ran the call and it raised
        GetTimeoutError                 hung: no answer in time
        anything else                   raised"""
    first = str(exc).splitlines()[0] if str(exc) else ""
    errors = ray.exceptions
    if isinstance(exc, (errors.RayActorError, errors.ObjectLostError)):  # ActorUnavailableError is one
        return Outcome(DIED, detail=f"{type(exc).__name__}: {first}", actor_error=True)
    if isinstance(exc, errors.RayTaskError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        return Outcome(RAISED, detail=str(cause))
    if isinstance(exc, errors.GetTimeoutError):
        return Outcome(HUNG, detail=first)
    return Outcome(RAISED, detail=f"{type(exc).__name__}: {first}")


REPLICA_CAUSES = {DIED: "died", HUNG: "hung", RAISED: "error"}  # an outcome as the failure policy's cause


def replica_failure(rank: int, exc: BaseException, replacement: bool = False) -> ReplicaFailure:
    """The failure of replica `rank` whose call (its epoch stream's next item) raised `exc`, read by
    `outcome_of`: died (its process, or its item's node, is gone), hung (unreachable for now) or
    error (it raised: the error's line and the replica's traceback)."""
    out = outcome_of(exc)
    if out.status == RAISED:
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        return ReplicaFailure(rank, "error", error_detail(type(cause).__name__, str(cause)), str(exc),
                              replacement=replacement)
    gone = "the replica's process is gone (or unreachable)" if out.status == DIED else "the replica did not answer"
    return ReplicaFailure(rank, REPLICA_CAUSES[out.status], f"{gone} ({out.detail})", replacement=replacement)


def describe(outs: dict[Any, Outcome]) -> str:
    """The calls that did not come through, one phrase each: 'shard 1 hung (no answer within 5s)'."""
    return "; ".join(f"{key} {o.status} ({o.detail})" for key, o in outs.items() if not o.ok)


def settle(outs: dict[int, Outcome], what: str, lost_members: Callable[[], dict[int, str]]) -> list[Any]:
    """Members' outcomes (rank -> Outcome of one call to each) as answers in rank order, or the
    failure they came to: MemberLost for every member that died or hung (the failure policy sees
    each one); else, when one raised because an actor it depended on died (a state donor), the
    loss of the members `lost_members()` finds gone or unreachable (rank -> died | hung); else a
    TrainingError when one raised an error no replica is to blame for (the model diverged); else
    MemberLost with cause "error" for every member whose call raised (user code failing in an
    evaluation, a switch's set_mode, a repair's load_state), each with its error's line and
    traceback: the failure policy judges each, as it does an error raised in a training step."""
    lost = {r: o.status for r, o in outs.items() if o.status in (DIED, HUNG)}
    if lost:
        detail = next((outs[r].detail for r in sorted(lost) if outs[r].detail), "")
        raise MemberLost(list(lost), what + (f" ({detail})" if detail else ""), causes=lost)
    failed = {r: o for r, o in outs.items() if o.status == RAISED}
    if not failed:
        return [outs[r].value for r in sorted(outs)]
    if any(o.actor_error for o in failed.values()):
        lost_now = lost_members()
        if lost_now:
            raise MemberLost(list(lost_now), what, causes=lost_now)
    fatal = sorted(r for r, o in failed.items() if o.fatal)
    if fatal:
        raise TrainingError(f"{what}: replica {fatal[0]}: {failed[fatal[0]].detail}")
    raise MemberLost(list(failed), what, "error", errors={r: (o.detail, o.traceback) for r, o in failed.items()})
