"""ShardState snapshots and replay (no Ray): a snapshot round-trips exactly, optimizer state
included, and a shard restored from it that is given the acknowledged updates again ends where
the uninterrupted shard did."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from policies.rules.sharding import ShardState

OPTIMIZERS = [
    {"optimizer": "sgd", "lr": 0.1, "momentum": 0.0},
    {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3},
    {"optimizer": "adagrad", "lr": 0.1},
]


def grads(n=20, size=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) for _ in range(n)]


def shard(opt, size=37, seed=1):
    state = ShardState(torch.randn(size, generator=torch.Generator().manual_seed(seed)), **opt)
    state.init_clocks(2)
    return state


def opt_tensors(state: ShardState) -> dict:
    return {k: v for k, v in state._opt.state_dict()["state"].get(0, {}).items() if isinstance(v, torch.Tensor)}


def assert_same(a: ShardState, b: ShardState) -> None:
    assert torch.equal(a.values, b.values) and a.version == b.version
    ta, tb = opt_tensors(a), opt_tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: f"{o['optimizer']}-m{o.get('momentum', 0)}")
def test_a_snapshot_round_trips_exactly(opt):
    state = shard(opt)
    for i, g in enumerate(grads(7)):
        state.apply_gradient(g, version_seen=max(0, i - 2), staleness_lr=True)
        state.report_clock(i % 2, i)
    state.forget(1)
    state.buffers[0] = {"bn.running_mean": np.arange(3, dtype=np.float32)}
    snap = pickle.loads(pickle.dumps(state.snapshot()))  # what travels through the object store
    assert not any(isinstance(v, torch.Tensor) for v in snap.values())
    if opt["optimizer"] == "adagrad" or opt.get("momentum"):
        assert opt_tensors(state)  # there is optimizer state to carry: Adagrad sums / momentum
    restored = ShardState.from_snapshot(snap)
    assert_same(state, restored)
    assert (restored.clocks, restored.gone, restored.max_lead) == (state.clocks, state.gone, state.max_lead)
    np.testing.assert_array_equal(restored.buffers[0]["bn.running_mean"], state.buffers[0]["bn.running_mean"])
    # and it is a copy: the live shard moving on does not change the snapshot or the restored shard
    before = restored.values.clone()
    state.apply_gradient(grads(1, seed=9)[0], state.version)
    assert torch.equal(restored.values, before) and torch.equal(torch.from_numpy(snap["values"]), before)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: f"{o['optimizer']}-m{o.get('momentum', 0)}")
def test_restoring_and_applying_the_same_gradients_ends_identical(opt):
    original = shard(opt)
    gs = grads(12)
    for g in gs[:5]:
        original.apply_gradient(g, original.version)
    restored = ShardState.from_snapshot(original.snapshot())
    for g in gs[5:]:
        original.apply_gradient(g, original.version)
        restored.apply_gradient(g, restored.version)
    assert_same(original, restored)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: f"{o['optimizer']}-m{o.get('momentum', 0)}")
def test_replaying_one_clients_log_is_exact(opt):
    """A shard dies after acknowledging updates past its snapshot; its replacement restored
    from the snapshot and given the client's log (gradients with the staleness they were applied
    at, in order) is bit-identical to the shard that never died."""
    live = shard(opt)
    gs = grads(15)
    log = []
    for i, g in enumerate(gs):
        if i == 6:
            snap = live.snapshot()
        staleness = live.apply_gradient(g, max(0, live.version - i % 3), staleness_lr=True)
        log.append((live.version, g.clone(), staleness))
    rebuilt = ShardState.from_snapshot(snap)
    for version, g, staleness in log:
        if version > snap["version"]:
            rebuilt.replay_gradient(g, staleness, staleness_lr=True)
    assert_same(live, rebuilt)


def test_two_clients_replayed_in_another_order_agree_up_to_rounding():
    """Plain SGD: the result is the sum of the steps whatever the interleaving of clients
    (each client's own order kept), up to float rounding."""
    live = shard({"optimizer": "sgd", "lr": 0.1})
    a, b = grads(8, seed=2), grads(8, seed=3)
    snap = live.snapshot()
    logs = {0: [], 1: []}
    for ga, gb in zip(a, b):  # interleaved as they arrived
        live.apply_gradient(ga, live.version)
        logs[0].append(ga)
        live.apply_gradient(gb, live.version)
        logs[1].append(gb)
    rebuilt = ShardState.from_snapshot(snap)
    for client in (1, 0):  # one client after the other
        for g in logs[client]:
            rebuilt.replay_gradient(g, 0, False)
    assert rebuilt.version == live.version
    torch.testing.assert_close(rebuilt.values, live.values, rtol=1e-6, atol=1e-6)


def test_elastic_moves_replay_exactly():
    live = shard({"optimizer": "sgd", "lr": 0.1})
    snap = live.snapshot()
    ds = [live.elastic_exchange(x, 0.3)[0].clone() for x in grads(5, seed=4)]
    rebuilt = ShardState.from_snapshot(snap)
    for d in ds:
        rebuilt.replay_elastic(d)
    assert torch.equal(rebuilt.values, live.values) and rebuilt.version == live.version


def test_restore_refuses_a_snapshot_of_another_shape_or_optimizer():
    snap = shard({"optimizer": "sgd"}).snapshot()
    with pytest.raises(ValueError, match="values"):
        shard({"optimizer": "sgd"}, size=5).restore(snap)
    with pytest.raises(ValueError, match="adagrad"):
        shard({"optimizer": "adagrad"}).restore(snap)


def test_welcome_brings_a_forgotten_rank_back_and_abort_drops_open_rounds():
    state = shard({"optimizer": "sgd"})
    state.forget(1)
    state.report_clock(1, 5)
    assert 1 not in state.clocks
    state.welcome(1, 7)
    assert state.clocks[1] == 7 and 1 not in state.gone
    assert state.sync_contribute(3, torch.ones(37), replicas=2, beta=0.5) is False
    assert state.abort_open_rounds() == [3] and not state._sync
    # the round starts afresh: one contribution is not enough to close it
    assert state.sync_contribute(3, torch.ones(37), replicas=2, beta=0.5) is False
