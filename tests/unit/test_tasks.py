"""Tasks (policies/rules/tasks.py): each builtin's evaluation summed over pieces (batches, replicas)
equals one process evaluating everything at once, against a straightforward reference; the
allreduce rule with a regression task equals single-process SGD; user tasks load or fail in one
line; targets and metric names are checked before anything starts."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from orchestrator.config import JobConfig
from orchestrator.errors import ConfigError
from policies.rules.allreduce import AllReduceWorker
from policies.rules.tasks import Classification, LanguageModel, Regression, load_task, sum_stats
from tests.unit.test_allreduce_rule import ThreadSum, flat, run_replicas


def pieces(n, k, rng):
    """Cut range(n) into k contiguous pieces of random sizes (some may be empty)."""
    cuts = np.sort(rng.integers(0, n + 1, size=k - 1))
    return np.split(np.arange(n), cuts)


def distributed(task, out, y, k, seed=0):
    rng = np.random.default_rng(seed)
    return task.finish(sum_stats([task.evaluate(out[idx], y[idx]) for idx in pieces(len(y), k, rng) if len(idx)]))


@pytest.mark.parametrize("k", [1, 3, 7])
def test_classification_sums_equal_single_process(k):
    g = torch.Generator().manual_seed(1)
    out, y = torch.randn(101, 5, generator=g), torch.randint(0, 5, (101,), generator=g)
    got = distributed(Classification(), out, y, k)
    assert got["test_accuracy"] == int((out.argmax(1) == y).sum()) / len(y)
    assert math.isclose(got["test_loss"], float(F.cross_entropy(out.double(), y)), rel_tol=1e-6)


@pytest.mark.parametrize("k", [1, 4, 9])
@pytest.mark.parametrize("columns", [None, 3])
def test_regression_sums_equal_single_process(k, columns):
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    g = torch.Generator().manual_seed(2)
    shape = (200,) if columns is None else (200, columns)
    y = torch.randn(shape, generator=g) * 3 + 10  # an offset: SST from sums of squares must stay exact
    out = y + torch.randn(shape, generator=g)
    got = distributed(Regression(), out, y, k)
    yn, on = y.numpy().astype(np.float64), out.numpy().astype(np.float64)
    assert math.isclose(got["test_mse"], mean_squared_error(yn, on), rel_tol=1e-9)
    assert got["test_loss"] == got["test_mse"]
    assert math.isclose(got["test_mae"], mean_absolute_error(yn, on), rel_tol=1e-9)
    assert math.isclose(got["test_r2"], r2_score(yn, on), rel_tol=1e-7)


def test_regression_takes_n_by_1_outputs_for_n_targets_and_names_a_mismatch():
    y = torch.randn(8)
    task = Regression()
    assert torch.isclose(task.loss(y[:, None] + 1, y), torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"outputs of shape \[8, 2\] for targets of shape \[8\]"):
        task.loss(torch.randn(8, 2), y)


@pytest.mark.parametrize("k", [1, 5])
def test_language_model_sums_equal_single_process(k):
    g = torch.Generator().manual_seed(3)
    out, y = torch.randn(40, 16, 11, generator=g), torch.randint(0, 11, (40, 16), generator=g)
    y[0, :4] = -1  # padding is not counted
    got = distributed(LanguageModel(), out, y, k)
    ref = float(F.cross_entropy(out.double().reshape(-1, 11), y.reshape(-1), ignore_index=-1))
    assert math.isclose(got["test_loss"], ref, rel_tol=1e-9)
    assert math.isclose(got["test_perplexity"], math.exp(ref), rel_tol=1e-9)


def test_allreduce_with_a_regression_task_equals_single_process_sgd():
    """Unequal batches on 2 replicas: the update is the mean-squared-error gradient over the
    union of the step's rows, as one process would take it."""
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))  # noqa: E731
    models = [make() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    ref = make()
    ref.load_state_dict(models[0].state_dict())
    rng = np.random.default_rng(0)
    sizes = [(5, 2), (3, 7), (4, 4)]  # rows of replica 0 and 1 per step
    data = [[(torch.from_numpy(rng.normal(size=(s[r], 6)).astype(np.float32)),
              torch.from_numpy(rng.normal(size=(s[r], 2)).astype(np.float32))) for s in sizes] for r in range(2)]
    reducer = ThreadSum(2)

    def replica(rank):
        m = models[rank]
        worker = AllReduceWorker(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), 256, reducer.for_rank(rank),
                                 Regression())
        for i, (x, y) in enumerate(data[rank]):
            worker.step(x, y, i + 1 < len(sizes))

    run_replicas(2, replica)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for s in range(len(sizes)):
        x = torch.cat([data[r][s][0] for r in range(2)])
        y = torch.cat([data[r][s][1] for r in range(2)])
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
    torch.testing.assert_close(flat(models[0]), flat(ref), rtol=1e-5, atol=1e-6)
    assert torch.equal(flat(models[0]), flat(models[1]))


def test_user_task_loads_and_bad_ones_fail_in_one_line():
    task = load_task("examples.tasks:margin_task", {"margin": 0.5})
    assert task.margin == 0.5 and "test_top2_accuracy" in task.metrics
    for name, match in [("nosuch", "unknown task 'nosuch'"), ("no_such_module:f", "cannot import 'no_such_module'"),
                        ("examples.tasks:nothing", "has no function 'nothing'"),
                        ("examples.models:tiny_mlp", "has no loss\\(\\)")]:
        with pytest.raises(ValueError, match=match):
            load_task(name)


@pytest.mark.parametrize("overrides, message", [
    (["task.name=regression", "stop.target_accuracy=0.9"], "the regression task has no metric 'test_accuracy'"),
    (["stop.target={metric: test_r2, goal: max, value: 0.9}"], "classification task has no metric 'test_r2'"),
    (["stop.target={metric: test_loss, goal: min, value: 0.1}", "stop.target_accuracy=0.9"], "not both"),
    (["task.name=nosuch"], "task.name: unknown task"),
    (["strategy.phases=[{mode: allreduce, until: {test_mse: 0.1}}, {mode: easgd}]"], "unknown condition 'test_mse'"),
])
def test_metric_names_are_checked_before_anything_starts(overrides, message):
    with pytest.raises(ConfigError, match=message):
        JobConfig.from_dict({}, overrides)


def test_a_target_on_any_metric_and_the_headline():
    cfg = JobConfig.from_dict({}, ["task.name=regression", "stop.target={metric: test_r2, goal: max, value: 0.9}",
                                   "strategy.phases=[{mode: allreduce, until: {test_mse: 0.5}}, {mode: easgd}]"])
    target = cfg.stop.the_target()
    assert (target.metric, target.goal, target.value) == ("test_r2", "max", 0.9)
    assert cfg.headline_metric() == "test_r2"
    assert cfg.metric_goals()["test_mse"] == "min"
    assert JobConfig.from_dict({}, ["task.name=language_model"]).headline_metric() == "test_perplexity"
    assert JobConfig.from_dict({}).headline_metric() == "test_accuracy"
