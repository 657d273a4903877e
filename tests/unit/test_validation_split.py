"""data.val_fraction without Ray: the validation split is held out of the train rows of every
kind of source (builtins and in-memory arrays, files by a row hash of their own, torch Datasets
by index), disjoint from train and test, covering what train was, seeded, and leaving the test
split as it was; a run with one is judged on val_* metrics (targets, early stopping, best,
sweeps), and its test split is named in `final`."""
from __future__ import annotations

import numpy as np
import pytest

from actors.partitions.reading import eval_pieces, eval_shares, read_partition, read_range
from orchestrator.config import DataConfig, JobConfig
from orchestrator.errors import ConfigError
from orchestrator.data.loading import load_dataset
from orchestrator.reporting.result import FinalMetrics, TrainResult
from orchestrator.sweep.schema import SweepConfig
from policies.rules.tasks import load_task, split_metric
from tests import torch_datasets as tds
from tests.unit.test_streaming_plan import write_dir

CLASSIFY = load_task("classification", {})


def plan_ids(plan):
    return np.concatenate([read_range(plan, lo, hi)["ids"] for share in eval_shares(plan, 3)
                           for lo, hi in eval_pieces(plan, share)])


def train_ids(plan):
    return np.concatenate([read_partition(plan, p)["ids"] for p in range(len(plan.ranges))])


def test_in_memory_and_builtin_validation_rows_come_out_of_train_only():
    rng = np.random.default_rng(0)
    arrays = (rng.normal(size=(500, 4)).astype(np.float32), rng.integers(0, 3, 500))
    for data, fields in ((arrays, {}), (None, {"source": "builtin:digits"})):
        plain = load_dataset(DataConfig(**fields), data, task=CLASSIFY)
        held = load_dataset(DataConfig(val_fraction=0.25, **fields), data, task=CLASSIFY)
        again = load_dataset(DataConfig(val_fraction=0.25, **fields), data, task=CLASSIFY)
        assert plain.val is None and (held.test.ids == plain.test.ids).all()  # the test split is untouched
        assert len(held.val) == round(0.25 * len(plain.train))
        assert sorted(np.concatenate([held.train.ids, held.val.ids])) == sorted(plain.train.ids)
        assert set(held.train.ids).isdisjoint(held.val.ids)
        assert (again.val.ids == held.val.ids).all()  # seeded
        assert set(load_dataset(DataConfig(val_fraction=0.25, seed=1, **fields), data, task=CLASSIFY).val.ids) != set(held.val.ids)


def test_file_source_validation_rows_are_hashed_apart_from_train_and_test(tmp_path):
    table = write_dir(tmp_path / "d")
    plain = load_dataset(DataConfig(source=str(tmp_path / "d"), id_column="rid", partitions=4))
    held = load_dataset(DataConfig(source=str(tmp_path / "d"), id_column="rid", partitions=4, val_fraction=0.3))
    train, val, test = train_ids(held.train_plan), plan_ids(held.val_plan), plan_ids(held.test_plan)
    assert plain.val_plan is None and sorted(test) == sorted(plan_ids(plain.test_plan))
    assert held.val_rows == len(val) and held.train_rows == len(train) and abs(len(val) / (len(val) + len(train)) - 0.3) < 0.08
    every = np.concatenate([train, val, test])
    assert len(set(every)) == len(every) == 750 and sorted(every) == sorted(table.column("rid").to_numpy())
    # a separate test source: the validation rows come out of the whole source
    write_dir(tmp_path / "t", files=1, rows=50, seed=1)
    sep = load_dataset(DataConfig(source=str(tmp_path / "d"), id_column="rid", test_source=str(tmp_path / "t"),
                                  val_fraction=0.3))
    both = np.concatenate([train_ids(sep.train_plan), plan_ids(sep.val_plan)])
    assert sorted(both) == sorted(table.column("rid").to_numpy()) and 150 < sep.val_rows < 300


def test_torch_dataset_validation_indices_come_out_of_train():
    plain = load_dataset(DataConfig(test_fraction=0.2, seed=3), tds.Rows(200), task=CLASSIFY, replicas=2)
    held = load_dataset(DataConfig(test_fraction=0.2, seed=3, val_fraction=0.25), tds.Rows(200), task=CLASSIFY, replicas=2)
    train, val, test = train_ids(held.train_plan), plan_ids(held.val_plan), plan_ids(held.test_plan)
    assert sorted(test) == sorted(plan_ids(plain.test_plan)) and len(val) == 40 == held.val_rows and len(train) == 120
    assert sorted(np.concatenate([train, val, test])) == list(range(200))


