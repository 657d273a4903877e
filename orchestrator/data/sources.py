"""Datasets for a job: Parquet, CSV and Arrow IPC files or directories on any pyarrow filesystem
(local paths, file://, s3://, gs://, hdfs://), in-memory numpy / pandas / Arrow, and the builtins.

A file source is only listed and planned here (orchestrator/data/planning.py): its rows are read
where they are consumed (actors/partitions/reading.py). In-memory data is decoded on the driver by the
same decoder the readers use (actors/partitions/decoding.py: the builtin one, or data.decode) into
(inputs, targets) and int64 row ids. Every problem is a ConfigError naming the field or file,
raised before anything starts.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs

from actors.partitions.decoding import DecodeError, DecodeSpec, check_schema, decode
from orchestrator.data.in_memory import Split
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


def open_source(source: str, field: str = "data.source") -> tuple[pafs.FileSystem, list[str], str]:
    """A source's filesystem, its data files and their format (parquet, csv, ipc); ConfigError
    when it cannot be opened or listed, or holds no one known format."""
    fs, path = _filesystem(source, field)
    fmt = _format_of(fs, path, field, source)
    return fs, _list(fs, path, field, source), fmt


def read_table(source: str, field: str = "data.source") -> pa.Table:
    """A whole file or directory as one Arrow table (pyarrow.dataset, any pyarrow filesystem)."""
    fs, path = _filesystem(source, field)
    fmt = _format_of(fs, path, field, source)
    try:
        table = pads.dataset(path, filesystem=fs, format=fmt).to_table()
    except Exception as exc:
        raise ConfigError(f"config error: {field}: cannot read {source} as {fmt} ({one_line(exc)})") from None
    check_column_names(table.schema, field, source)
    return table


def check_column_names(schema: pa.Schema, field: str, source: str) -> None:
    """Every column name is UTF-8 text (a CSV header in another encoding is not); ConfigError
    naming the file otherwise (pyarrow raises UnicodeDecodeError on the first look at the names)."""
    try:
        schema.names
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config error: {field}: {source} has a column name that is not UTF-8 text "
                          f"({exc.reason}: byte 0x{exc.object[exc.start]:02x})") from None


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
                      "pass (x, y) arrays, a dict of columns, a pandas DataFrame, a pyarrow Table, a map-style "
                      "torch.utils.data.Dataset or a Hugging Face datasets.Dataset")


def decode_spec(data_cfg: Any, schema: pa.Schema, task: Any) -> DecodeSpec:
    """The data config resolved against a schema: which columns, what shape, which dtypes."""
    labels = [data_cfg.label_column] if isinstance(data_cfg.label_column, str) else list(data_cfg.label_column)
    features = data_cfg.feature_columns or [n for n in schema.names if n not in labels and n != data_cfg.id_column]
    shape = data_cfg.feature_shape
    if shape is None and schema.metadata and b"feature_shape" in schema.metadata:
        shape = [int(s) for s in schema.metadata[b"feature_shape"].decode().split(",") if s]
    return DecodeSpec(tuple(labels), not isinstance(data_cfg.label_column, str), tuple(features),
                      tuple(shape) if shape else None, data_cfg.id_column,
                      getattr(task, "input_dtype", "float32"), getattr(task, "target_dtype", "int64"),
                      getattr(data_cfg, "decode", None))


def table_to_split(table: pa.Table, spec: DecodeSpec, source: str) -> Split:
    """An in-memory table decoded on the driver (actors/partitions/decoding.py: the builtin decoder, or
    data.decode); row ids from data.id_column or the row number."""
    if table.num_rows == 0:
        raise ConfigError(f"config error: data.source: {source} has no rows")
    try:
        check_schema(table.schema, spec, source)
        x, y = decode(table, spec)
    except DecodeError as exc:
        raise ConfigError(f"config error: {exc}") from None
    ids = (table.column(spec.id_column).to_numpy(zero_copy_only=False).astype(np.int64) if spec.id_column
           else np.arange(table.num_rows, dtype=np.int64))
    return Split(x, y, ids)


def classes_of(*splits: Split) -> int:
    """max class id + 1 for integer class-id targets (one per row); 0 for other targets."""
    ys = [s.y for s in splits]
    if not all(isinstance(y, np.ndarray) and y.ndim == 1 and y.dtype.kind in "iu" and len(y) for y in ys):
        return 0
    return int(max(y.max() for y in ys)) + 1
