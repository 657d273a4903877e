"""A grow as the carrier's steps (orchestrator/control/reconfig/carrier.py): replicas started
for it (orchestrator/control/reconfig/elastic.py: Elasticity) take their state, then become
members; the group is re-formed, the test slices re-cut, the learning rate follows."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

import ray

from orchestrator.control.reconfig.carrier import Change
from orchestrator.control.reconfig.elastic import Elasticity
from orchestrator.fleet.model_state import for_loading, whole_state
from orchestrator.control.states import EpochSegment, GrowPlan

if TYPE_CHECKING:
    from orchestrator.control.context import RunContext


class Grow(Change):
    """A grow as the carrier's steps (orchestrator/control/reconfig/carrier.py): the started replicas that
    are ready become members and take the state of a member (allreduce: every member is the same
    at an epoch boundary and after a lock-step pause) or the shards' reference; the process
    group is re-formed over everyone, the test slices are re-cut, the learning rate follows.
    Mid-epoch, the paused replicas go on (allreduce: every member, the newcomer stepping without
    data until the epoch's end, the epoch's partitions having been dealt already; asynchronous
    modes: the newcomers lease from the shared queue)."""

    kind = "grow"
    pause = "grow"
    duration_key = "resize_s"

    def __init__(self, plan: GrowPlan, elastic: Elasticity) -> None:
        self.elastic, self.plan, self.j = elastic, plan, elastic.joining
        super().__init__(self.j.t_decide_wall if self.j is not None else time.time())
        self.paused: list[int] = []

    def membership(self, run: "RunContext", seg: EpochSegment) -> None:
        """Who may join: the started replicas that are ready (the rest later). They become
        members in the state step, once they hold the state (a grow's membership is committed
        last)."""
        self.paused = run.ledger.epoch.paused_ranks()
        j, group = self.j, run.fleet.group
        self.ready: list[int] = []
        if j is None:
            return
        done, _ = ray.wait(list(j.ready.values()), num_returns=len(j.ready), timeout=0)
        self.ready = [r for r, ref in j.ready.items() if ref in done]
        self.old = list(group.ranks)
        self.step = max((run.ledger.progress.get(r, 0) for r in self.old), default=0)

    def hand_off(self, run: "RunContext", seg: EpochSegment) -> None:
        """The ready ones take the state (allreduce: a member's, every member being the same at an
        epoch boundary and after a lock-step pause; else the shards' reference) and only then
        join. A newcomer that died starting or failed to load is stopped and said (the others
        join); the donor lost meanwhile is a failure (MemberLost) and the newcomers stay
        started for the next try."""
        j, group = self.j, run.fleet.group
        if j is None or not self.ready:
            return
        refs = {r: j.ready[r] for r in self.ready}
        if run.phase.spec.sharded:
            joined, failed = group.admit(refs, "sync_from_shards", self.step, what="state from the shards")
        elif run.phase.spec.split_state:  # fsdp: the model whole from every member; all re-shard it
            whole = for_loading(whole_state(run.fleet.group, self.old, "the whole model for the grow",
                                            run.cfg.strategy.timeout_s), run.phase.spec.split_state)
            joined, failed = group.admit(refs, "load_state", whole, what="the whole model's state")
            if joined:
                group.call(self.old, "load_state", whole, what="the whole model's state")
        else:
            donor = group.members[self.old[0]]
            joined, failed = group.admit(refs, "load_state", donor.export_state.remote(),
                                         what=f"state from replica {self.old[0]}")
        if failed:  # newcomers that died while starting or loading are stopped and said; the others join
            run.report.event("resize_abandoned", ranks=sorted(failed), reason="died or failed while joining",
                             outcomes={str(r): why for r, why in failed.items()})
        for r in self.ready:
            j.ready.pop(r, None)
        if not j.ready:
            self.elastic.joining = None
        self.newcomers = joined  # [] if their ranks were taken by replacements meanwhile
        self.resized = bool(joined)
        for r in joined:
            run.ledger.progress[r] = self.step
            if run.phase.spec.sharded:
                run.fleet.shard_group.welcome_replica(r, self.step)

    def regroup(self, run: "RunContext") -> bool:
        return bool(self.newcomers)

    def learning_rate(self, run: "RunContext") -> dict[str, Any]:
        return self.elastic.follow(self.step, len(run.fleet.group.ranks), run.rate_base()) if self.newcomers else {}

    def reopen(self, run: "RunContext", seg: EpochSegment) -> list[int]:
        return run.fleet.group.ranks if run.phase.lock_step else self.paused + self.newcomers

    def waiting(self, run: "RunContext", seg: EpochSegment, reopened: list[int]) -> list[int]:
        return reopened if seg.begun else run.fleet.group.ranks  # between epochs: they step when the next one opens

    def event(self, run: "RunContext", seg: EpochSegment, lr: dict[str, Any],
              reopened: list[int]) -> Optional[dict[str, Any]]:
        if not self.newcomers:
            return None
        members, ready, j = run.fleet.group.ranks, self.newcomers, self.j
        run.report.metrics([("replicas_alive", len(members), run.ledger.totals.steps)])
        run.report.say(f"grew to {len(members)} replicas (ranks {ready} joined at step {self.step})")
        return {"kind": "resize", "direction": "grow", "epoch": seg.epoch, "reason": j.decision.reason,
                "old_size": len(self.old), "new_size": len(members), "ranks": ready, "generation": run.fleet.group.generation,
                "at_step": self.step, "mid_epoch": self.plan.mid_epoch,
                "since_room_seen_s": round(time.time() - j.room_seen_wall, 3), **lr}
