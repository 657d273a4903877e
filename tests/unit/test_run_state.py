"""The parts of a checkpoint's run position, without Ray: each part goes back to its owner, a
part an older checkpoint lacks is named, and the new parts (the learning-rate schedule, the
shards' server-optimizer state) survive a save and a weights-only load."""
import io

import pytest
import torch

from orchestrator.persistence.run_state import UNSAVED, Part, PartUnsaved, Position, RunTotals
from policies.decisions.lr_scaling import LrSchedule
from policies.rules.sharding import ShardState


def test_each_part_goes_back_to_its_owner_and_a_missing_one_is_named():
    owner = {"a": 1, "b": [2]}
    pos = Position()
    pos.register("a", Part(lambda: owner["a"], lambda v: owner.__setitem__("a", v)))
    pos.register("b", Part(lambda: list(owner["b"]), lambda v: owner.__setitem__("b", v)))
    saved = pos.save()
    owner.update(a=10, b=[20])
    assert pos.load(saved) == [] and owner == {"a": 1, "b": [2]}
    assert pos.load({"a": 5}) == ["b"] and owner == {"a": 5, "b": [2]}  # b keeps what it has
    with pytest.raises(ValueError, match="registered twice"):
        pos.register("a", Part(lambda: 0, lambda v: None))


def test_a_part_its_owner_cannot_give_is_named_with_why_not_left_empty():
    pos, loaded = Position(), {}

    def shards():
        raise PartUnsaved("the shards' optimizer states: GetTimeoutError: shard 0 did not answer")

    pos.register("totals", Part(lambda: {"epochs": 2}, lambda v: loaded.update(totals=v)))
    pos.register("shards", Part(shards, lambda v: loaded.update(shards=v)))
    saved = pos.save()
    assert "shards" not in saved and saved["totals"] == {"epochs": 2}
    assert Position.unsaved(saved) == {"shards": "the shards' optimizer states: GetTimeoutError: shard 0 did not answer"}
    assert pos.load(saved) == ["shards"] and loaded == {"totals": {"epochs": 2}}  # named missing, not loaded as None
    assert Position.unsaved({"totals": {}}) == {}  # a checkpoint with every part
    with pytest.raises(ValueError):
        pos.register(UNSAVED, Part(dict, print))


def test_owners_are_stateful_parts_and_totals_keep_this_starts_own_figures():
    """A policy, the totals and the learning-rate schedule are parts themselves (state_dict /
    load_state_dict); the totals' start-up time is this start's, never the checkpoint's."""
    totals = RunTotals(epochs=3, steps=90, startup_s=4.0, stop_reason="x", state_s={"running": 30.0, "repair": 2.5})
    lr = LrSchedule(1.0, 2, "linear", 10)
    lr.resize(50, 4)
    pos = Position()
    pos.register("totals", totals)
    pos.register("lr_schedule", lr)
    saved = pos.save()
    assert "stop_reason" not in saved["totals"] and saved["totals"]["epochs"] == 3
    fresh_totals, fresh_lr = RunTotals(startup_s=1.5), LrSchedule(1.0, 2, "linear", 10)
    again = Position()
    again.register("totals", fresh_totals)
    again.register("lr_schedule", fresh_lr)
    assert again.load(saved) == []
    assert (fresh_totals.epochs, fresh_totals.steps, fresh_totals.startup_s) == (3, 90, 1.5)
    assert fresh_totals.state_s == {"running": 30.0, "repair": 2.5}  # a resumed run's seconds go on from its earlier drivers'
    assert fresh_lr.state_dict() == lr.state_dict() and fresh_lr.replicas == 4


def test_the_learning_rate_schedule_comes_back_with_every_resize():
    lr = LrSchedule(1.0, 2, "linear", warmup_steps=10)
    lr.resize(50, 4)  # a grow: a ramp from 1.0 to 2.0 over steps 50..60
    lr.resize(80, 3)  # a shrink
    again = LrSchedule(1.0, 2, "linear", warmup_steps=10)
    again.load_state_dict(torch.load(io.BytesIO(_saved(lr.state_dict())), weights_only=True))
    assert [again.lr_at(s) for s in (0, 49, 55, 60, 79, 80, 200)] == [lr.lr_at(s) for s in (0, 49, 55, 60, 79, 80, 200)]
    assert again.replicas == 3


