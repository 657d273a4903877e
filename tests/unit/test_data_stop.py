import numpy as np
import pytest

from orchestrator.data.in_memory import eval_slices, load_source, partition
from policies.decisions.stop import EpochSnapshot, StopPolicy, Target


def test_mnist5k_fixed_stratified_split():
    d = load_source("builtin:mnist5k")
    assert len(d.train) == 4000 and len(d.test) == 1000
    assert d.train.x.shape[1:] == (1, 28, 28) and d.train.x.dtype == np.float32
    assert np.bincount(d.test.y).tolist() == [100] * 10
    assert not set(d.train.ids) & set(d.test.ids)
    again = load_source("builtin:mnist5k", seed=7)
    assert np.array_equal(again.test.ids, d.test.ids)  # fixed split


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_partitions_cover_train_once(replicas):
    d = load_source("builtin:digits")
    parts = partition(d.train, 4 * replicas, seed=3)
    ids = np.concatenate([p.ids for p in parts])
    assert sorted(ids) == sorted(d.train.ids)
    slices = eval_slices(len(d.test), replicas)
    assert slices[0][0] == 0 and slices[-1][1] == len(d.test)


def test_stop_policy_says_why():
    acc = lambda a: {"test_accuracy": a}  # noqa: E731
    pol = StopPolicy(epochs=3, target=Target("test_accuracy", "max", 0.9), max_wall_s=100)
    assert not pol.decide(EpochSnapshot(1, acc(0.5), 10)).stop
    d = pol.decide(EpochSnapshot(1, acc(0.95), 10))
    assert d.stop and "target" in d.reason and "0.9500" in d.reason
    assert "epochs: 3 >= stop.epochs (3)" in pol.decide(EpochSnapshot(3, acc(0.5), 10)).reason
    assert "wall" in pol.decide(EpochSnapshot(1, acc(0.5), 100)).reason
    keep_going = StopPolicy(epochs=3, target=Target("test_accuracy", "max", 0.9), at_target=False)
    assert not keep_going.decide(EpochSnapshot(1, acc(0.95), 1)).stop
    # a metric whose goal is min is reached at or below the value; nan never is
    r2, mse = Target("test_r2", "max", 0.9), Target("test_mse", "min", 0.1)
    assert StopPolicy(5, r2).decide(EpochSnapshot(1, {"test_r2": 0.91}, 1)).stop
    assert not StopPolicy(5, mse).decide(EpochSnapshot(1, {"test_mse": 0.2}, 1)).stop
    assert "test_mse 0.0500 <= stop.target (0.1)" in StopPolicy(5, mse).decide(EpochSnapshot(1, {"test_mse": 0.05}, 1)).reason
    assert not StopPolicy(5, mse).decide(EpochSnapshot(1, {"test_mse": float("nan")}, 1)).stop
