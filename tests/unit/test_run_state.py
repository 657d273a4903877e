"""The parts of a checkpoint's run position, without Ray: each part goes back to its owner, a
part an older checkpoint lacks is named, and the new parts (the learning-rate schedule, the
shards' server-optimizer state) survive a save and a weights-only load."""
import io

import pytest
import torch

from orchestrator.persistence.run_state import UNSAVED, PartUnsaved, Position
from policies.decisions.lr_scaling import LrSchedule
from policies.rules.sharding import ShardState


def test_each_part_goes_back_to_its_owner_and_a_missing_one_is_named():
    owner = {"a": 1, "b": [2]}
    pos = Position()
    pos.register("a", lambda: owner["a"], lambda v: owner.__setitem__("a", v))
    pos.register("b", lambda: list(owner["b"]), lambda v: owner.__setitem__("b", v))
    saved = pos.save()
    owner.update(a=10, b=[20])
    assert pos.load(saved) == [] and owner == {"a": 1, "b": [2]}
    assert pos.load({"a": 5}) == ["b"] and owner == {"a": 5, "b": [2]}  # b keeps what it has
    with pytest.raises(ValueError, match="registered twice"):
        pos.register("a", lambda: 0, lambda v: None)


def test_a_part_its_owner_cannot_give_is_named_with_why_not_left_empty():
    pos, loaded = Position(), {}

    def shards():
        raise PartUnsaved("the shards' optimizer states: GetTimeoutError: shard 0 did not answer")

    pos.register("totals", lambda: {"epochs": 2}, lambda v: loaded.update(totals=v))
    pos.register("shards", shards, lambda v: loaded.update(shards=v))
    saved = pos.save()
    assert "shards" not in saved and saved["totals"] == {"epochs": 2}
    assert Position.unsaved(saved) == {"shards": "the shards' optimizer states: GetTimeoutError: shard 0 did not answer"}
    assert pos.load(saved) == ["shards"] and loaded == {"totals": {"epochs": 2}}  # named missing, not loaded as None
    assert Position.unsaved({"totals": {}}) == {}  # a checkpoint with every part
    with pytest.raises(ValueError):
        pos.register(UNSAVED, dict, print)


def test_the_learning_rate_schedule_comes_back_with_every_resize():
    lr = LrSchedule(1.0, 2, "linear", warmup_steps=10)
    lr.resize(50, 4)  # a grow: a ramp from 1.0 to 2.0 over steps 50..60
    lr.resize(80, 3)  # a shrink
    again = LrSchedule(1.0, 2, "linear", warmup_steps=10)
    again.restore(torch.load(io.BytesIO(_saved(lr.position())), weights_only=True))
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
