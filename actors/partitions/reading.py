"""Reading a planned file source where its rows are consumed (the worker side of streaming).

The driver plans a file source from metadata alone (orchestrator/data/planning.py): the files in a
fixed order, their blocks (a Parquet row group, or a whole CSV / Arrow IPC file) with row
counts, so every row has a *global position*. A partition is a contiguous range of positions;
the test split, when not a separate source, is the rows whose position hashes below
data.test_fraction (`held_out_mask`), so the split needs no pass over the data.

A replica's PartitionReader, granted a partition, runs `read_partition_task` on its own node:
it reads just the blocks that overlap the range (Parquet: only those row groups, a partly
covered one in slices), keeps the rows of its split, decodes them (actors/partitions/decoding.py) and
returns {"x", "y", "ids"} into the node's object store. Evaluation reads its share of the test
rows a piece at a time in the replica (`read_range`). A file that cannot be read is a
`SourceReadError` naming the file.

A map-style torch Dataset is planned the same way (fmt "torch"): its positions index a list of
dataset indices, and `read_range` reads them by calling the dataset (actors/partitions/items.py), so the
partitions, their read tasks and evaluation pieces are the same for both.
"""
from __future__ import annotations

import os
from typing import Any, Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray

from actors.partitions.decoding import DecodeError, decode
from actors.partitions.plan import Block, SourceReadError, StreamPlan, overlapping  # noqa: F401 (read from here too)

SLICE_ROWS = 8192  # rows are read in slices of this many (the rows of other splits dropped per slice)
HASH_CHUNK_ROWS = 1 << 22  # positions hashed at a time when counting or cutting (~64 MB of scratch)


# ---- the split: a hash of the row's position --------------------------------------------------
_M = np.uint64(0xFFFFFFFFFFFFFFFF)


def held_out_mask(positions: np.ndarray, seed: int, fraction: float) -> np.ndarray:
    """True where a row is a test row: splitmix64(position, seed) as a uniform number in [0, 1)
    below `fraction`. Deterministic, independent per row, computed by anyone from the position."""
    mix = np.uint64((int(seed) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        z = positions.astype(np.uint64) + mix
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)) < fraction


VAL_SEED = 0x7A1  # the validation hash is its own: the same test rows with or without a validation split


def kept(plan: StreamPlan, positions: np.ndarray) -> np.ndarray:
    if plan.keep == "all":
        return np.ones(len(positions), dtype=bool)
    test = (held_out_mask(positions, plan.seed, plan.test_fraction) if plan.split_test
            else np.zeros(len(positions), dtype=bool))
    if plan.keep == "test":
        return test
    val = (held_out_mask(positions, plan.seed + VAL_SEED, plan.val_fraction) if plan.val_fraction > 0
           else np.zeros(len(positions), dtype=bool))
    return ~test & (val if plan.keep == "val" else ~val)


def count_kept(plan: StreamPlan, lo: int, hi: int) -> int:
    if plan.keep == "all":
        return hi - lo
    return sum(int(kept(plan, np.arange(a, min(a + HASH_CHUNK_ROWS, hi))).sum()) for a in range(lo, hi, HASH_CHUNK_ROWS))


