"""Spares (fault_tolerance.spares): idle pre-started replicas that take a failed or evacuated
replica's rank at once (orchestrator/fleet/replica_group.py: ReplicaGroup.replace). The pool
keeps its size: a spare put to use, found dead, or sitting on a node being drained (a
preemption notice: orchestrator/fleet/drains.py) is replaced by a new one, which Ray places on a
node that is not being drained. Never waits on a spare: each is asked for its pid every
SPARE_PING_S, and the answer is read on a later look."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional

import ray

from orchestrator.fleet.outcomes import DIED, outcome_of

SPARE_PING_S = 2.0  # how often idle spares are asked whether they are alive


class SparePool:
    def __init__(self, start: Callable[[], Any]) -> None:
        self._start = start  # () -> a new spare actor
        self.actors: list[Any] = []
        self.sample: Any = None  # a ref to a few rows spares rehearse a step on (set once data is in the store)
        self._pings: dict[int, Any] = {}  # id(spare) -> its pending pid() call
        self._nodes: dict[int, Any] = {}  # id(spare) -> its node_id() call, then the node id (hex)
        self._warming: dict[int, Any] = {}  # id(spare) -> its warm_up() call, until it is reported ready
        self._asked: dict[int, float] = {}  # id(spare) -> when it was asked for (monotonic)
        self._due = 0.0

    def launch(self, n: int) -> None:
        self.actors = [self._new(warm=False) for _ in range(n)]

    def warm(self, sample: Any) -> None:
        """Have every spare rehearse one step on `sample` (in the background)."""
        self.sample = sample
        for spare in self.actors:
            self._warming[id(spare)] = spare.warm_up.remote([sample])

    def _new(self, warm: bool = True) -> Any:
        spare = self._start()
        self._asked[id(spare)] = time.monotonic()
        self._nodes[id(spare)] = spare.node_id.remote()
        if warm and self.sample is not None:
            self._warming[id(spare)] = spare.warm_up.remote([self.sample])
        return spare

    @property
    def warming(self) -> int:
        """How many spares are still starting (asked for a rehearsal, not yet reported ready)."""
        return len(self._warming)

    def ready(self) -> list[dict[str, float]]:
        """Spares whose rehearsal finished since the last look (never waits), each once:
        `ready_s` from being asked for to ready, `rehearsal_s`, and `cpu_s`, the CPU seconds its
        process used to get there (on a node short of cores, taken from the training beside it).
        A spare that died warming up is not reported (`check` replaces it)."""
        out = []
        for spare in self.actors:
            call = self._warming.get(id(spare))
            if call is None or not ray.wait([call], timeout=0)[0]:
                continue
            del self._warming[id(spare)]
            try:
                figures = ray.get(call, timeout=0)
            except Exception:  # noqa: BLE001 - dead while warming up: the pings find it
                continue
            out.append({"ready_s": time.monotonic() - self._asked.get(id(spare), time.monotonic()), **figures})
        return out

    def node(self, spare: Any) -> Optional[str]:
        """The node `spare` runs on, once it answered (None before)."""
        node = self._nodes.get(id(spare))
        if isinstance(node, ray.ObjectRef):
            if not ray.wait([node], timeout=0)[0]:
                return None
            try:
                node = self._nodes[id(spare)] = ray.get(node, timeout=0)
            except Exception:  # noqa: BLE001 - dead: the pings find it
                return None
        return node

    def usable(self, draining: Iterable[str] = ()) -> int:
        """How many spares are not on a node being drained."""
        draining = set(draining)
        return sum(1 for s in self.actors if self.node(s) not in draining)

    def take(self, draining: Iterable[str] = ()):
        """Each spare in turn for a rank to use (those on a node being drained are skipped); each
        one handed out is replaced by a new one at once, whatever it comes to."""
        draining = set(draining)
        for spare in list(self.actors):
            if self.node(spare) in draining:
                continue
            self._drop(spare)
            self.actors.append(self._new())
            yield spare

    def _drop(self, spare: Any) -> None:
        self.actors.remove(spare)
        for known in (self._pings, self._nodes, self._warming, self._asked):
            known.pop(id(spare), None)

    def move_off(self, draining: Iterable[str]) -> list[str]:
        """Spares on a node being drained: stopped and replaced by new ones (placed elsewhere).
        The nodes they were on, one entry per spare moved."""
        draining, moved = set(draining), []
        for spare in list(self.actors):
            node = self.node(spare)
            if node in draining:
                self._drop(spare)
                kill(spare)
                self.actors.append(self._new())
                moved.append(node)
        return moved

    def check(self, now: Optional[float] = None) -> int:
        """Replace spares whose process died (the OOM killer, a lost node) with new ones, so a
        failure still finds one; returns how many were replaced (module doc: never waits)."""
        now, replaced = time.monotonic() if now is None else now, 0
        if now < self._due:
            return 0
        self._due = now + SPARE_PING_S
        for spare in list(self.actors):
            ping = self._pings.pop(id(spare), None)
            if ping is not None and not ray.wait([ping], timeout=0)[0]:
                self._pings[id(spare)] = ping  # not answered yet (e.g. still warming up)
                continue
            if ping is not None:
                try:
                    ray.get(ping, timeout=0)
                except Exception as exc:  # noqa: BLE001 - died (or unreachable): replaced; else not known to be dead
                    if outcome_of(exc).status == DIED:
                        self._drop(spare)
                        self.actors.append(self._new())
                        replaced += 1
                        continue
            self._pings[id(spare)] = spare.pid.remote()
        return replaced

    def shutdown(self) -> None:
        for spare in self.actors:
            kill(spare)
        self.actors, self._pings, self._nodes, self._warming, self._asked = [], {}, {}, {}, {}


def kill(actor: Any) -> None:
    """Stop an actor that may already be gone (None: nothing to stop)."""
    if actor is None:
        return
    try:
        ray.kill(actor, no_restart=True)
    except Exception:
        pass
