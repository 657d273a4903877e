"""Named incarnations of a rebuilt actor (a parameter shard, the partition server).

Ray keeps the name of an actor whose process died (SIGKILL, the OOM killer, a lost node) taken;
only ray.kill frees it. So every rebuild takes a name of its own (`incarnation_name`), and the
actors' clients look for the newest one after the one they hold (`find_successor`).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import ray
from ray.exceptions import GetTimeoutError, RayActorError

LOOKAHEAD = 8  # incarnations a reconnecting client looks for past the one it holds
POLL_S = 0.05  # how often a client looks a successor up while it is being rebuilt


def incarnation_name(base: str, generation: int) -> str:
    """The actor name of `base`'s incarnation `generation` (generation 0 is `base` itself)."""
    return base if generation == 0 else f"{base}-g{generation}"


def find_successor(base: str, namespace: Optional[str], generation: int, failed: Any, deadline: float,
                   probe: Callable[[Any], Any]) -> Optional[tuple[Any, int]]:
    """The newest live incarnation of `base` after `generation` (not the actor `failed`) and
    the generation its `probe(handle)` call answers with; None while none answers (the driver
    has not rebuilt it yet, or every newer one died too)."""
    for g in range(generation + LOOKAHEAD, generation, -1):
        try:
            handle = ray.get_actor(incarnation_name(base, g), namespace=namespace)
            if failed is not None and handle._actor_id == failed._actor_id:
                continue
            return handle, ray.get(probe(handle), timeout=max(0.1, deadline - time.monotonic()))
        except (ValueError, RayActorError, GetTimeoutError):
            continue  # not started under that name (or that incarnation died too)
    return None


def wait_for_successor(base: str, namespace: Optional[str], generation: int, failed: Any, timeout_s: float,
                       probe: Callable[[Any], Any]) -> Optional[tuple[Any, int]]:
    """`find_successor`, asked again every POLL_S for at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = find_successor(base, namespace, generation, failed, deadline, probe)
        if found is not None or time.monotonic() > deadline:
            return found
        time.sleep(POLL_S)
