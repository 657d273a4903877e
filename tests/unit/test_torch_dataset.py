"""A map-style torch Dataset as a data source, without Ray (orchestrator/data/torch_data.py,
actors/partitions/items.py): the seeded split and the partitions cover every index exactly once, items
collate into the task's dtypes (pairs and dicts), a collate of one's own is used, threads give
the same rows as none, and bad datasets are one ConfigError line naming the problem."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.partitions.reader import PartitionReader
from actors.partitions.reading import SourceReadError, eval_pieces, eval_shares, read_partition, read_range
from orchestrator.config import DataConfig
from orchestrator.errors import ConfigError
from orchestrator.data.loading import load_dataset
from orchestrator.data.torch_data import is_function_source
from orchestrator.trainer import ElasticTrainer
from policies.rules.tasks import load_task
from tests import torch_datasets as tds
from tests.conftest import job_config

CLASSIFY = load_task("classification", {})


def load(data=None, task=CLASSIFY, replicas=2, **fields):
    return load_dataset(DataConfig(**fields), data, task=task, replicas=replicas)


def trained_ids(ds):
    return np.concatenate([read_partition(ds.train_plan, p)["ids"] for p in range(len(ds.train_plan.ranges))])


def held_out_ids(ds, members=3):
    plan = ds.test_plan
    return np.concatenate([read_range(plan, lo, hi)["ids"] for share in eval_shares(plan, members)
                           for lo, hi in eval_pieces(plan, share)])


@pytest.mark.parametrize("parts", [1, 4, 7, 160])
def test_split_and_partitions_cover_every_index_exactly_once(parts):
    ds = load(tds.Rows(200), partitions=parts, test_fraction=0.2, seed=3)
    train, test = trained_ids(ds), held_out_ids(ds)
    assert len(ds.train_plan.ranges) == parts and max(ds.train_plan.rows) - min(ds.train_plan.rows) <= 1
    assert [len(read_partition(ds.train_plan, p)["ids"]) for p in range(parts)] == list(ds.train_plan.rows)
    assert len(test) == 40 and len(train) == 160 == ds.train_rows and ds.test_rows == 40
    assert len(set(train)) == len(train) and len(set(test)) == len(test) and set(train).isdisjoint(test)
    assert sorted(np.concatenate([train, test])) == list(range(200))
    assert sorted(train) != list(train)  # partitions are random subsets: data sorted by class is mixed anyway


def test_the_split_is_seeded():
    a, b, c = (held_out_ids(load(tds.Rows(200), seed=s)) for s in (1, 1, 2))
    assert (a == b).all() and set(a) != set(c)


def test_a_pair_or_a_test_source_gives_the_test_set():
    pair = load(source="tests.torch_datasets:rows_pair", partitions=5)
    assert pair.train_rows == 150 and pair.test_rows == 50 and pair.name == "tests.torch_datasets:rows_pair"
    assert sorted(trained_ids(pair)) == list(range(150)) and sorted(held_out_ids(pair)) == list(range(50))
    sep = load(source="tests.torch_datasets:rows", test_source="tests.torch_datasets:rows_test")
    assert sep.train_rows == 200 and sep.test_rows == 40
    both = load((tds.Rows(30), tds.Rows(10)), partitions=3)  # the Python API's (train, test)
    assert both.train_rows == 30 and both.test_rows == 10


def test_tuple_items_collate_into_the_tasks_dtypes():
    ds = load(tds.Rows(200, dim=4, classes=5), partitions=4)
    part = read_partition(ds.train_plan, 2)
    ids = part["ids"]
    assert part["x"].dtype == np.float32 and part["x"].shape == (len(ids), 4)  # float64 items -> float32
    assert part["y"].dtype == np.int64 and (part["y"] == ids % 5).all()  # Python ints -> int64 class ids
    assert (part["x"] == ids[:, None] + np.arange(4)).all()  # each row is its index's item
    assert ds.num_classes == 5 and ds.sample.x.shape == (64, 4)
    regression = load(tds.Rows(50), task=load_task("regression", {}), partitions=2)
    assert read_partition(regression.train_plan, 0)["y"].dtype == np.float32


def test_dict_items_are_split_by_label_column():
    ds = load(tds.DictRows(120), partitions=3)
    part = read_partition(ds.train_plan, 0)
    x, ids = part["x"], part["ids"]
    assert set(x) == {"image", "weight"} and x["image"].shape == (len(ids), 1, 2, 2)
    assert x["weight"].dtype == np.float32 and (x["weight"] == ids).all()  # float64 -> float32
    assert (x["image"][:, 0, 0, 0] == ids).all() and (part["y"] == ids % 4).all() and part["y"].dtype == np.int64
    two = read_partition(load(tds.DictRows(120), label_column=["label", "weight"], partitions=3).train_plan, 0)
    assert set(two["x"]) == {"image"} and set(two["y"]) == {"label", "weight"}


def test_a_partition_is_cut_into_batches_of_its_items():
    ds = load(tds.Rows(200), partitions=4, batch_size=16)
    part = read_partition(ds.train_plan, 1)
    reader = PartitionReader(None, [], 0, 16, True, torch.device("cpu"), 5)
    seen = []
    for x, y, idx in reader.batches({"seed": 7}, part):
        rows = part["ids"][idx.numpy()]
        assert x.dtype == torch.float32 and y.dtype == torch.int64 and len(rows) <= 16
        assert (x[:, 0].numpy() == rows).all() and (y.numpy() == rows % 5).all()
        seen += rows.tolist()
    assert sorted(seen) == sorted(part["ids"].tolist())  # every row of the partition once


def test_a_collate_of_ones_own_is_used():
    ds = load(tds.Rows(100), collate="tests.torch_datasets:collate_marked", partitions=2)
    part = read_partition(ds.train_plan, 0)
    assert (part["x"] == 7).all() and (part["y"] == part["ids"] % 5).all()
    with pytest.raises(ConfigError, match=r"collated to 1 rows for 64 items"):
        load(tds.Rows(100), collate="tests.torch_datasets:collate_one_row")
    with pytest.raises(ConfigError, match=r"^config error: data.collate: 'tests.torch_datasets' has no function 'nope'"):
        load(tds.Rows(100), collate="tests.torch_datasets:nope")


def test_loader_workers_give_the_same_rows_as_none_on_threads():
    plain = load(tds.Rows(300), partitions=3)
    dataset = tds.ThreadNames(300)
    threaded = load(dataset, partitions=3, loader_workers=4)
    for p in range(3):
        a, b = read_partition(plain.train_plan, p), read_partition(threaded.train_plan, p)
        assert all((a[k] == b[k]).all() for k in ("x", "y", "ids"))
    assert len({n for n in dataset.seen if n.startswith("getitem")}) > 1  # __getitem__ ran on several threads


def test_a_module_function_source_in_yaml():
    from orchestrator.config import JobConfig

    cfg = JobConfig.from_dict({"data": {"source": "tests.torch_datasets:rows", "loader_workers": 2,
                                        "collate": "tests.torch_datasets:collate_marked"}})
    ds = load_dataset(cfg.data, task=CLASSIFY)
    assert ds.train_rows == 160 and ds.test_rows == 40 and (ds.sample.x == 7).all()
    assert ds.train_plan.items.workers == 2


def test_function_sources_are_told_from_paths():
    assert is_function_source("mypkg.data:make") and is_function_source("tests.torch_datasets:rows")
    for other in ("builtin:mnist5k", "s3://bucket/x", "runs/data/x.parquet", "data/a:b.parquet", "x:", ":f", None):
        assert not is_function_source(other), other


def test_the_sweep_leaves_a_module_function_source_alone():
    from orchestrator.sweep.driver import _absolute_paths

    out = _absolute_paths({"data": {"source": "tests.torch_datasets:rows", "test_source": "tests.torch_datasets:rows_test"}})
    assert out["data"] == {"source": "tests.torch_datasets:rows", "test_source": "tests.torch_datasets:rows_test"}


def test_the_checks_before_a_run_take_a_torch_dataset(tmp_path):
    cfg = job_config(model={"factory": "examples.models:tiny_mlp", "kwargs": {"in_features": 4, "num_classes": 5}},
                     checkpoint={"storage": str(tmp_path)})
    assert ElasticTrainer(cfg, show_progress=False, data=tds.Rows(200)).check().train_rows == 160
    cfg = job_config(model={"factory": "examples.models:tiny_mlp", "kwargs": {"in_features": 8, "num_classes": 5}},
                     checkpoint={"storage": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"^config error: model.factory: .* does not accept"):
        ElasticTrainer(cfg, show_progress=False, data=tds.Rows(200)).check()


def test_an_item_failing_mid_run_names_the_index():
    ds = load(tds.Failing(200, bad=199), partitions=4)  # index 199: not among the first rows checked
    where = next(p for p in range(4) if 199 in ds.train_plan.items.indices[slice(*ds.train_plan.ranges[p])])
    with pytest.raises(SourceReadError, match=r"^data: the dataset \(Failing\): dataset\[199\] raised "
                                              r"FileNotFoundError: sample-199.png \(rows \d+-\d+\)$"):
        read_partition(ds.train_plan, where)


@pytest.mark.parametrize("data, fields, needle", [
    (tds.Stream(), {}, r"data: the dataset \(Stream\) is an IterableDataset, which is not supported: rows "
                       r"are dealt out, traced and served again after a failure by index"),
    (None, {"source": "tests.torch_datasets:stream"},
     r"data.source: tests.torch_datasets:stream\(\) \(Stream\) is an IterableDataset"),
    (None, {"source": "tests.torch_datasets:a_number"},
     r"data.source: tests.torch_datasets:a_number\(\) is of type int, not a map-style dataset"),
    (tds.NoLen(), {}, r"data: the dataset \(NoLen\) has no __len__"),
    (tds.Empty(), {}, r"data: the dataset \(Empty\) is empty \(len 0\)"),
    (tds.Failing(50, bad=0), {}, r"data: the dataset \(Failing\): dataset\[0\] raised FileNotFoundError: sample-0.png"),
    (None, {"source": "no_such_module_here:make"}, r"data.source: cannot import 'no_such_module_here' \(ModuleNotFoundError"),
    (None, {"source": "tests.torch_datasets:nothing"}, r"data.source: 'tests.torch_datasets' has no function 'nothing'"),
    (None, {"source": "tests.torch_datasets:raises"}, r"data.source: tests.torch_datasets:raises raised RuntimeError: the "
                                                      r"bucket is not there"),
    (tds.Unpicklable(), {}, r"data: the dataset \(Unpicklable\) cannot be pickled to ship it to the replicas: "
                            r"dataset.state.lock \(lock\) does not pickle \(TypeError: cannot pickle '_thread.lock'"),
    (tds.Ragged(), {}, r"data.collate: torch's default_collate could not batch the items \(RuntimeError: .*\); items "
                       r"that do not stack"),
    (tds.FloatTargets(), {},
     r"data: the targets are float64; the task's targets are int64 \(integer class ids for classification\)$"),
    (tds.Triples(), {}, r"data: the dataset's items collate to a list of 3; an item must be an \(inputs, targets\) pair"),
    (tds.DictRows(), {"label_column": "y"}, r"data.label_column: the dataset's items are dicts with keys 'image', "
                                            r"'label', 'weight'; no 'y'"),
    (tds.Rows(10), {"test_fraction": 0.01}, r"data.test_fraction: 0.01 of 10 rows leaves an empty train or test split"),
    (tds.Rows(10), {"partitions": 9}, r"data.partitions: 9 partitions for 8 train rows"),
    (tds.Rows(), {"feature_shape": [2, 2]}, r"data.feature_shape: applies to table sources"),
    (tds.Rows(), {"decode": "m:f"}, r"data.decode: applies to table sources"),
    (None, {"source": "tests.torch_datasets:rows_pair", "test_source": "tests.torch_datasets:rows_test"},
     r"data.test_source: tests.torch_datasets:rows_pair\(\) already gives a test set"),
    (None, {"source": "tests.torch_datasets:rows", "test_source": "runs/test.parquet"},
     r"data.test_source: 'runs/test.parquet': with a torch Dataset, the test set is a 'module:function'"),
    ((np.zeros((4, 2)), np.zeros(4)), {"collate": "m:f"}, r"data.collate: applies to a torch Dataset source only"),
    (None, {"loader_workers": 2}, r"data.loader_workers: applies to a torch Dataset source only"),
    (None, {"source": "runs/x.parquet", "test_source": "tests.torch_datasets:rows_test"},
     r"data.test_source: tests.torch_datasets:rows_test is a 'module:function' test set, which goes with a torch Dataset"),
])
def test_bad_datasets_are_one_line_naming_the_problem(data, fields, needle):
    with pytest.raises(ConfigError) as info:
        load(data, **fields)
    message = str(info.value)
    assert "\n" not in message and message.startswith("config error: "), message
    assert __import__("re").search(needle, message), message


def test_a_dataset_of_files_ships_pickled_and_reads_them_where_it_lands(tmp_path):
    """What a read task gets: the plan pickled (the dataset in it as its directory), then read."""
    from ray import cloudpickle

    labels = tds.write_digit_files(tmp_path / "digits", 40)
    ds = load(tds.DigitFiles(tmp_path / "digits"), partitions=4)
    shipped = cloudpickle.loads(cloudpickle.dumps(ds.train_plan))
    assert len(cloudpickle.dumps(ds.train_plan.items.dataset)) < 2000  # the directory and 40 labels, no image
    for p in range(4):
        here, there = read_partition(ds.train_plan, p), read_partition(shipped, p)
        assert all((here[k] == there[k]).all() for k in ("x", "y", "ids"))
        assert there["x"].shape == (len(there["ids"]), 1, 8, 8) and (there["y"] == labels[there["ids"]]).all()


def test_the_dataset_is_put_into_the_object_store_once(monkeypatch):
    import ray

    from orchestrator.data.placement import place_data

    put = []
    monkeypatch.setattr(ray, "put", lambda obj: put.append(obj) or obj)
    dataset = tds.Rows(100)
    placed = place_data(load(dataset, partitions=4), 4, 0)
    datasets = [obj for obj in put if obj is dataset]
    assert len(datasets) == 1  # the split's train and test plans share one copy
    assert placed.rows == [20] * 4 and placed.test_rows == 20
    assert placed.train.items.dataset is dataset and placed.test.items.dataset is dataset
    pair = place_data(load((tds.Rows(30), tds.Rows(10)), partitions=3), 3, 0)
    assert pair.train.items.dataset is not pair.test.items.dataset
