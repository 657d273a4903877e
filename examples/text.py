"""A `data.decode` function for examples/tiny_lm.yaml: rows of bytes -> next-token pairs.

Each row's `text` holds CONTEXT + 1 bytes (examples/datasets.py): the model reads the first
CONTEXT as token ids (one byte, one token: a character-level model over ASCII, vocabulary 128)
and learns to predict each following byte. The function gets a pyarrow Table of rows (a
partition may span files and row groups) and returns (inputs, targets) with those rows as the
first dimension.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa


def decode(batch: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    column = batch.column("text")
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if len(column) == 0:
        return np.zeros((0, 0), np.int64), np.zeros((0, 0), np.int64)
    # a binary column is one buffer of bytes plus offsets: equal-length rows reshape without a loop
    offsets = np.frombuffer(column.buffers()[1], np.int32)[column.offset : column.offset + len(column) + 1]
    width = int(offsets[1] - offsets[0])
    values = np.frombuffer(column.buffers()[2], np.uint8)[offsets[0] : offsets[-1]]
    tokens = values.reshape(len(column), width).astype(np.int64)
    return tokens[:, :-1], tokens[:, 1:]
