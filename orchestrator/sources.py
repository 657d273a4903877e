"""Reading datasets: Parquet, CSV and Arrow IPC files or directories on any pyarrow filesystem
(local paths, file://, s3://, gs://, hdfs://), in-memory numpy / pandas / Arrow, and the builtins.

Rows become one float32 feature vector (numeric columns and fixed-size-list columns,
concatenated; optionally reshaped by data.feature_shape), an int64 label and an int64 row id.
Every problem is a ConfigError naming the field or file, raised before anything starts.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs

from orchestrator.data import Dataset, Split, load_source
from orchestrator.errors import ConfigError
from orchestrator.checks import bounded, one_line

LIST_TIMEOUT_S = 60.0  # resolving and listing a source (remote stores retry on their own)
FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".arrow": "ipc", ".ipc": "ipc",
           ".feather": "ipc"}


def _filesystem(source: str, field: str = "data.source") -> tuple[pafs.FileSystem, str]:
    if "://" not in source:
        return pafs.LocalFileSystem(), os.path.abspath(source)
    try:
        return bounded(lambda: pafs.FileSystem.from_uri(source), LIST_TIMEOUT_S, f"opening {source}")
    except Exception as exc:
        raise ConfigError(f"config error: {field}: cannot open {source} ({one_line(exc)})") from None


def _list(fs: pafs.FileSystem, path: str, field: str, source: str) -> list[str]:
    """The data files at `path` (itself, if a file); the same one-line error for a path that is
    missing and for a store that cannot be listed (unreachable, no permission, timed out)."""
    def listing() -> Optional[list[str]]:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            return None
        if info.type == pafs.FileType.File:
            return [path]
        return [f.path for f in fs.get_file_info(pafs.FileSelector(path, recursive=True))
                if f.type == pafs.FileType.File and not os.path.basename(f.path).startswith((".", "_"))]

    try:
        names = bounded(listing, LIST_TIMEOUT_S, f"listing {source}")
    except Exception as exc:
        raise ConfigError(f"config error: {field}: cannot list {source} ({one_line(exc)})") from None
    if names is None:
        raise ConfigError(f"config error: {field}: no such file or directory: {source}")
    return names


def _format_of(fs: pafs.FileSystem, path: str, field: str, source: str) -> str:
    names = _list(fs, path, field, source)
    exts = {os.path.splitext(n.removesuffix(".gz"))[1].lower() for n in names}
    known = {FORMATS[e] for e in exts if e in FORMATS}
    if len(known) != 1:
        found = ", ".join(sorted(exts)) or "no files"
        raise ConfigError(f"config error: {field}: {source} holds {found}; expected one of parquet, csv, arrow")
    return known.pop()


def read_table(source: str, field: str = "data.source") -> pa.Table:
    """A whole file or directory as one Arrow table (pyarrow.dataset, any pyarrow filesystem)."""
    fs, path = _filesystem(source, field)
    fmt = _format_of(fs, path, field, source)
    try:
        return pads.dataset(path, filesystem=fs, format=fmt).to_table()
    except Exception as exc:
        raise ConfigError(f"config error: {field}: cannot read {source} as {fmt} ({exc})") from None


def table_from_memory(data: Any) -> pa.Table:
    """numpy (x, y) pairs, dicts of columns, pandas DataFrames and Arrow tables."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, tuple) and len(data) == 2:
        x, y = (np.asarray(a) for a in data)
        if len(x) != len(y):
            raise ConfigError(f"config error: data: {len(x)} feature rows but {len(y)} labels")
        flat = x.reshape(len(x), -1).astype(np.float32)
        features = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1]) if len(x) else pa.array([], pa.list_(pa.float32(), 1))
        table = pa.table({"features": features, "label": pa.array(y)})
        return table.replace_schema_metadata({b"feature_shape": ",".join(map(str, x.shape[1:])).encode()})
    if isinstance(data, dict):
        return pa.table(data)
    if hasattr(data, "to_numpy") and hasattr(data, "columns"):  # a pandas DataFrame
        return pa.Table.from_pandas(data, preserve_index=False)
    raise ConfigError(f"config error: data: unsupported in-memory data {type(data).__name__}; "
                      "pass (x, y) arrays, a dict of columns, a pandas DataFrame or a pyarrow Table")


