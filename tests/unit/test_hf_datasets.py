"""Hugging Face datasets wherever a torch Dataset goes (no Ray): `data=ds`, `data=(train, test)`,
plain or with_format("torch"), read by column in one call per partition; a DatasetDict and a
dataset living in the driver's cache files on a many-machine cluster are one-line errors."""
from __future__ import annotations

import datasets
import numpy as np
import pytest

from actors.partitions.reading import read_range
from orchestrator.data.loading import load_dataset
from orchestrator.data.torch_data import driver_files_refusal
from orchestrator.errors import ConfigError
from tests.conftest import job_config

IDS = np.random.default_rng(0).integers(0, 128, (120, 12))


def config():
    return job_config(task={"name": "model_loss"}, data={"label_column": "labels", "partitions": 4})


@pytest.mark.parametrize("fmt", [None, "torch", "numpy"])
def test_a_dataset_as_data_reads_every_row_once_by_column(fmt):
    ds = datasets.Dataset.from_dict({"input_ids": IDS.tolist(), "labels": (IDS + 1).tolist()})
    ds = ds.with_format(fmt) if fmt else ds
    cfg = config()
    planned = load_dataset(cfg.data, ds, task=cfg.task.build())
    plan = planned.train_plan
    seen = []
    for lo, hi in plan.ranges:
        part = read_range(plan, lo, hi)
        assert part["x"]["input_ids"].dtype == np.int64 and part["y"].shape == (hi - lo, 12)
        np.testing.assert_array_equal(part["y"], part["x"]["input_ids"] + 1)  # each row's labels with its inputs
        np.testing.assert_array_equal(part["x"]["input_ids"], IDS[part["ids"]])
        seen.extend(part["ids"].tolist())
    tested = [i for lo, hi in planned.test_plan.ranges for i in read_range(planned.test_plan, lo, hi)["ids"]]
    assert len(seen) == len(set(seen)) and not set(seen) & set(tested)  # no row twice, none in both splits
    assert sorted(seen + tested) == list(range(120))


def test_a_pair_and_a_dataset_dict():
    train = datasets.Dataset.from_dict({"input_ids": IDS[:100].tolist(), "labels": IDS[:100].tolist()})
    test = datasets.Dataset.from_dict({"input_ids": IDS[100:].tolist(), "labels": IDS[100:].tolist()})
    cfg = config()
    planned = load_dataset(cfg.data, (train, test), task=cfg.task.build())
    assert planned.train_rows == 100 and planned.test_rows == 20
    with pytest.raises(ConfigError, match=r"config error: data: .*DatasetDict of splits \('train', 'test'\); give "
                                          r"its \(train, test\) pair"):
        load_dataset(cfg.data, datasets.DatasetDict({"train": train, "test": test}), task=cfg.task.build())


def test_rows_of_different_lengths_are_one_line():
    ragged = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]] * 10, "labels": [[1, 2, 3], [4, 5]] * 10})
    cfg = config()
    with pytest.raises(ConfigError, match="Python objects; inputs and targets must be numeric .*pad them"):
        load_dataset(cfg.data, ragged, task=cfg.task.build())


def test_a_dataset_in_the_driver_s_files_is_refused_only_where_another_machine_would_read_it():
    files = ["/home/me/.cache/hf/train.arrow", "/home/me/.cache/hf/more.arrow"]
    assert driver_files_refusal([], ["10.0.0.1", "10.0.0.2"], "10.0.0.1", "ds") is None  # in memory
    assert driver_files_refusal(files, ["10.0.0.1", "10.0.0.1"], "10.0.0.1", "ds") is None  # one machine
    line = driver_files_refusal(files, ["10.0.0.1", "10.0.0.2"], "10.0.0.1", "the dataset (Dataset)")
    assert line.startswith("config error: data: the dataset (Dataset) reads its rows from files on this machine "
                           "(/home/me/.cache/hf/train.arrow and 1 more), which the cluster's nodes at 10.0.0.2")
    assert "\n" not in line