def test_a_shards_server_optimizer_state_comes_back_and_the_next_step_matches():
    def trained():
        shard = ShardState(torch.zeros(6), "sgd", 0.1, 0.9, 0.0)
        for k in range(3):
            shard.apply_gradient(torch.arange(6, dtype=torch.float32) * (k + 1), shard.version, False)
        return shard

    shard = trained()
    saved = torch.load(io.BytesIO(_saved(shard.optimizer_state())), weights_only=True)
    fresh = ShardState(shard.values.clone(), "sgd", 0.1, 0.9, 0.0)
    fresh.load_optimizer_state(saved)
    grad = torch.ones(6)
    shard.apply_gradient(grad, shard.version, False)
    fresh.apply_gradient(grad, fresh.version, False)
    assert torch.equal(fresh.values, shard.values)  # the momentum went on as it was
    cold = ShardState(trained().values.clone(), "sgd", 0.1, 0.9, 0.0)
    cold.apply_gradient(grad, cold.version, False)
    assert not torch.equal(cold.values, shard.values)  # without it the step differs


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_a_background_write_lets_the_caller_go_on_and_a_newer_one_replaces_one_still_waiting(tmp_path):
    """The first checkpoint's upload is held (its MLflow flush has not come): the caller goes on at
    once; a second order waits, a third replaces it (the second is superseded, never written);
    once the upload goes on, the first and the third are stored, newest last."""
    import threading

    from orchestrator.persistence.checkpoint import CheckpointStore
    from orchestrator.persistence.run_state import Checkpointer

    ck = Checkpointer(str(tmp_path), keep=5, run_name="bg", flush_s=30)
    gate, held = threading.Event(), threading.Event()

    class Flush:  # the first checkpoint's MLflow flush: says when the writer waits on it
        def wait(self, timeout):
            held.set()
            return gate.wait(timeout)

    for step in (10, 20, 30):
        ck.write({"step": step, "w": torch.full((3,), float(step))}, f"e{step}", step, 1, "id", wait=False,
                 before=Flush() if step == 10 else None, fields={"step": step})
        assert ck.last_step == step and ck.last_state["step"] == step  # known at once (a repair can use it)
        if step == 10:  # the writer took it up (else the second, given before, would replace it, not wait)
            assert held.wait(30)
    assert not ck.drain(timeout_s=0.2) and not [f for f in tmp_path.glob("bg/ckpt-*")]  # still held
    gate.set()
    assert ck.drain(timeout_s=30)
    done = {o.tag: o for o in ck.written()}
    assert done["e20"].superseded_by == "e30" and not done["e20"].stored
    assert {e.step for e in CheckpointStore(str(tmp_path), "bg", keep=5).list()} == {10, 30}
    path, state = CheckpointStore(str(tmp_path), "bg", keep=5).latest_good()
    assert state["step"] == 30 and path == done["e30"].stored


def test_a_write_that_waits_is_stored_before_it_returns_and_raises_when_the_store_fails(tmp_path):
    from orchestrator.persistence.run_state import Checkpointer

    ck = Checkpointer(str(tmp_path), keep=2, run_name="now")
    path, stored = ck.write({"step": 1}, "final", 1, 1, "id", named="model.pt")
    assert path.endswith("now/model.pt") and (tmp_path / "now" / "model.pt").exists()
    assert [o.path for o in ck.written()] == [path]
    (tmp_path / "now" / "ckpt-000000002-final.pt").mkdir()  # a directory where the file must go
    with pytest.raises(Exception):
        ck.write({"step": 2}, "final", 2, 1, "id")
    ck.write({"step": 3}, "bg", 3, 1, "id", wait=False)
    (tmp_path / "now" / "ckpt-000000004-bg.pt").mkdir()
    ck.write({"step": 4}, "bg", 4, 1, "id", wait=False)
    assert ck.drain(timeout_s=30)
    outcomes = ck.written()
    assert any(o.failed for o in outcomes), outcomes  # said, not raised on the writer's thread


def test_a_checkpoint_whose_write_failed_moves_no_clock_and_the_next_is_due_from_the_stored_one(tmp_path):
    """checkpoint.every_s / every_steps count from the newest checkpoint stored: a background write
    that failed, or one the run waited on that raised, moves neither clock (the next checkpoint is
    due from the stored one); the state it held is still the newest taken (in memory: a repair
    that lost every replica goes on from it)."""
    import time

    from orchestrator.persistence.run_state import Checkpointer

    ck = Checkpointer(str(tmp_path), keep=5, run_name="clk")
    before = time.perf_counter()
    ck.write({"step": 10}, "e1", 10, 1, "id", wait=False)
    assert ck.drain(timeout_s=30)
    stored_s = ck.last_s
    assert before <= stored_s <= time.perf_counter() and ck.last_step == 10  # when its state was taken
    (tmp_path / "clk" / "ckpt-000000020-e2.pt").mkdir()  # a directory where the file must go: the store fails
    ck.write({"step": 20}, "e2", 20, 2, "id", wait=False)
    assert ck.drain(timeout_s=30)
    assert ck.written()[-1].failed
    assert (ck.last_step, ck.last_s) == (10, stored_s)
    assert ck.last_state["step"] == 20
    (tmp_path / "clk" / "ckpt-000000030-final.pt").mkdir()
    with pytest.raises(Exception):
        ck.write({"step": 30}, "final", 30, 3, "id")  # one the run waits on: raised, and no clock moved
    assert (ck.last_step, ck.last_s) == (10, stored_s)


