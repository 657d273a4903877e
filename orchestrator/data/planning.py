"""Planning a file source from its metadata: the driver never holds its rows.

A file source (a Parquet, CSV or Arrow IPC file or directory, on any pyarrow filesystem) is
listed, its files put in a fixed order (sorted paths) and cut into blocks: a Parquet row group
(row counts and sizes from the footers), or a whole CSV / IPC file (rows counted by streaming
it once: those formats keep no row counts). Every row then has a global position, and:

- the test split (no data.test_source) is the rows whose position hashes below
  data.test_fraction with data.seed (actors/partitions/reading.py `held_out_mask`): chosen without reading a
  row, each partition read drops its test rows and evaluation keeps only them;
- the train partitions are contiguous position ranges holding near-equal numbers of train
  rows, P of them: data.partitions, else max(4 x scaling.replicas, enough that each is at most
  ~PARTITION_BYTES of the source, estimated from Parquet's uncompressed row-group sizes or the
  file sizes); partitions are leased in a shuffled order each epoch and their rows shuffled
  within (a local shuffle: rows of one partition stay together in an epoch);
- the test rows are cut into pieces of at most ~EVAL_PIECE_BYTES of source rows, dealt to the
  replicas as contiguous runs (actors/partitions/reading.py `eval_shares`).

Up front (ConfigError, one line): the source lists, the columns exist (schema only), the
decoder loads, and the first rows decode (`sample`, also the model check's input and the
spares' rehearsal batch). Each blocking step has a timeout.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from actors.partitions.decoding import DecodeError, check_schema, load_decoder
from actors.partitions.reading import Block, SourceReadError, StreamPlan, count_kept, cut_ranges, read_range
from orchestrator.checks import bounded, one_line
from orchestrator.data.in_memory import Split
from orchestrator.errors import ConfigError
from orchestrator.data.sources import check_column_names, decode_spec, open_source

PLAN_TIMEOUT_S = 300.0  # footers of every file, and counting a CSV's rows (remote stores retry on their own)
PARTITION_BYTES = 64 << 20  # the default partition count keeps each partition at most about this big
EVAL_PIECE_BYTES = 16 << 20  # evaluation reads about this much of the source at a time
SAMPLE_ROWS = 64  # rows decoded on the driver to check the decoder and the model


@dataclass(frozen=True)
class StreamedDataset:
    """A planned file source: the train and test plans and a decoded sample; no rows."""

    name: str
    train_plan: StreamPlan
    test_plan: StreamPlan
    sample: Split  # the source's first rows, decoded on the driver
    num_classes: int  # integer single-column targets: max id + 1 (Parquet statistics, else the sample); else 0
    val_plan: Optional[StreamPlan] = None  # data.val_fraction's rows, cut into evaluation pieces

    @property
    def val_rows(self) -> int:
        return sum(self.val_plan.rows) if self.val_plan is not None else 0

    @property
    def train_rows(self) -> int:
        return sum(self.train_plan.rows)

    @property
    def test_rows(self) -> int:
        return sum(self.test_plan.rows)

    def example(self, rows: int) -> Split:
        return self.sample.take(np.arange(min(rows, len(self.sample))))


def _blocks(fs: Any, files: list[str], fmt: str) -> tuple[pa.Schema, list[Block], int, list]:
    """(schema, blocks, estimated bytes, per-file Parquet metadata) from metadata alone."""
    blocks, at, size = [], 0, 0
    metas = []
    if fmt == "parquet":
        schema = pq.ParquetFile(fs.open_input_file(files[0])).schema_arrow
        for path in files:
            meta = pq.ParquetFile(fs.open_input_file(path)).metadata
            metas.append(meta)
            for g in range(meta.num_row_groups):
                rg = meta.row_group(g)
                blocks.append(Block(path, g, at, rg.num_rows))
                at += rg.num_rows
                size += rg.total_byte_size
        return schema, blocks, size, metas
    dataset = pads.dataset(files, filesystem=fs, format=fmt)
    for frag in dataset.get_fragments():
        rows = frag.count_rows()
        blocks.append(Block(frag.path, None, at, rows))
        at += rows
        size += fs.get_file_info(frag.path).size or 0
    return dataset.schema, blocks, size, metas


def label_range(metas: list, label: str) -> Optional[tuple[int, int]]:
    """(min, max) of an integer label column from Parquet row-group statistics, or None when
    some row group has none."""
    lo, hi = None, None
    for meta in metas:
        idx = [i for i in range(meta.num_columns) if meta.schema.column(i).path == label]
        if not idx:
            return None
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(idx[0]).statistics
            if stats is None or not stats.has_min_max or not isinstance(stats.min, (int, np.integer)):
                return None
            lo = stats.min if lo is None else min(lo, stats.min)
            hi = stats.max if hi is None else max(hi, stats.max)
    return None if lo is None else (int(lo), int(hi))


def plan_source(source: str, field: str, data_cfg: Any, task: Any, keep: str) -> tuple[StreamPlan, Any, int]:
    """A source's plan with no ranges yet, its Parquet metadata, and its estimated bytes."""
    fs, files, fmt = open_source(source, field)
    try:
        schema, blocks, size, metas = bounded(lambda: _blocks(fs, sorted(files), fmt), PLAN_TIMEOUT_S,
                                              f"reading the metadata of {source}")
    except Exception as exc:
        raise ConfigError(f"config error: {field}: cannot read {source} as {fmt} ({one_line(exc)})") from None
    if not blocks or blocks[-1].start + blocks[-1].rows == 0:
        raise ConfigError(f"config error: {field}: {source} has no rows")
    check_column_names(schema, field, source)
    spec = decode_spec(data_cfg, schema, task)
    try:
        check_schema(schema, spec, source)
        if spec.decode is not None:
            load_decoder(spec.decode)
    except DecodeError as exc:
        raise ConfigError(f"config error: {exc}") from None
    plan = StreamPlan(source, field, fmt, schema, tuple(blocks), spec, keep, data_cfg.test_fraction, data_cfg.seed)
    return plan, metas, size


