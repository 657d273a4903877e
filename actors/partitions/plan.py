"""What a reader is sent: a file source (or a torch Dataset) planned on the driver as blocks of
global positions (`StreamPlan`), no rows in it; and the error a read raises. The reading
itself is actors/partitions/reading.py (files) and actors/partitions/items.py (a torch Dataset)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import pyarrow as pa

from actors.partitions.decoding import DecodeSpec


class SourceReadError(RuntimeError):
    """A file of the source could not be read or decoded; the message names the file."""


@dataclass(frozen=True)
class Block:
    """The unit of reading: a Parquet row group (`row_group` its index), or a whole file."""

    path: str
    row_group: Optional[int]
    start: int  # global position of its first row
    rows: int


@dataclass(frozen=True)
class StreamPlan:
    """A file source planned on the driver, sent to every reader (small: no rows in it).

    `keep`: which rows of a range belong to this plan: "train" (hash >= test_fraction, and not
    validation), "test" (hash < test_fraction), "val" (not test, and a second hash <
    val_fraction) or "all" (a separate test source, or no split). `split_test` False: the
    source holds no test rows (a separate test source) and only the validation rows are held
    out. `ranges`: [start, stop) positions, the train partitions (or the test pieces); `rows`:
    the kept rows of each."""

    source: str  # as configured: named in errors
    field: str  # data.source or data.test_source
    fmt: str  # parquet, csv, ipc
    schema: pa.Schema
    blocks: tuple[Block, ...]
    spec: DecodeSpec
    keep: str
    test_fraction: float
    seed: int
    ranges: tuple[tuple[int, int], ...] = ()
    rows: tuple[int, ...] = ()
    piece_rows: int = 65536  # evaluation reads at most this many positions at a time
    items: Any = None  # a torch Dataset source (fmt "torch"): its actors.partitions.items.ItemSource, read by index
    val_fraction: float = 0.0  # data.val_fraction: the share of the non-test rows held out for validation
    split_test: bool = True

    @property
    def total(self) -> int:
        return self.blocks[-1].start + self.blocks[-1].rows if self.blocks else 0

    def files(self, lo: int, hi: int) -> list[str]:
        return list(dict.fromkeys(b.path for b in overlapping(self.blocks, lo, hi)))


def overlapping(blocks: tuple[Block, ...], lo: int, hi: int) -> list[Block]:
    """The blocks holding any position in [lo, hi): only these are opened."""
    starts = np.fromiter((b.start for b in blocks), dtype=np.int64, count=len(blocks))
    first = max(int(np.searchsorted(starts, lo, side="right")) - 1, 0)
    out = []
    for b in blocks[first:]:
        if b.start >= hi:
            break
        if b.start + b.rows > lo and b.rows:
            out.append(b)
    return out
