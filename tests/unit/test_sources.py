"""File and in-memory sources: formats, feature assembly, and one-line errors for bad data."""
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import yaml

from orchestrator.cli.main import main
from orchestrator.config import DataConfig
from orchestrator.data.loading import load_dataset


def blobs(n=200, dim=4, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = rng.normal(size=(n, dim)) + y[:, None] * 3
    cols = {"id": np.arange(1000, 1000 + n), "label": y}
    cols.update({f"f{i}": x[:, i].astype(np.float32) for i in range(dim)})
    return pa.table(cols), x.astype(np.float32), y


def read_all(ds):
    """A planned file source read whole, as its readers read it: (train rows, test rows), each
    {"x", "y", "ids"} concatenated (tests only: small data)."""
    from actors.partitions.reading import eval_shares, read_partition, read_range, eval_pieces

    def join(parts):
        return {k: np.concatenate([p[k] for p in parts]) for k in ("x", "y", "ids")}

    plan, tp = ds.train_plan, ds.test_plan
    train = join([read_partition(plan, p) for p in range(len(plan.ranges))])
    test = join([read_range(tp, lo, hi) for share in eval_shares(tp, 2) for lo, hi in eval_pieces(tp, share)])
    return train, test


@pytest.mark.parametrize("fmt", ["parquet", "csv", "arrow"])
def test_formats_files_and_directories(tmp_path, fmt):
    table, x, y = blobs()
    d = tmp_path / "data"
    d.mkdir()
    halves = [table.slice(0, 100), table.slice(100)]
    for i, part in enumerate(halves):
        path = d / f"part-{i}.{fmt}"
        {"parquet": pq.write_table, "csv": pacsv.write_csv, "arrow": feather.write_feather}[fmt](part, str(path))
    for source in (str(d), f"file://{d}", str(d / f"part-0.{fmt}")):
        ds = load_dataset(DataConfig(source=source, id_column="id", test_fraction=0.25))
        n = 200 if source != str(d / f"part-0.{fmt}") else 100
        train, test = read_all(ds)
        assert ds.train_rows + ds.test_rows == n and ds.num_classes == 3
        assert train["x"].shape[1:] == (4,) and train["x"].dtype == np.float32
        both = np.concatenate([train["ids"], test["ids"]])
        assert sorted(both) == list(range(1000, 1000 + n))
        assert len(train["ids"]) == ds.train_rows and 0.1 < ds.test_rows / n < 0.4
        np.testing.assert_allclose(train["x"], x[train["ids"] - 1000], rtol=1e-6)
        np.testing.assert_array_equal(test["y"], y[test["ids"] - 1000])


def test_fixed_size_list_features_and_feature_shape(tmp_path):
    n = 30
    imgs = np.arange(n * 16, dtype=np.float32).reshape(n, 16)
    table = pa.table({"pixels": pa.FixedSizeListArray.from_arrays(pa.array(imgs.reshape(-1)), 16),
                      "extra": np.ones(n), "label": np.arange(n) % 2})
    pq.write_table(table, tmp_path / "x.parquet")
    ds = load_dataset(DataConfig(source=str(tmp_path / "x.parquet"), feature_columns=["pixels"], feature_shape=[1, 4, 4]))
    assert ds.sample.x.shape[1:] == (1, 4, 4) and read_all(ds)[0]["x"].shape[1:] == (1, 4, 4)
    ds2 = load_dataset(DataConfig(source=str(tmp_path / "x.parquet")))  # list column + numeric column
    assert ds2.sample.x.shape[1:] == (17,)


def test_in_memory_numpy_pandas_and_arrow():
    table, x, y = blobs()
    for data in ((x, y), table.to_pandas(), table):
        ds = load_dataset(DataConfig(source="in-memory", id_column=None if isinstance(data, tuple) else "id"), data)
        assert len(ds.train) + len(ds.test) == 200


@pytest.mark.parametrize("mutate, needle", [
    (lambda d, t: {"source": str(d / "nope")}, "data.source: no such file or directory"),
    (lambda d, t: {"label_column": "target"}, "data.label_column: no column 'target'"),
    (lambda d, t: {"feature_columns": ["name"]}, "data.feature_columns: column 'name' is string, not numeric"),
    (lambda d, t: {"source": str(t)}, "has no rows"),
    (lambda d, t: {"feature_shape": [3, 3]}, "data.feature_shape: [3, 3] holds 9 values but rows have 4 features"),
])
def test_bad_data_gets_one_line_naming_the_problem(tmp_path, capsys, monkeypatch, mutate, needle):
    table, _, _ = blobs()
    table = table.append_column("name", pa.array(["a"] * table.num_rows))
    pq.write_table(table, tmp_path / "good.parquet")
    empty = tmp_path / "empty.parquet"
    pq.write_table(table.slice(0, 0), empty)
    data = {"source": str(tmp_path / "good.parquet"), "id_column": "id", "feature_columns": ["f0", "f1", "f2", "f3"]}
    data.update(mutate(tmp_path, empty))
    job = {"model": {"factory": "examples.models:tiny_mlp", "kwargs": {"in_features": 4, "num_classes": 3}}, "data": data}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_a_store_that_cannot_be_listed_is_one_line_naming_the_field(tmp_path):
    import socket

    from orchestrator.errors import ConfigError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    table, _, _ = blobs()
    pq.write_table(table, tmp_path / "train.parquet")
    unreachable = f"s3://bucket/test?region=us-east-1&scheme=http&endpoint_override=127.0.0.1:{port}"
    for cfg, field in ((DataConfig(source=unreachable), "data.source"),
                       # the test split's own field named (a store that does not exist: no retries to wait out)
                       (DataConfig(source=str(tmp_path / "train.parquet"), test_source="nosuch://x"), "data.test_source"),
                       (DataConfig(source="nosuch://x"), "data.source")):
        with pytest.raises(ConfigError) as exc:
            load_dataset(cfg)
        msg = str(exc.value)
        assert msg.startswith(f"config error: {field}: cannot ") and "\n" not in msg, msg
