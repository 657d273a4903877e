"""The best epoch and early stopping (policies/decisions/stop.py BestWatch), without Ray."""
from policies.decisions.stop import BestWatch


def test_the_best_epoch_by_the_metrics_direction_and_min_delta():
    w = BestWatch("test_accuracy", "max", min_delta=0.01, patience=2)
    assert w.observe(1, {"test_accuracy": 0.80})
    assert not w.observe(2, {"test_accuracy": 0.805})  # not more than min_delta better
    assert w.stop() is None  # one epoch without a gain, patience 2
    assert w.observe(3, {"test_accuracy": 0.9}) and w.best_epoch == 3
    assert not w.observe(4, {"test_accuracy": float("nan")})
    assert not w.observe(5, {"test_accuracy": 0.85})
    decision = w.stop()
    assert decision.stop and "early stopping: test_accuracy has not improved on 0.9000 (epoch 3)" in decision.reason
    low = BestWatch("test_loss", "min")
    assert low.observe(1, {"test_loss": 1.0}) and low.observe(2, {"test_loss": 0.5}) and not low.observe(3, {"test_loss": 0.6})
    assert low.stop() is None  # no patience: never stops


def test_a_resumed_run_goes_on_counting():
    w = BestWatch("test_accuracy", "max", patience=3)
    w.observe(1, {"test_accuracy": 0.9})
    w.observe(2, {"test_accuracy": 0.8})
    again = BestWatch("test_accuracy", "max", patience=3)
    again.load_state_dict(w.state_dict())
    assert (again.best, again.best_epoch, again.since) == (0.9, 1, 1)
