"""Elasticity: the controller's side of growing and shrinking with the cluster. The scaling
policy (policies/decisions/scaling.py) decides how many replicas the cluster can hold; this module looks
at the cluster for it and carries the decisions out.

- Looking: every `scaling.poll_s` (from the Running loop's tick, no thread, no busy loop) a
  `ClusterView` of the alive nodes' CPUs and GPUs, total and free, leaving out nodes this run
  has seen die (`lost`: Ray's own health checks take 15-55 s to declare a node dead, the
  replicas' connections fail at once).
- Asking: while below `scaling.max_replicas` the policy's bundles go to
  `ray.autoscaler.sdk.request_resources`, sent only when they change (the request is one value
  for the whole cluster, last writer wins: re-sending an unchanged request would overwrite
  another job's for nothing); an empty request withdraws it once met, and when the run ends.
- Growing: a "grow" decision starts the new replicas at once (they boot while the epoch runs);
  once one is ready the partition server pauses the replicas at their next partition boundary
  (the phase-switch pause: allreduce replicas all stop after the same step) and the ready ones
  join (orchestrator/control/reconfig/grow.py): they take the state of a live replica (allreduce) or the shards' reference (downpour,
  easgd), the process group is re-formed over everyone, the test slices are re-cut, and the
  epoch goes on (a newcomer in allreduce steps without data until the epoch's end, its
  partitions having been dealt already; in the asynchronous modes it leases from the shared
  queue); the next epoch's partitions are spread over all. If the epoch ends before anyone
  paused, they join at the epoch boundary.
- Shrinking: a replica that died with its node (the node's raylet no longer answers) is
  replaced only if the cluster has room elsewhere; otherwise the failure policy drops it and
  the survivors go on (`placeable`), through the same reconfiguration as any failure.
- The learning rate follows the replica count (`scaling.lr_scaling`, policies/decisions/lr_scaling.py):
  every resize moves the LrSchedule (a factor over optimizer.lr), which every replica applies
  step by step in modes with a global batch (allreduce); EASGD's alpha follows beta / p in
  each replica's regroup.
Each resize is a `resize` event (direction, reason, old and new size, the learning-rate factor,
and `resize_s`: from the decision until every replica has stepped at the new size).
"""
from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import ray

from orchestrator.checks import Lane, one_line
from orchestrator.fleet.cluster import nodes as cluster_nodes
from orchestrator.control.states import RateBase
from policies.decisions.failure import ReplicaFailure
from policies.decisions.lr_scaling import LrSchedule
from policies.decisions.scaling import ClusterView, ScaleDecision, make_scaling_policy

if TYPE_CHECKING:
    from orchestrator.config import DataConfig, ScalingConfig
    from orchestrator.fleet.drains import DrainWatch
    from orchestrator.fleet.pause import PauseGate
    from orchestrator.fleet.replica_group import ReplicaGroup
    from orchestrator.reporting.reporter import Reporter

LOOK_TIMEOUT_S = 10.0  # one look at the cluster's resources
RAYLET_PROBE_TIMEOUT_S = 1.0  # a node whose raylet does not accept a connection within this is lost
JOIN_TIMEOUT_S = 120.0  # new replicas not started by then are given up (their resources never came)
POLL_FAILURES_SAID = 20  # distinct failures of the scaling poll said in a run (not one per poll forever)
# a bug in this code, not a cluster or autoscaler that did not answer: raised from the poll (the run
# ends with its traceback), never taken for a failed look and retried every scaling.poll_s
PROGRAMMING_ERRORS = (TypeError, AttributeError, NameError, AssertionError)


@dataclass
class Joining:
    """Replicas started for a grow, not yet members."""

    ranks: list[int]
    ready: dict[int, Any]  # rank -> its pid() call
    decision: ScaleDecision
    old_size: int
    t_decide_wall: float
    t_decide: float
    room_seen_wall: float  # the first poll of the streak that saw room


@dataclass
class PollFailures:
    """The scaling poll's failures said so far: each distinct one (its type and message) once, so
    a look that fails in a new way is said even after an earlier one was, and the same failure
    poll after poll is said once (at most POLL_FAILURES_SAID in a run)."""

    said: set[str] = field(default_factory=set)

    def new(self, exc: BaseException) -> Optional[str]:
        """`exc` in words ("TimeoutError: ...") if it is to be said now; None if it was already."""
        words = f"{type(exc).__name__}: {one_line(exc)}"
        if words in self.said or len(self.said) >= POLL_FAILURES_SAID:
            return None
        self.said.add(words)
        return words