def cut_ranges(plan: StreamPlan, parts: int, lo: int = 0, hi: Optional[int] = None) -> tuple[list[tuple[int, int]], list[int]]:
    """[lo, hi) cut into `parts` contiguous ranges holding near-equal numbers of kept rows (the
    rows of other splits fall where they are): (ranges, kept rows of each). Hashes positions a
    chunk at a time, so memory does not grow with the source."""
    hi = plan.total if hi is None else hi
    total = count_kept(plan, lo, hi)
    targets = [total * i // parts for i in range(1, parts)]  # index of the first kept row of partition i
    starts, before, t = [lo], 0, 0
    for a in range(lo, hi, HASH_CHUNK_ROWS):
        if t == len(targets):
            break
        where = np.flatnonzero(kept(plan, np.arange(a, min(a + HASH_CHUNK_ROWS, hi))))
        while t < len(targets) and targets[t] < before + len(where):
            starts.append(a + int(where[targets[t] - before]))
            t += 1
        before += len(where)
    starts += [hi] * (parts - len(starts))  # fewer kept rows than parts: empty ranges at the end
    bounds = [0, *targets, total]
    return [(starts[i], starts[i + 1] if i + 1 < parts else hi) for i in range(parts)], \
        [bounds[i + 1] - bounds[i] for i in range(parts)]


# ---- reading ---------------------------------------------------------------------------------
def filesystem(source: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem of a path or URI (file://, s3://, gs://, hdfs://) and the path in it."""
    if "://" not in source:
        return pafs.LocalFileSystem(), os.path.abspath(source)
    return pafs.FileSystem.from_uri(source)


def _block_slices(fs: pafs.FileSystem, plan: StreamPlan, block: Block, lo: int, hi: int,
                  columns: Optional[list[str]]) -> Iterator[pa.RecordBatch]:
    """The rows [lo, hi) ∩ block, in slices of at most SLICE_ROWS rows. Parquet is read as a
    buffered stream (not whole column chunks at once), so a few rows of a big row group cost
    a few pages of memory, not the row group."""
    a, b = max(lo, block.start) - block.start, min(hi, block.start + block.rows) - block.start
    size = max(1, min(SLICE_ROWS, b - a))
    if plan.fmt == "parquet":
        pf = pq.ParquetFile(fs.open_input_file(block.path), pre_buffer=False, buffer_size=1 << 20)
        batches = pf.iter_batches(batch_size=size, row_groups=[block.row_group], columns=columns)
    else:  # a CSV or IPC file streams from its start; no more than the range's end is read
        import pyarrow.dataset as pads  # here: it imports pandas (~0.3 s), which a replica reading parquet never needs

        batches = pads.dataset(block.path, filesystem=fs, format=plan.fmt, schema=plan.schema).to_batches(columns=columns)
    at = 0
    for batch in batches:
        if at + batch.num_rows > a:
            yield batch.slice(max(a - at, 0), min(b, at + batch.num_rows) - max(a, at))
        at += batch.num_rows
        if at >= b:  # stop before the next slice is decoded
            break


def read_rows(plan: StreamPlan, lo: int, hi: int) -> tuple[pa.Table, np.ndarray]:
    """The kept rows among positions [lo, hi) as a Table, and their positions. Rows of other
    splits are dropped slice by slice, so the whole range is never held at once."""
    fs, _ = filesystem(plan.source)
    columns = plan.spec.columns()
    schema = plan.schema if columns is None else pa.schema([plan.schema.field(c) for c in columns])
    pieces: list[pa.Table] = []
    positions: list[np.ndarray] = []
    at = lo
    for block in overlapping(plan.blocks, lo, hi):
        try:
            for piece in _block_slices(fs, plan, block, lo, hi, columns):
                where = np.arange(at, at + piece.num_rows, dtype=np.int64)
                at += piece.num_rows
                mask = kept(plan, where)
                piece = pa.Table.from_batches([piece]).cast(schema)
                pieces.append(piece if mask.all() else piece.filter(pa.array(mask)))
                positions.append(where[mask])
        except Exception as exc:
            raise SourceReadError(f"{plan.field}: cannot read {block.path} (rows {lo}-{hi} of {plan.source}): "
                                  f"{type(exc).__name__}: {' '.join(str(exc).split())}") from None
    if at != hi:
        raise SourceReadError(f"{plan.field}: {', '.join(plan.files(lo, hi))} held {at - lo} rows where the plan "
                              f"counted {hi - lo} (rows {lo}-{hi}): the source changed after planning")
    table = pa.concat_tables(pieces) if pieces else schema.empty_table()
    return table, np.concatenate(positions) if positions else np.zeros(0, np.int64)


def decode_rows(plan: StreamPlan, table: pa.Table, positions: np.ndarray, lo: int, hi: int) -> dict[str, Any]:
    """{"x", "y", "ids"} of rows read by `read_rows`; ids from data.id_column, else positions."""
    try:
        x, y = decode(table, plan.spec)
    except DecodeError as exc:
        raise SourceReadError(f"{exc} (in {', '.join(plan.files(lo, hi))}, rows {lo}-{hi})") from None
    ids = positions
    if plan.spec.id_column is not None:
        ids = table.column(plan.spec.id_column).to_numpy(zero_copy_only=False).astype(np.int64)
    return {"x": x, "y": y, "ids": ids}


def read_range(plan: StreamPlan, lo: int, hi: int) -> dict[str, Any]:
    """{"x", "y", "ids"} of the kept rows among positions [lo, hi): read from the files, or for
    a torch Dataset plan indexed in the dataset (actors/partitions/items.py)."""
    if plan.items is not None:
        from actors.partitions.items import read_items  # imports torch, which a file source's read task does without

        return read_items(plan, lo, hi)
    table, positions = read_rows(plan, lo, hi)
    return decode_rows(plan, table, positions, lo, hi)


def read_partition(plan: StreamPlan, partition: int) -> dict[str, Any]:
    lo, hi = plan.ranges[partition]
    return read_range(plan, lo, hi)


@ray.remote(num_cpus=0, max_retries=0)
def read_partition_task(plan: StreamPlan, partition: int) -> dict[str, Any]:
    """A partition read on the node that consumes it (the caller pins it there): the result
    lands in that node's object store. No retries: a bad file fails the same way again."""
    return read_partition(plan, partition)


def eval_pieces(plan: StreamPlan, ranges: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """`ranges` cut into pieces of at most plan.piece_rows positions (evaluation's memory bound)."""
    for lo, hi in ranges:
        for a in range(lo, hi, plan.piece_rows):
            yield a, min(a + plan.piece_rows, hi)


def eval_shares(plan: StreamPlan, members: int) -> list[list[tuple[int, int]]]:
    """The test plan's pieces (plan.ranges, plan.rows kept rows each) dealt to `members`
    replicas as contiguous runs holding near-equal numbers of test rows: each replica's list
    of position ranges to evaluate."""
    counts = np.cumsum(np.asarray(plan.rows, dtype=np.int64))
    total = int(counts[-1]) if len(counts) else 0
    cuts = [0, *(int(np.searchsorted(counts, total * i / members, side="left")) + 1 for i in range(1, members)),
            len(plan.ranges)]
    cuts = [min(max(c, 0), len(plan.ranges)) for c in cuts]
    for i in range(1, len(cuts)):
        cuts[i] = max(cuts[i], cuts[i - 1])
    return [list(plan.ranges[cuts[i]:cuts[i + 1]]) for i in range(members)]
