"""Planning and reading a file source without Ray: row ranges cover every row once, the row-hash
split is disjoint and covering, a partition opens only the row groups it needs, the builtin
decoder follows the task's dtypes, several label columns, and the user's decoder's errors."""
import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.partitions import reading
from actors.partitions.decoding import DecodeError, DecodeSpec, check_decoded, decode
from actors.partitions.reading import (SourceReadError, count_kept, cut_ranges, eval_shares, overlapping, read_partition,
                            read_range, held_out_mask, eval_pieces)
from orchestrator.config import DataConfig
from orchestrator.errors import ConfigError
from orchestrator.data.planning import default_partitions
from orchestrator.data.loading import load_dataset
from policies.rules.tasks import load_task


def write_dir(d, files=3, rows=250, row_group=40, dim=5, seed=0):
    d.mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    n = files * rows
    x = rng.normal(size=(n, dim)).astype(np.float32)
    table = pa.table({"rid": np.arange(10_000, 10_000 + n), "label": rng.integers(0, 5, n),
                      "y2": rng.normal(size=n), "features": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), dim)})
    for i in range(files):
        pq.write_table(table.slice(i * rows, rows), d / f"f{i}.parquet", row_group_size=row_group)
    return table


def test_hash_split_is_deterministic_and_near_the_fraction():
    pos = np.arange(200_000)
    a, b = held_out_mask(pos, 3, 0.2), held_out_mask(pos, 3, 0.2)
    assert (a == b).all() and abs(a.mean() - 0.2) < 0.005
    assert (held_out_mask(pos, 4, 0.2) != a).any()  # another seed, another split
    assert (held_out_mask(pos[5000:6000], 3, 0.2) == a[5000:6000]).all()  # a row's fate is its own


@pytest.mark.parametrize("parts", [1, 4, 7, 30])
def test_ranges_cover_every_row_once_and_train_test_are_disjoint_and_covering(tmp_path, parts):
    table = write_dir(tmp_path / "d")
    ds = load_dataset(DataConfig(source=str(tmp_path / "d"), id_column="rid", partitions=parts))
    plan, tp = ds.train_plan, ds.test_plan
    assert len(plan.ranges) == parts and plan.ranges[0][0] == 0 and plan.ranges[-1][1] == plan.total == 750
    assert all(plan.ranges[i][1] == plan.ranges[i + 1][0] for i in range(parts - 1))  # contiguous, no gap or overlap
    assert max(plan.rows) - min(plan.rows) <= 1  # near-equal train rows
    train = np.concatenate([read_partition(plan, p)["ids"] for p in range(parts)])
    assert [len(read_partition(plan, p)["ids"]) for p in range(parts)] == list(plan.rows)
    test = np.concatenate([read_range(tp, lo, hi)["ids"] for share in eval_shares(tp, 3) for lo, hi in eval_pieces(tp, share)])
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert set(train).isdisjoint(test)
    assert sorted(np.concatenate([train, test])) == sorted(table.column("rid").to_numpy())


def test_cut_ranges_balances_kept_rows_without_reading():
    spec = DecodeSpec(("label",), False, ("f",), None, None)
    plan = reading.StreamPlan("s", "data.source", "parquet", pa.schema([]), (reading.Block("a", 0, 0, 10_000),), spec,
                              "train", 0.3, 7)
    ranges, rows = cut_ranges(plan, 8)
    assert sum(rows) == count_kept(plan, 0, 10_000) and max(rows) - min(rows) <= 1
    assert [count_kept(plan, lo, hi) for lo, hi in ranges] == rows


def test_eval_shares_are_contiguous_and_balanced():
    spec = DecodeSpec(("label",), False, ("f",), None, None)
    plan = reading.StreamPlan("s", "data.source", "parquet", pa.schema([]), (reading.Block("a", 0, 0, 1000),), spec,
                              "test", 0.2, 0, ranges=tuple((a, a + 50) for a in range(0, 1000, 50)),
                              rows=tuple([10] * 20), piece_rows=50)
    shares = eval_shares(plan, 3)
    assert [r for s in shares for r in s] == list(plan.ranges)  # every piece once, in order
    assert sorted(len(s) for s in shares) == [6, 7, 7]


def test_a_partition_opens_only_the_row_groups_it_needs(tmp_path, monkeypatch):
    write_dir(tmp_path / "d", row_group=40)
    ds = load_dataset(DataConfig(source=str(tmp_path / "d"), partitions=12))
    plan = ds.train_plan
    opened = []
    real = reading._block_slices

    def spy(fs, plan_, block, lo, hi, columns):
        opened.append((block.path, block.row_group))
        return real(fs, plan_, block, lo, hi, columns)

    monkeypatch.setattr(reading, "_block_slices", spy)
    for p, (lo, hi) in enumerate(plan.ranges):
        opened.clear()
        read_partition(plan, p)
        needed = {(b.path, b.row_group) for b in plan.blocks if b.start < hi and b.start + b.rows > lo}
        assert set(opened) == needed and len(opened) == len(needed)
        assert len(needed) <= 3  # ~60 positions over 40-row groups: never the whole file
    assert [b.row_group for b in overlapping(plan.blocks, 45, 85)] == [1, 2]


def test_a_partly_covered_row_group_gives_exactly_the_range(tmp_path):
    table = write_dir(tmp_path / "d", files=1, rows=100, row_group=30)
    ds = load_dataset(DataConfig(source=str(tmp_path / "d"), id_column="rid", test_fraction=0.2))
    whole = dataclasses.replace(ds.train_plan, keep="all")
    part = read_range(whole, 17, 71)
    np.testing.assert_array_equal(part["ids"], table.column("rid").to_numpy()[17:71])
    np.testing.assert_array_equal(part["y"], table.column("label").to_numpy()[17:71])