@pytest.mark.parametrize("fraction", [0.9999, 1e-6])
def test_an_empty_side_is_a_config_error(fraction):
    with pytest.raises(ConfigError, match="data.val_fraction"):
        load_dataset(DataConfig(source="builtin:digits", val_fraction=fraction), task=CLASSIFY)


def test_a_run_with_a_validation_split_is_judged_on_val_metrics():
    cfg = JobConfig.from_dict({}, ["data.val_fraction=0.1"])
    assert cfg.eval_split == "val" and cfg.headline_metric() == "val_accuracy"
    assert cfg.judged_goals() == {"val_loss": "min", "val_accuracy": "max", "train_loss": "min"}
    assert {"test_accuracy", "val_accuracy"} <= set(cfg.metric_goals())  # final holds both
    assert JobConfig.from_dict({}, ["data.val_fraction=0.1", "stop.target_accuracy=0.9"]).target().metric == "val_accuracy"
    assert JobConfig.from_dict({}, []).headline_metric() == "test_accuracy"
    with pytest.raises(ConfigError, match="judged on the validation split: val_accuracy"):
        JobConfig.from_dict({}, ["data.val_fraction=0.1", "stop.target={metric: test_accuracy, goal: max, value: 0.9}"])
    with pytest.raises(ConfigError, match="strategy.phases"):
        JobConfig.from_dict({}, ["data.val_fraction=0.1",
                                 "strategy.phases=[{mode: downpour, until: {test_accuracy: 0.5}}, {mode: allreduce}]"])
    assert split_metric("bleu", "val") == "val_bleu" and split_metric("test_r2", "test") == "test_r2"


def test_a_sweep_ranks_by_the_base_configs_judged_metric():
    cfg = JobConfig.from_dict({}, ["data.val_fraction=0.1"])
    sweep = SweepConfig(base="x.yaml", search={"optimizer.lr": {"grid": [0.1]}})
    sweep.check_metric(cfg.judged_goals(), cfg.task.name, cfg.headline_metric())
    assert (sweep.metric, sweep.goal) == ("val_accuracy", "max")
    named = SweepConfig(base="x.yaml", search={"optimizer.lr": {"grid": [0.1]}}, metric="test_accuracy")
    with pytest.raises(ConfigError, match="validation split: val_accuracy"):
        named.check_metric(cfg.judged_goals(), cfg.task.name, cfg.headline_metric())


def test_the_final_line_gives_the_test_figure_beside_the_validation_one():
    result = TrainResult.__new__(TrainResult)
    result.stop_reason, result.final = "epochs", FinalMetrics({"val_accuracy": 0.91, "test_accuracy": 0.9})
    assert result.headline("val_accuracy") == "done: epochs; val_accuracy 0.9100; test_accuracy 0.9000"


def test_a_validation_source_is_read_whole_beside_train_and_test(tmp_path):
    write_dir(tmp_path / "d")
    write_dir(tmp_path / "v", files=1, rows=60, seed=2)
    plain = load_dataset(DataConfig(source=str(tmp_path / "d"), id_column="rid", partitions=4))
    given = load_dataset(DataConfig(source=str(tmp_path / "d"), id_column="rid", partitions=4, val_source=str(tmp_path / "v")))
    assert given.val_rows == 60 and given.train_rows == plain.train_rows  # nothing held out of train
    assert sorted(plan_ids(given.test_plan)) == sorted(plan_ids(plain.test_plan))
    rng = np.random.default_rng(0)
    arrays = (rng.normal(size=(500, 5)).astype(np.float32), rng.integers(0, 3, 500))
    mem = load_dataset(DataConfig(val_source=str(tmp_path / "v"), label_column="label", feature_columns=["features"]),
                       arrays, task=CLASSIFY)
    assert len(mem.val) == 60 and len(mem.train) + len(mem.test) == 500
    with pytest.raises(ConfigError, match="choose one"):
        JobConfig.from_dict({}, ["data.val_fraction=0.1", f"data.val_source={tmp_path / 'v'}"])
    with pytest.raises(ConfigError, match="data.val_source: builtin:digits comes decoded and split"):
        load_dataset(DataConfig(source="builtin:digits", val_source=str(tmp_path / "v")), task=CLASSIFY)


def test_a_torch_validation_source_is_a_module_function_too():
    ds = load_dataset(DataConfig(source="tests.torch_datasets:rows", val_source="tests.torch_datasets:rows_test"),
                      task=CLASSIFY, replicas=2)
    assert ds.train_rows == 160 and ds.test_rows == 40 and ds.val_rows == len(plan_ids(ds.val_plan)) > 0
    with pytest.raises(ConfigError, match="data.val_source: .* goes with a torch Dataset train set"):
        load_dataset(DataConfig(source="builtin:digits", val_source="tests.torch_datasets:rows_test"), task=CLASSIFY)
