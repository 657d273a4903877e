"""What a call to one actor came to, as a value: the group's calls to many replicas return one
per rank (the failure policy is handed every death and hang among them, none guessed from an
exception that happened to surface first), the shard group's one per shard (a dead or silent
shard is rebuilt, not an error of the run), the partition server's link one for the server."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

OK, DIED, HUNG, RAISED = "ok", "died", "hung", "raised"


@dataclass(frozen=True)
class Outcome:
    status: str  # ok | died (its actor is gone) | hung (no answer in time) | raised (the call failed)
    value: Any = None  # the answer, when ok
    detail: str = ""  # what went wrong, otherwise
    actor_error: bool = False  # raised with an actor's death in it (its own, or an input's maker's)

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
        except ray.exceptions.ActorUnavailableError as exc:  # not known dead: unreachable for now
            outs[key] = Outcome(HUNG, detail=f"unavailable: {str(exc).splitlines()[0] if str(exc) else ''}")
        except ray.exceptions.RayTaskError as exc:
            outs[key] = Outcome(RAISED, detail=str(exc.cause if getattr(exc, "cause", None) is not None else exc))
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
            outs[key] = Outcome(DIED, detail=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                                actor_error=True)
    return outs


def describe(outs: dict[Any, Outcome]) -> str:
    """The calls that did not come through, one phrase each: 'shard 1 hung (no answer within 5s)'."""
    return "; ".join(f"{key} {o.status} ({o.detail})" for key, o in outs.items() if not o.ok)