def _column_matrix(table: pa.Table, name: str) -> np.ndarray:
    col = table.column(name).combine_chunks()
    t = col.type
    if pa.types.is_fixed_size_list(t) and (pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)):
        return col.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(col), t.list_size)
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        if col.null_count:
            raise ConfigError(f"config error: data.feature_columns: column {name!r} has {col.null_count} missing values")
        return col.to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, 1)
    raise ConfigError(f"config error: data.feature_columns: column {name!r} is {t}, not numeric")


def table_to_split(table: pa.Table, label_column: str, feature_columns: Optional[list[str]],
                   feature_shape: Optional[list[int]], id_column: Optional[str], source: str) -> Split:
    if table.num_rows == 0:
        raise ConfigError(f"config error: data.source: {source} has no rows")
    names = table.column_names
    if label_column not in names:
        raise ConfigError(f"config error: data.label_column: no column {label_column!r} in {source} (columns: {', '.join(names)})")
    if id_column is not None and id_column not in names:
        raise ConfigError(f"config error: data.id_column: no column {id_column!r} in {source}")
    features = feature_columns or [n for n in names if n not in (label_column, id_column)]
    for name in features:
        if name not in names:
            raise ConfigError(f"config error: data.feature_columns: no column {name!r} in {source}")
    if not features:
        raise ConfigError(f"config error: data.feature_columns: {source} has no feature columns")
    x = np.ascontiguousarray(np.hstack([_column_matrix(table, n) for n in features]))
    labels = table.column(label_column)
    if not pa.types.is_integer(labels.type):
        raise ConfigError(f"config error: data.label_column: {label_column!r} is {labels.type}; labels must be integer class ids")
    y = labels.to_numpy(zero_copy_only=False).astype(np.int64)
    if y.min() < 0:
        raise ConfigError(f"config error: data.label_column: {label_column!r} has negative class ids")
    ids = (table.column(id_column).to_numpy(zero_copy_only=False).astype(np.int64) if id_column
           else np.arange(len(y), dtype=np.int64))
    shape = feature_shape
    if shape is None and table.schema.metadata and b"feature_shape" in table.schema.metadata:
        shape = [int(s) for s in table.schema.metadata[b"feature_shape"].decode().split(",") if s]
    if shape:
        if int(np.prod(shape)) != x.shape[1]:
            raise ConfigError(f"config error: data.feature_shape: {list(shape)} holds {int(np.prod(shape))} values "
                              f"but rows have {x.shape[1]} features")
        x = x.reshape(len(x), *shape)
    return Split(x, y, ids)


def load_dataset(data_cfg, in_memory: Any = None) -> Dataset:
    """The train and test splits for a job (see DataConfig for the fields)."""
    source = data_cfg.source
    if in_memory is None and source.startswith("builtin:"):
        return load_source(source, data_cfg.seed)
    table = table_from_memory(in_memory) if in_memory is not None else read_table(source)
    label = "label" if in_memory is not None and isinstance(in_memory, tuple) else data_cfg.label_column
    args = (label, data_cfg.feature_columns, data_cfg.feature_shape, data_cfg.id_column)
    whole = table_to_split(table, *args, source="in-memory data" if in_memory is not None else source)
    if data_cfg.test_source:
        test = table_to_split(read_table(data_cfg.test_source, "data.test_source"), *args, source=data_cfg.test_source)
        train = whole
        if test.x.shape[1:] != train.x.shape[1:]:
            raise ConfigError(f"config error: data.test_source: {data_cfg.test_source} rows have features of shape "
                              f"{list(test.x.shape[1:])}, the train data {list(train.x.shape[1:])}")
    else:
        order = np.random.default_rng(data_cfg.seed).permutation(len(whole))
        n_test = int(round(len(whole) * data_cfg.test_fraction))
        if n_test < 1 or n_test >= len(whole):
            raise ConfigError(f"config error: data.test_fraction: {data_cfg.test_fraction} of {len(whole)} rows "
                              "leaves an empty train or test split")
        test, train = whole.take(order[:n_test]), whole.take(order[n_test:])
    classes = int(max(train.y.max(), test.y.max())) + 1
    return Dataset(os.path.basename(source.rstrip("/")) or source, train, test, classes)