@dataclass
class BatchSize:
    """The "batch_size" part: the replicas' batch now (data.adaptive_batch grows it from data.batch_size)."""

    value: int

    def state_dict(self) -> int:
        return self.value

    def load_state_dict(self, value: int) -> None:
        self.value = int(value)


@dataclass
class Elasticity:
    """The run's elasticity, given the parts it uses (never the run): the scaling and data
    sections, the replica group, the pause gate, the drain watch, the reporter and the ranks'
    last reported steps (the dict the ledger keeps, updated in place)."""

    scaling: "ScalingConfig"
    data: "DataConfig"
    group: "ReplicaGroup"
    pause: "PauseGate"
    drains: "DrainWatch"
    report: "Reporter"
    progress: dict[int, int]
    lost_nodes: set[str] = field(default_factory=set)
    requested: list[dict[str, float]] = field(default_factory=list)  # the bundles this run asked for last
    joining: Optional[Joining] = None
    _next_poll: float = 0.0
    _room_since: Optional[float] = None
    failures: PollFailures = field(default_factory=PollFailures)  # the poll's failures said so far
    lane: Lane = field(default_factory=lambda: Lane("the cluster"))  # every look and request, one thread

    def __post_init__(self) -> None:
        s = self.scaling
        self.policy = make_scaling_policy(s)
        self.lr = LrSchedule(1.0, s.replicas, s.lr_scaling, s.lr_warmup_steps)  # a factor over optimizer.lr
        self.batch = BatchSize(self.data.batch_size)

    def units(self, replicas: int) -> int:
        """The global batch in the schedule's units (scaling.replicas x data.batch_size rows are
        scaling.replicas units): replicas, times the batch's growth (data.adaptive_batch)."""
        return replicas * self.batch.value // self.data.batch_size

    # ---- looking at the cluster ----------------------------------------------------------
    def view(self, exclude: frozenset = frozenset()) -> ClusterView:
        """The alive nodes' resources, total and free, without the nodes this run saw die, those
        being drained and `exclude`."""
        listed = self.lane.call(cluster_nodes, LOOK_TIMEOUT_S, "the Ray cluster's resources")
        gone = self.lost_nodes | set(self.drains.draining) | exclude  # a drained node takes nothing new
        alive = [n for n in listed if n.alive and n.node_id not in gone]
        total = {k: sum(n.total.get(k, 0.0) for n in alive) for k in ("CPU", "GPU")}
        available = {k: sum(n.free.get(k, 0.0) for n in alive) for k in ("CPU", "GPU")}
        return ClusterView.from_resources(total, available, len(alive))

    def room_outside(self, nodes: set[str]) -> int:
        """Whole replicas that fit in what the alive nodes other than `nodes` (and those being
        drained) have free."""
        view = self.view(frozenset(nodes))
        return self.policy.fits(view.available_cpus, view.available_gpus)

    def node_lost(self, node_id: Optional[str]) -> bool:
        """The node is gone: Ray says it is dead, or its raylet no longer accepts a connection
        (a node that just died: Ray has not noticed yet)."""
        if not node_id:
            return False
        if node_id in self.lost_nodes:
            return True
        node = next((n for n in self.lane.call(cluster_nodes, LOOK_TIMEOUT_S, "the Ray nodes") if n.node_id == node_id),
                    None)
        lost = node is None or not node.alive
        if not lost:
            try:
                socket.create_connection((node.address, node.port),
                                         timeout=RAYLET_PROBE_TIMEOUT_S).close()
            except OSError:
                lost = True
        if lost:
            self.lost_nodes.add(node_id)
        return lost

    def placeable(self, failures: list[ReplicaFailure]) -> dict[int, tuple[bool, str]]:
        """For each failure whose replica died (or went silent) with its node: whether a replacement fits in what
        the other nodes have free (each one placed takes its room), and what was seen. Failures on
        nodes that are still there are not listed: their own resources are there for a replacement."""
        group = self.group
        # died, or hung: a node removed reads unreachable (ActorUnavailableError) before dead
        on_lost = {f.rank: group.nodes.get(f.rank) for f in failures if f.cause in ("died", "hung")}
        on_lost = {r: n for r, n in on_lost.items() if self.node_lost(n)}
        if not on_lost:
            return {}
        view = self.view()
        room = self.policy.fits(view.available_cpus, view.available_gpus)
        out = {}
        for rank, node in sorted(on_lost.items()):
            note = (f"its node {node[:8]} is gone; the other {view.alive_nodes} node(s) have "
                    f"{view.available_cpus:g} CPU free (room for {room} replica(s))")
            out[rank] = (room > 0, note)
            room = max(0, room - 1)
        return out

    # ---- asking the autoscaler -------------------------------------------------------------
    def request(self, bundles: list[dict[str, float]], why: str) -> None:
        """Send `bundles` to the autoscaler if they differ from what this run asked for last."""
        if bundles == self.requested:
            return
        from ray.autoscaler.sdk import request_resources

        self.lane.call(lambda: request_resources(bundles=bundles), LOOK_TIMEOUT_S, "the autoscaler request")
        self.requested = list(bundles)
        self.report.event("autoscaler_request", bundles=len(bundles), bundle=bundles[0] if bundles else None,
                              withdrawn=not bundles, why=why, read_back=len(read_request()))

    def withdraw(self) -> None:
        """The run ends: take back any request this run made."""
        if self.requested:
            try:
                self.request([], "the run ended")
            except Exception:  # the cluster may be gone already; nothing to take back then
                pass

    # ---- growing -----------------------------------------------------------------------------
    def tick(self, begun: Optional[bool] = None, judging: bool = False, switching: bool = False) -> bool:
        """`poll` (and, from Running, `pause_for_ready`: `begun`, the epoch's streams are open;
        `judging`, failures wait for the failure policy). A look at the cluster or a request to
        the autoscaler that fails (no answer in time, a cluster or autoscaler that
        refuses) is said, an event and a line, once for each distinct failure (`PollFailures`),
        and training goes on: the next poll looks again. A programming error here
        (PROGRAMMING_ERRORS) is raised: the run ends with its traceback rather than running on
        without elasticity, unsaid. Not while failures wait for the failure policy: a hung or
        raising replica is already out of the group, and the room it left is its replacement's,
        not a grow's. True when it closed the gate for a grow (the caller's Pending.pause)."""
        if judging:  # failures wait for the failure policy
            return False
        try:
            self.poll()
            if begun is not None:
                return self.pause_for_ready(begun, switching)
        except PROGRAMMING_ERRORS:
            raise
        except Exception as exc:
            said = self.failures.new(exc)
            if said is not None:
                self.report.event("scaling_poll_failed", error=said)
                self.report.say(f"the scaling poll failed ({said}); training goes on, and the next poll "
                                    f"(every {self.scaling.poll_s:g}s) looks again")
        return False

    def poll(self) -> None:
        """Every scaling.poll_s: ask the policy; act on a grow (shrinks come as failures)."""
        now = time.perf_counter()
        if now < self._next_poll or self.joining is not None:
            return
        self._next_poll = now + self.scaling.poll_s
        current = len(self.group.members)
        view = self.view()
        decision = self.policy.decide(current, view)
        if self.policy.grow_streak == 1 or (decision.kind == "grow" and self._room_since is None):
            self._room_since = time.time()
        elif decision.kind != "grow" and self.policy.grow_streak == 0:
            self._room_since = None
        self.request(decision.request_bundles, decision.reason)
        if decision.kind == "grow":
            self.start_grow(decision, current)

    def start_grow(self, decision: ScaleDecision, current: int) -> None:
        """Start the new replicas now (they boot while the epoch runs); they join at the next
        epoch boundary or, mid-epoch, once paused (`Grow`)."""
        group = self.group
        ranks, r = [], 0
        while len(ranks) < decision.target - current:
            if r not in group.members:
                ranks.append(r)
            r += 1
        ready = group.start_joining(ranks)
        self.joining = Joining(ranks, ready, decision, current, time.time(), time.perf_counter(),
                               self._room_since or time.time())
        self._room_since = None
        self.report.say(f"growing {current} -> {decision.target}: {decision.reason}")

    def pause_for_ready(self, begun: bool, switching: bool = False) -> bool:
        """Mid-epoch, once a started replica is ready: the partition server pauses the replicas at
        their next partition boundary (allreduce: all after the same step), where it joins
        (Running -> Reconfiguring(GrowPlan): `Grow`). Not while a phase switch is pending (`switching`)
        or a failure is being handled. True when it closed the gate."""
        j = self.joining
        if j is None or self.pause.closed or not begun or switching:
            return False
        done, _ = ray.wait(list(j.ready.values()), num_returns=len(j.ready), timeout=0)
        return bool(done) and self.pause.close()

    def ready_to_join(self) -> bool:
        """Whether replicas started for a grow are ready to join (none ready within
        JOIN_TIMEOUT_S: the grow is given up)."""
        j = self.joining
        if j is None:
            return False
        done, _ = ray.wait(list(j.ready.values()), num_returns=len(j.ready), timeout=0)
        if done:
            return True
        if time.perf_counter() - j.t_decide > JOIN_TIMEOUT_S:
            self.abandon(j, j.decision.reason, waited_s=round(time.perf_counter() - j.t_decide, 1))
        return False

    def abandon(self, j: Joining, reason: str, **fields: Any) -> None:
        """Give a grow up: its started replicas are stopped (the policy polls again)."""
        self.group.abandon_joining(j.ranks)
        if self.joining is j:
            self.joining = None
        self.report.event("resize_abandoned", ranks=j.ranks, reason=reason, **fields)

    def promote_joining(self, paused: Optional[str] = None) -> list[int]:
        """Every member is gone (a repair with nobody left) while replicas started for a grow are
        on their way: they become the members now (waited for, bounded by strategy.timeout_s);
        the repair gives them state and data as it does replacements. Their ranks ([] if none,
        or if they died too). `paused`: the Running state's Pending.pause (a grow's pause is lifted)."""
        j = self.joining
        if j is None or not j.ready:
            return []
        self.joining = None
        self.stop_pausing(paused)
        group = self.group
        joined, failed = group.admit(dict(j.ready))
        if failed:
            self.report.event("resize_abandoned", ranks=sorted(failed), reason="died while starting",
                                  outcomes={str(r): why for r, why in failed.items()})
        if not joined:
            return []
        self.report.say(f"replicas {joined}, started for a grow, go on in place of the lost ones")
        return sorted(joined)

    def stop_pausing(self, paused: Optional[str]) -> None:
        """An epoch boundary: a grow's pause nobody reached (every replica held its last
        partitions) is lifted; the ready replicas join before the next epoch opens. `paused`:
        why the replicas are pausing (the Running state's Pending.pause)."""
        if paused == "grow" and self.pause.closed:
            self.pause.open()

    # ---- the learning rate ---------------------------------------------------------------------
    def follow(self, step: int, replicas: int, rate: "RateBase", ranks: Optional[list[int]] = None) -> dict[str, Any]:
        """The replica count changed at `step`: move the schedule and tell the replicas (`ranks`,
        default all). Returns the event's learning-rate fields, in the phase's rate (`rate`)."""
        step = max(step, self.lr.segments[-1].from_step)  # asynchronous replicas' steps differ: never back
        before = self.lr.lr_at(step)
        self.lr.resize(step, self.units(replicas))
        self.send_lr(ranks)
        seg = self.lr.segments[-1]
        base = rate.lr
        return {"lr_rule": self.lr.rule, "lr_before": round(base * before, 6), "lr_target": round(base * seg.target_lr, 6),
                "lr_warmup_steps": seg.ramp_steps, "lr_applies": rate.global_batch}

    def rebatch(self, step: int, batch: int, rate: "RateBase") -> dict[str, Any]:
        """data.adaptive_batch grew the replicas' batch from `step` on: the rate follows the global
        batch as on a resize, and every replica (and any started later) takes the batch."""
        self.batch.value = self.group.raw["data"]["batch_size"] = batch
        return self.follow(step, len(self.group.ranks), rate)

    def state_dict(self) -> list[list]:
        """A checkpoint's part: every resize's learning-rate segment."""
        return self.lr.state_dict()

    def load_state_dict(self, segments: list[list]) -> None:
        self.restore_lr(segments)

    def restore_lr(self, segments: list[list]) -> None:
        """A resumed run: the schedule as the checkpoint kept it, moved to the replica count the
        run starts again with, and sent to the replicas."""
        self.lr.load_state_dict(segments)
        self.group.raw["data"]["batch_size"] = self.batch.value  # its part loads first
        members = self.units(len(self.group.ranks))
        if self.lr.replicas != members:
            step = max(self.progress.values(), default=0)
            self.lr.resize(max(step, self.lr.segments[-1].from_step), members)
        self.send_lr()

    def send_lr(self, ranks: Optional[list[int]] = None) -> None:
        """The schedule's current ramp to the replicas (a replacement needs it too, once resized)."""
        if len(self.lr.segments) < 2:
            return  # never resized: every replica steps at optimizer.lr
        seg = self.lr.segments[-1]
        ramp = {"from_step": seg.from_step, "start": seg.start_lr, "target": seg.target_lr, "steps": seg.ramp_steps,
                "batch_size": self.batch.value}
        group = self.group
        group.call(ranks or group.ranks, "set_lr_scale", ramp, what="learning rate")


def read_request() -> list[dict[str, float]]:
    """The autoscaler request the cluster holds now (whoever made it): a list of bundles."""
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    if is_autoscaler_v2():
        from ray._private.worker import global_worker
        from ray.autoscaler.v2.sdk import get_cluster_resource_state

        state = get_cluster_resource_state(global_worker.gcs_client)
        return [dict(b.resources_bundle) for c in state.cluster_resource_constraints
                for r in c.resource_requests for b in [r.request] for _ in range(r.count)]
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []
