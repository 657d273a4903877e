"""Per-rank outcomes of the replica group's calls, on real Ray actors killed and stopped as the
world does it (SIGKILL, SIGSTOP): every death and every hang among the ranks asked reaches the
failure policy; a death among the members is never swallowed by a call about someone else (a
spare, a newcomer), and a newcomer that died starting does not take the healthy ones with it."""
from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from orchestrator.testing.chaos import kill_process
from orchestrator.errors import MemberLost
from orchestrator.fleet.replica_group import ReplicaGroup
from orchestrator.trainer import ElasticTrainer
from tests.conftest import job_config

pytestmark = pytest.mark.ray


@ray.remote(num_cpus=0, max_restarts=0)
class Member:
    """A replica's stand-in for the group's bookkeeping calls (pid, node_id) and a call that
    takes as long as it is told."""

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def work(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def export_state(self) -> dict:
        return {"pid": os.getpid()}

    def load_state(self, state: dict) -> int:
        self.state = state
        return state["pid"]


@pytest.fixture
def group(ray_cluster):
    cfg = job_config(fault_tolerance={"hang_timeout_s": 2}, strategy={"timeout_s": 30})
    g = ReplicaGroup(cfg)
    stopped = []
    yield g, stopped
    for pid in stopped:  # a stopped process is let go before it is killed
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    g.shutdown()


def test_a_call_names_every_member_that_died_and_every_one_that_hung(group):
    """Member 1 is SIGKILLed, member 2 SIGSTOPped: the call's verdict names both, each with its
    cause. (Before, the hang was reported and the death in the same call was lost.)"""
    g, stopped = group
    g.members = {r: Member.remote() for r in range(3)}
    g.wait_ready()
    kill_process(g.members[1])
    stopped.append(kill_process(g.members[2], signal.SIGSTOP))
    with pytest.raises(MemberLost) as lost:
        g.call([0, 1, 2], "work", 0.1, what="work")
    assert lost.value.ranks == [1, 2]
    assert lost.value.causes == {1: "died", 2: "hung"}
    outs = g.outcomes([0], "work", 0.1)
    assert outs[0].ok and outs[0].value == 0.1


@pytest.mark.full  # make test runs the death-and-hang case; these two are its grow siblings
def test_newcomers_join_one_by_one_and_a_members_death_is_not_theirs(group):
    """Two replicas started for a grow, one SIGKILLed before it joins; a member SIGKILLed too.
    The live newcomer joins, the dead one is reported as its own failure, and the member's
    death is not mistaken for the newcomers' (before, the whole grow was abandoned with a
    MemberLost about the member, which the grow then swallowed)."""
    g, _ = group
    g.members = {r: Member.remote() for r in range(2)}
    g.wait_ready()
    g.joining = {2: Member.remote(), 3: Member.remote()}
    ready = {r: a.pid.remote() for r, a in g.joining.items()}
    ray.get(list(ready.values()), timeout=60)
    kill_process(g.joining[3])
    kill_process(g.members[1])
    time.sleep(1)  # the deaths are known to Ray
    ready[3] = g.joining[3].pid.remote()
    joined, failed = g.admit(ready)
    assert joined == [2] and list(failed) == [3] and failed[3].startswith("died")
    assert sorted(g.members) == [0, 1, 2] and not g.joining
    assert g.dead_members() == [1]  # still a member: its death is found by whoever waits on it


@pytest.mark.full
def test_a_grows_newcomers_become_members_only_once_they_hold_the_state(group):
    """The donor (member 0) is SIGKILLed before the newcomer loads its state: the donor's death
    is MemberLost and the newcomer is not a member (it stays started for the next try); with a
    live donor the newcomer loads the state, then joins. (Before, a grow made newcomers members
    first and gave them state after: a donor lost between left a member with no state.)"""
    g, _ = group
    g.members = {r: Member.remote() for r in range(2)}
    g.wait_ready()
    g.joining = {2: Member.remote()}
    ready = {2: g.joining[2].pid.remote()}
    ray.get(ready[2], timeout=60)
    donor_state = g.members[0].export_state.remote()
    kill_process(g.members[0])
    time.sleep(1)
    with pytest.raises(MemberLost) as lost:
        g.admit(ready, "load_state", g.members[0].export_state.remote())
    assert lost.value.ranks == [0]
    assert sorted(g.members) == [0, 1] and list(g.joining) == [2]
    del donor_state
    g.remove(0)
    joined, failed = g.admit(ready, "load_state", g.members[1].export_state.remote())
    assert joined == [2] and not failed and sorted(g.members) == [1, 2]
    assert ray.get(g.members[2].load_state.remote({"pid": 7}), timeout=30) == 7


@pytest.mark.full
def test_a_member_lost_while_the_epochs_checkpoint_is_taken_is_a_failure_before_the_next_epoch(ray_cluster, tmp_path,
                                                                                              monkeypatch):
    """Replica 0 is SIGKILLed as the driver asks it for epoch 1's checkpoint: the checkpoint is
    taken from replica 1, and the death is a failure the policy decides at once (replaced before
    epoch 2 opens, its detail naming the checkpoint), not a line of text and a surprise later."""
    original, killed = ReplicaGroup.call, {}

    def call(self, ranks, method, *args, **kwargs):
        if method == "state" and kwargs.get("what") == "checkpoint epoch_0001" and not killed:
            killed["rank"] = ranks[0]
            kill_process(self.members[ranks[0]])
        return original(self, ranks, method, *args, **kwargs)

    monkeypatch.setattr(ReplicaGroup, "call", call)
    cfg = job_config(scaling={"replicas": 2, "cpus_per_replica": 0.5}, stop={"epochs": 2}, data={"batch_size": 8},
                     tracking={"progress_interval_s": 0}, checkpoint={"storage": str(tmp_path / "ck")})
    result = ElasticTrainer(cfg, show_progress=False).fit()
    failed = [e for e in result.events if e["kind"] == "replica_failed"]
    assert killed and [(f["rank"], f["cause"], f["epoch"]) for f in failed] == [(killed["rank"], "died", 2)], failed
    assert "checkpoint epoch_0001" in failed[0]["detail"], failed
    assert [e["ranks"] for e in result.events if e["kind"] == "replica_replaced"] == [[killed["rank"]]]
    assert [e["epoch"] for e in result.events if e["kind"] == "checkpoint"][:1] == [1]
    assert result.epochs == 2


def test_spares_on_a_drained_node_are_replaced_and_never_handed_out(ray_cluster):
    """The spare pool (orchestrator/fleet/spares.py) on real actors: a spare on a node in the
    drained view is never handed out and is moved (stopped, a new one started); one handed out
    or found dead is replaced, so the pool keeps its size."""
    from ray.exceptions import RayActorError

    from orchestrator.fleet.spares import SparePool

    pool = SparePool(Member.remote)
    pool.launch(2)
    try:
        deadline = time.monotonic() + 60
        while any(pool.node(s) is None for s in pool.actors):
            assert time.monotonic() < deadline, "the spares never said where they run"
            time.sleep(0.05)
        here = pool.node(pool.actors[0])
        assert pool.usable([here]) == 0 and pool.usable(["another-node"]) == 2
        assert list(pool.take([here])) == [] and len(pool.actors) == 2  # none handed out from a drained node
        old = list(pool.actors)
        assert pool.move_off([here]) == [here, here]
        for spare in old:  # ray.kill is asynchronous: a call sent just after may still be answered
            deadline = time.monotonic() + 30
            with pytest.raises(RayActorError):
                while time.monotonic() < deadline:
                    ray.get(spare.pid.remote(), timeout=30)
                    time.sleep(0.1)
        assert len(pool.actors) == 2 and not {id(s) for s in pool.actors} & {id(s) for s in old}
        given = next(pool.take())
        assert ray.get(given.pid.remote(), timeout=30) and len(pool.actors) == 2 and given not in pool.actors
        ray.kill(given)
        dead = pool.actors[0]
        ray.kill(dead)
        looks = 0.0
        pool.check(now=looks)  # asks each spare for its pid
        deadline = time.monotonic() + 30
        while dead in pool.actors:  # its answer is read at a later look
            assert time.monotonic() < deadline, "a dead spare was never replaced"
            time.sleep(0.2)
            looks += 10.0
            pool.check(now=looks)
        assert len(pool.actors) == 2
    finally:
        pool.shutdown()