def sample_of(plan: StreamPlan, rows: int = SAMPLE_ROWS) -> Split:
    """The plan's first rows (whichever split they are in), decoded here: the up-front check."""
    whole = dataclasses.replace(plan, keep="all")
    try:
        part = bounded(lambda: read_range(whole, 0, min(rows, whole.total)), PLAN_TIMEOUT_S, f"reading {plan.source}")
    except (SourceReadError, TimeoutError) as exc:
        raise ConfigError(f"config error: {one_line(exc)}") from None
    sample = Split(*(np.array(part[k], copy=True) if isinstance(part[k], np.ndarray) else part[k]
                     for k in ("x", "y", "ids")))  # copies: the Arrow buffers can go
    pa.default_memory_pool().release_unused()  # the driver keeps nothing of the read
    return sample


def default_partitions(replicas: int, train_rows: int, total_rows: int, size: int) -> int:
    """max(4 x replicas, enough partitions of at most ~PARTITION_BYTES): the bytes of the train
    rows estimated as their share of the source's size."""
    train_bytes = size * train_rows / max(total_rows, 1)
    return max(4 * replicas, int(np.ceil(train_bytes / PARTITION_BYTES)))


def piece_ranges(plan: StreamPlan, size: int) -> StreamPlan:
    """The test plan cut into evaluation pieces of ~EVAL_PIECE_BYTES of source rows each, with
    the test rows each holds."""
    piece = max(1, int(EVAL_PIECE_BYTES * plan.total / max(size, 1)))
    ranges = [(a, min(a + piece, plan.total)) for a in range(0, plan.total, piece)]
    rows = [count_kept(plan, lo, hi) for lo, hi in ranges]
    return dataclasses.replace(plan, ranges=tuple(ranges), rows=tuple(rows), piece_rows=piece)