def test_a_superseded_checkpoint_moves_no_clock_and_one_on_its_way_is_not_due_again(tmp_path):
    """While a write waits or is being written, the clocks count from it (a checkpoint inside the
    epoch is not asked for again at every partition boundary until it lands); one superseded
    before it was written, and the newer one that then failed, leave them at the stored one."""
    import threading

    from orchestrator.persistence.run_state import Checkpointer

    ck = Checkpointer(str(tmp_path), keep=5, run_name="sup", flush_s=30)
    gate, held = threading.Event(), threading.Event()

    class Flush:  # the first checkpoint's MLflow flush: says when the writer waits on it
        def wait(self, timeout):
            held.set()
            return gate.wait(timeout)

    ck.write({"step": 10}, "e10", 10, 1, "id", wait=False, before=Flush())
    assert held.wait(30) and ck.last_step == 10  # being written: the clocks count from it
    (tmp_path / "sup" / "ckpt-000000030-e30.pt").mkdir(parents=True)  # the newest one's store will fail
    for step in (20, 30):
        ck.write({"step": step}, f"e{step}", step, 1, "id", wait=False)
        assert ck.last_step == step  # waiting: the newest on its way
    gate.set()
    assert ck.drain(timeout_s=30)
    done = {o.tag: o for o in ck.written()}
    assert done["e10"].stored and done["e20"].superseded_by == "e30" and done["e30"].failed
    assert ck.last_step == 10  # the stored one: the next checkpoint is due from it
    assert ck.last_state["step"] == 30  # the newest taken, for a repair


def test_a_checkpoint_on_probation_holds_its_guard_s_model_once_beside_it_not_inside(tmp_path):
    """A switch on probation keeps the model from before it (its guard) so a resumed run can roll
    back: written once beside the checkpoints, each checkpoint on probation naming it, so one
    taken on probation is about the size of one taken off it, and the guard comes back whole."""
    import os

    from orchestrator.persistence.checkpoint import load_checkpoint
    from orchestrator.persistence.run_state import Checkpointer, resolve_probation

    model = {"w": torch.randn(256, 256)}
    before = {"model": {"w": torch.randn(256, 256)}, "optimizer": None, "step": 40}
    guard = {"phase": 0, "mode": "allreduce", "state": before, "loss": 0.3, "checks": 2, "until": 3}
    ck = Checkpointer(str(tmp_path), keep=5, run_name="p")
    off, _ = ck.write({"model": model, "step": 40}, "e1", 40, 1, "id")
    on = [ck.write({"model": model, "step": s, "probation": guard}, f"e{s}", s, 2, "id")[0] for s in (50, 60)]
    for path in on:
        assert os.path.getsize(path) <= 1.1 * os.path.getsize(off), (path, os.path.getsize(off))
    saved = [load_checkpoint(p)["probation"] for p in on]
    assert saved[0] == saved[1] and "state" not in saved[0]  # both name the one copy
    back = resolve_probation(saved[1])
    assert {k: back[k] for k in ("phase", "mode", "loss", "checks", "until")} == \
        {"phase": 0, "mode": "allreduce", "loss": 0.3, "checks": 2, "until": 3}
    assert torch.equal(back["state"]["model"]["w"], before["model"]["w"]) and back["state"]["step"] == 40
    assert resolve_probation(None) is None and resolve_probation(guard) is guard  # an older checkpoint's, inline


def test_each_state_counts_under_its_name_and_a_reconfiguration_under_its_plan_s():
    from orchestrator.control.states import (EpochSegment, EvacuationPlan, Finished, Finishing, GrowPlan, Plan,
                                             Reconfiguring, Running, Starting, SwitchPlan, state_name)

    seg = object.__new__(EpochSegment)  # the names read no field of the segment or the plans
    plans = {kind: object.__new__(kind) for kind in (Plan, SwitchPlan, GrowPlan, EvacuationPlan)}
    assert [state_name(s) for s in (Starting(), Running(seg), Finishing(), Finished())] == \
        ["starting", "running", "finishing", "finished"]
    assert [state_name(Reconfiguring(plans[k], seg)) for k in (Plan, SwitchPlan, GrowPlan, EvacuationPlan)] == \
        ["repair", "switch", "grow", "evacuation"]
