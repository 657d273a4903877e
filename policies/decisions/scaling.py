"""The scaling policy: how many replicas the cluster can hold now. Pure, no Ray.

Every `scaling.poll_s` seconds the caller builds a `ClusterView` from `ray.cluster_resources()`,
`ray.available_resources()` and the count of alive nodes (`ClusterView.from_resources`) and asks
`ScalingPolicy.decide(current, view)`; the `ScaleDecision` says:
- `target`: the replica count to run with;
- `kind`: "grow" (target > current), "shrink" (target < current), "hold" (target == current) or
  "fail" (the run cannot go on: fewer than `min_replicas` fit);
- `reason`: one line with the numbers behind it;
- `request_bundles`: what to ask the autoscaler for (see `ScaleDecision`).

Rules, in order (each decision's `reason` names the rule and its numbers):
1. Fewer replicas than `current` fit in the cluster's *total* resources (a node was lost): shrink
   at once to what fits: lost resources cannot be waited for. Below `min_replicas`: fail.
2. `current` is above `max_replicas`: shrink to `max_replicas`.
3. `current` is below `min_replicas` (should not happen: the failure policy ends such a run):
   grow at once to what fits if that reaches `min_replicas`, else fail.
4. Room for at least one more replica in the *available* resources while `current` <
   `max_replicas`: grow to min(`max_replicas`, current + what fits), but only once such room has
   been seen on `grow_after` consecutive polls (hysteresis: a node that flaps in and out of the
   cluster does not cause a resize storm). Until then: hold.
5. Else hold.

A replica needs `cpus_per_replica` CPUs and, when `gpus_per_replica` > 0, that many GPUs; "what
fits" in some CPUs and GPUs is the smaller of the two whole-replica counts. The policy's memory is
the `grow_streak` counter (consecutive polls with room to grow); every decision other than a
hold while waiting resets it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

KINDS = ("grow", "shrink", "hold", "fail")
_EPS = 1e-6  # Ray keeps resources in units of 1e-4: 0.6 CPU / 0.2 per replica is 3 replicas, not 2.999...


@dataclass(frozen=True)
class ClusterView:
    """What the cluster has for replicas at one poll.

    `total_*`: every alive node's resources (`ray.cluster_resources()`), the run's own replicas'
    reservations included; `available_*`: what nobody holds now (`ray.available_resources()`): the
    room new replicas could take. Replica spares and parameter shards reserve no CPU, so they do not
    count against either.
    """

    total_cpus: float
    available_cpus: float
    total_gpus: float = 0.0
    available_gpus: float = 0.0
    alive_nodes: int = 1

    def __post_init__(self) -> None:
        for name in ("total_cpus", "available_cpus", "total_gpus", "available_gpus", "alive_nodes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_resources(cls, total: Mapping[str, float], available: Mapping[str, float],
                       alive_nodes: int) -> "ClusterView":
        """From `ray.cluster_resources()` and `ray.available_resources()` (their "CPU" and "GPU"
        keys; a missing key is 0) and the count of alive nodes (`ray.nodes()` with `Alive`)."""
        return cls(total_cpus=float(total.get("CPU", 0.0)), available_cpus=float(available.get("CPU", 0.0)),
                   total_gpus=float(total.get("GPU", 0.0)), available_gpus=float(available.get("GPU", 0.0)),
                   alive_nodes=int(alive_nodes))


@dataclass(frozen=True)
class ScaleDecision:
    """What to run with and what to ask the autoscaler for.

    `request_bundles` is meant for `ray.autoscaler.sdk.request_resources(bundles=...)`, sent as is
    after every decision:
    - a non-empty list (while `target` < `max_replicas`) asks the autoscaler to make the cluster big
      enough for `max_replicas` replicas: one `{"CPU": cpus_per_replica[, "GPU": gpus_per_replica]}`
      bundle per replica of the run at `max_replicas`, the running ones included. Ray fits the
      requested bundles on the nodes' resources *as if they were idle* (its docstring: "this takes
      into account existing resource usage"; request 100 CPUs with 45 in use and it sizes the
      cluster for 100, not 145), so a request for only the missing replicas would be covered by
      the nodes the running replicas already sit on and add nothing;
    - an empty list withdraws the request (at `max_replicas` there is nothing more to ask for; a
      failed run asks for nothing). Withdrawing does not shrink the cluster under running replicas:
      the autoscaler only removes idle nodes.
    The request is one value for the whole cluster and the last writer wins: a later
    `request_resources` call from anyone (this run's next poll, another job, Ray Data's autoscaling
    coordinator) replaces it rather than adding to it. Re-sending the bundles on every poll restores
    this run's request if someone else overwrote it, and overwrites theirs in turn.
    """

    target: int
    kind: str
    reason: str
    request_bundles: list[dict[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")


@dataclass
class ScalingPolicy:
    min_replicas: int
    max_replicas: int
    cpus_per_replica: float
    gpus_per_replica: float = 0.0
    grow_after: int = 2  # consecutive polls with room to grow before a grow
    grow_streak: int = 0  # memory: consecutive polls so far with room to grow

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas ({self.min_replicas}) <= max_replicas ({self.max_replicas})")
        if self.cpus_per_replica <= 0 or self.gpus_per_replica < 0:
            raise ValueError(f"cpus_per_replica must be > 0 and gpus_per_replica >= 0, got {self.cpus_per_replica} "
                             f"and {self.gpus_per_replica}")
        if self.grow_after < 1:
            raise ValueError(f"grow_after must be >= 1, got {self.grow_after}")

    def bundle(self) -> dict[str, float]:
        """One replica's resources, as a bundle for `request_resources`."""
        out = {"CPU": float(self.cpus_per_replica)}
        if self.gpus_per_replica > 0:
            out["GPU"] = float(self.gpus_per_replica)
        return out

    def fits(self, cpus: float, gpus: float) -> int:
        """Whole replicas that fit in `cpus` CPUs and `gpus` GPUs."""
        n = math.floor(cpus / self.cpus_per_replica + _EPS)
        if self.gpus_per_replica > 0:
            n = min(n, math.floor(gpus / self.gpus_per_replica + _EPS))
        return max(0, n)

    def decide(self, current: int, capacity: ClusterView) -> ScaleDecision:
        """The replica count to run with, given the cluster now and `current`: the replicas the run
        has, counting those started by the last decision (call again only once they hold their
        resources, else their room in `available` is counted twice). A "fail" decision's `target`
        is what fits (< min_replicas)."""
        if current < 0:
            raise ValueError(f"current must be >= 0, got {current}")
        c = capacity
        in_total = self.fits(c.total_cpus, c.total_gpus)
        room = self.fits(c.available_cpus, c.available_gpus)
        gpus = self.gpus_per_replica > 0
        per = f"{self.cpus_per_replica:g} CPU" + (f" + {self.gpus_per_replica:g} GPU" if gpus else "")
        nodes = f"{c.alive_nodes} node{'' if c.alive_nodes == 1 else 's'}"
        total = f"{c.total_cpus:g} CPU" + (f" + {c.total_gpus:g} GPU" if gpus else "") + f" on {nodes}"
        free = f"{c.available_cpus:g} CPU" + (f" + {c.available_gpus:g} GPU" if gpus else "") + f" free on {nodes}"
        room_seen = f"room for {room} more of {per} each ({free})"

        if in_total < current:  # resources were lost: what is gone cannot be waited for
            self.grow_streak = 0
            if in_total < self.min_replicas:
                return self._fail(in_total, f"the cluster ({total}) holds {_replicas(in_total)} of {per} < "
                                  f"scaling.min_replicas {self.min_replicas} ({current} running)")
            target = min(in_total, self.max_replicas)
            return self._decision(target, "shrink", f"SHRINK {current} -> {target}: the cluster ({total}) holds "
                                  f"only {_replicas(in_total)} of {per}")
        if current > self.max_replicas:
            self.grow_streak = 0
            return self._decision(self.max_replicas, "shrink", f"SHRINK {current} -> {self.max_replicas}: "
                                  f"above max_replicas {self.max_replicas}")
        want = min(self.max_replicas, current + room)
        if current < self.min_replicas:  # below the floor: waiting for hysteresis would not help
            self.grow_streak = 0
            if want < self.min_replicas:
                return self._fail(want, f"{_replicas(current)} running and {room_seen} < scaling.min_replicas "
                                  f"{self.min_replicas}")
            return self._decision(want, "grow", f"GROW {current} -> {want}: below min_replicas {self.min_replicas}; "
                                  f"{room_seen}")
        if want > current:
            self.grow_streak += 1
            if self.grow_streak < self.grow_after:
                return self._decision(current, "hold", f"HOLD {current}: {room_seen}, seen {self.grow_streak} of "
                                      f"grow_after {self.grow_after} polls in a row")
            self.grow_streak = 0
            return self._decision(want, "grow", f"GROW {current} -> {want}: {room_seen}, seen {self.grow_after} "
                                  f"polls in a row; max_replicas {self.max_replicas}")
        self.grow_streak = 0
        if current == self.max_replicas:
            return self._decision(current, "hold", f"HOLD {current}: at max_replicas {self.max_replicas}")
        return self._decision(current, "hold", f"HOLD {current}: no room for another replica of {per} ({free}); "
                              f"max_replicas {self.max_replicas}")

    def _decision(self, target: int, kind: str, reason: str) -> ScaleDecision:
        bundles = [self.bundle() for _ in range(self.max_replicas)] if target < self.max_replicas else []
        return ScaleDecision(target, kind, reason, bundles)

    def _fail(self, fits: int, reason: str) -> ScaleDecision:
        return ScaleDecision(fits, "fail", f"FAIL: {reason}", [])


def _replicas(n: int) -> str:
    return f"{n} replica{'' if n == 1 else 's'}"


def make_scaling_policy(scaling: Any) -> ScalingPolicy:
    """The policy a ScalingConfig asks for (max_replicas unset: scaling.replicas, no growth)."""
    return ScalingPolicy(scaling.min_replicas, scaling.max_or_replicas(), scaling.cpus_per_replica,
                         scaling.gpus_per_replica, scaling.grow_after)