def classes_of(plan: StreamPlan, metas: list, sample: Split) -> int:
    """Integer class-id targets in one column: max id + 1 from Parquet statistics (every row
    group's), else from the sample; 0 for other targets. Negative ids in the statistics are a
    ConfigError now rather than a replica's error later."""
    spec = plan.spec
    if spec.decode is not None or len(spec.label_columns) != 1 or spec.label_is_list:
        y = sample.y
        return int(y.max()) + 1 if isinstance(y, np.ndarray) and y.ndim == 1 and y.dtype.kind in "iu" and len(y) else 0
    if not np.issubdtype(np.dtype(spec.target_dtype), np.integer):
        return 0
    seen = label_range(metas, spec.label_columns[0]) if plan.fmt == "parquet" else None
    if seen is not None and seen[0] < 0:
        raise ConfigError(f"config error: data.label_column: {spec.label_columns[0]!r} has negative class ids")
    top = seen[1] if seen is not None else int(np.max(sample.y)) if np.ndim(sample.y) == 1 else -1
    return top + 1


def plan_file_dataset(data_cfg: Any, task: Any, replicas: int) -> StreamedDataset:
    """The train and test plans of a file source (see the module docstring); ConfigError on bad input."""
    source = data_cfg.source
    train, metas, size = plan_source(source, "data.source", data_cfg, task, keep="all" if data_cfg.test_source else "train")
    sample = sample_of(train)
    if data_cfg.test_source:
        test, test_size = separate_source(data_cfg, task, "test_source", sample)
    else:
        test, test_size = dataclasses.replace(train, keep="test"), size
    val = None
    if data_cfg.val_source:
        val = piece_ranges(*separate_source(data_cfg, task, "val_source", sample))
    elif data_cfg.val_fraction > 0:  # held out of the train rows by a hash of their own
        train = dataclasses.replace(train, keep="train", split_test=not data_cfg.test_source,
                                    val_fraction=data_cfg.val_fraction)
        val = dataclasses.replace(train, keep="val")
    train_rows = count_kept(train, 0, train.total)
    test_rows = count_kept(test, 0, test.total)
    if train_rows < 1 or test_rows < 1:
        raise ConfigError(f"config error: data.test_fraction: {data_cfg.test_fraction} of {train.total} rows "
                          "leaves an empty train or test split")
    if val is not None and data_cfg.val_fraction > 0:
        val = piece_ranges(val, size)
        if sum(val.rows) < 1:
            raise ConfigError(f"config error: data.val_fraction: {data_cfg.val_fraction} of {train_rows} train rows "
                              "leaves an empty validation split")
    parts = data_cfg.partitions or default_partitions(replicas, train_rows, train.total, size)
    if parts > train_rows:
        raise ConfigError(f"config error: data.partitions: {parts} partitions for {train_rows} train rows")
    ranges, rows = cut_ranges(train, parts)
    train = dataclasses.replace(train, ranges=tuple(ranges), rows=tuple(rows))
    name = os.path.basename(source.rstrip("/")) or source
    return StreamedDataset(name, train, piece_ranges(test, test_size), sample, classes_of(train, metas, sample), val)


def separate_source(data_cfg: Any, task: Any, name: str, sample: Split) -> tuple[StreamPlan, int]:
    """data.test_source or data.val_source: its whole plan and estimated bytes, its rows
    checked to decode to the train data's input shapes."""
    spec = getattr(data_cfg, name)
    plan, _, size = plan_source(spec, f"data.{name}", data_cfg, task, keep="all")
    got = sample_of(plan, 2)
    if _shapes(got.x) != _shapes(sample.x):
        raise ConfigError(f"config error: data.{name}: {spec} rows decode to inputs of shape "
                          f"{_shapes(got.x)}, the train data's {_shapes(sample.x)}")
    return plan, size


def _shapes(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: list(v.shape[1:]) for k, v in tree.items()}
    return list(tree.shape[1:])