@pytest.mark.parametrize("task, x_dtype, y_dtype", [("classification", np.float32, np.int64),
                                                    ("regression", np.float32, np.float32),
                                                    ("language_model", np.int64, np.int64)])
def test_the_builtin_decoder_follows_the_task_dtypes(tmp_path, task, x_dtype, y_dtype):
    write_dir(tmp_path / "d")
    ds = load_dataset(DataConfig(source=str(tmp_path / "d"), feature_columns=["features"]), task=load_task(task))
    part = read_partition(ds.train_plan, 0)
    assert part["x"].dtype == x_dtype and part["y"].dtype == y_dtype and part["x"].shape[1:] == (5,)
    assert part["y"].shape == (len(part["ids"]),)
    assert ds.num_classes == (5 if task != "regression" else 0)


def test_a_list_label_column_gives_n_by_k_float_targets(tmp_path):
    table = write_dir(tmp_path / "d")
    cfg = DataConfig(source=str(tmp_path / "d"), label_column=["label", "y2"], feature_columns=["features"], id_column="rid")
    ds = load_dataset(cfg, task=load_task("regression"))
    part = read_partition(ds.train_plan, 1)
    assert part["y"].shape == (len(part["ids"]), 2) and part["y"].dtype == np.float32
    rows = part["ids"] - 10_000
    np.testing.assert_allclose(part["y"][:, 1], table.column("y2").to_numpy()[rows].astype(np.float32))
    one = load_dataset(cfg.model_copy(update={"label_column": ["y2"]}), task=load_task("regression"))
    assert read_partition(one.train_plan, 0)["y"].shape[1:] == (1,)  # a list of one: still [n, 1]
    with pytest.raises(ConfigError, match="data.label_column: 'y2' is double; the task's targets are int64"):
        load_dataset(cfg)  # classification: class ids must be integers


def test_negative_class_ids_are_caught_from_the_statistics(tmp_path):
    pq.write_table(pa.table({"f": np.ones(50), "label": np.arange(50) - 1}), tmp_path / "neg.parquet")
    with pytest.raises(ConfigError, match="negative class ids"):
        load_dataset(DataConfig(source=str(tmp_path / "neg.parquet")))


def bad_rows(table):
    return np.zeros((table.num_rows, 3), np.float32), np.zeros(table.num_rows + 1, np.int64)


def not_a_pair(table):
    return np.zeros((table.num_rows, 3))


def named_inputs(table):
    import torch

    n = table.num_rows
    return {"a": torch.zeros(n, 2), "b": np.ones((n, 4), np.int64)}, table.column("label").to_numpy()


@pytest.mark.parametrize("fn, needle", [
    ("tests.unit.test_streaming_plan:bad_rows", "returned targets with 65 rows for a table of 64 rows"),
    ("tests.unit.test_streaming_plan:not_a_pair", "returned ndarray; expected a tuple (inputs, targets)"),
    ("tests.unit.test_streaming_plan:nope", "has no function 'nope'"),
    ("no_such_module_here:decode", "cannot import 'no_such_module_here'"),
])
def test_user_decode_errors_are_one_line_naming_data_decode(tmp_path, fn, needle):
    write_dir(tmp_path / "d", files=1)
    with pytest.raises(ConfigError) as exc:
        load_dataset(DataConfig(source=str(tmp_path / "d"), decode=fn))
    msg = str(exc.value)
    assert msg.startswith("config error: data.decode: ") and needle in msg and "\n" not in msg, msg


def test_a_user_decoder_may_return_tensors_and_dicts(tmp_path):
    write_dir(tmp_path / "d", files=1)
    ds = load_dataset(DataConfig(source=str(tmp_path / "d"), decode="tests.unit.test_streaming_plan:named_inputs"))
    part = read_partition(ds.train_plan, 0)
    assert set(part["x"]) == {"a", "b"} and isinstance(part["x"]["a"], np.ndarray)
    assert part["x"]["a"].shape == (len(part["ids"]), 2)
    with pytest.raises(DecodeError, match="data.decode: f returned inputs of type list"):
        check_decoded(([1, 2], np.zeros(2)), 2, "f")


def test_an_unreadable_file_is_named(tmp_path):
    write_dir(tmp_path / "d")
    ds = load_dataset(DataConfig(source=str(tmp_path / "d"), partitions=6))
    (tmp_path / "d" / "f2.parquet").write_bytes(b"garbage" * 50)
    read_partition(ds.train_plan, 0)  # the first file's rows are still fine
    with pytest.raises(SourceReadError, match=f"data.source: cannot read {tmp_path / 'd' / 'f2.parquet'}"):
        read_partition(ds.train_plan, 5)


def test_default_partitions_bound_their_size():
    assert default_partitions(2, 1000, 1250, 10 << 20) == 8  # small data: 4 x replicas
    assert default_partitions(2, 380_000, 475_000, 2_000_000_000) == 24  # 1.6 GB of train rows: <= 64 MB each


def test_decode_casts_and_reshapes_with_the_schema_metadata():
    table = pa.table({"p": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(8, dtype=np.int32)), 4),
                      "label": np.array([1, 0])}).replace_schema_metadata({b"feature_shape": b"1,2,2"})
    spec = DecodeSpec(("label",), False, ("p",), (1, 2, 2), None)
    x, y = decode(table, spec)
    assert x.shape == (2, 1, 2, 2) and x.dtype == np.float32 and y.tolist() == [1, 0]
