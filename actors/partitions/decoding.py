"""Decoding: a `pyarrow.Table` of rows -> (inputs, targets), each a tree (policies/rules/batches.py):
one numpy array, or a dict of arrays that share their first dimension (the rows).

Decoding runs where the rows are read: on the replica's node for streamed file sources (a read
task, actors/partitions/reading.py), on the driver for in-memory sources. So this module imports only
numpy, pyarrow and `policies` (actors never import the driver package).

- The builtin decoder (data.decode unset): numeric and fixed-size-list feature columns
  concatenated into one vector per row, reshaped by data.feature_shape (or the table's
  `feature_shape` schema metadata), cast to the task's `input_dtype`; targets from
  data.label_column (one name: [n], or [n, k] for a fixed-size-list column; a list of names:
  [n, k]) cast to the task's `target_dtype`. Class ids (integer targets, one per row) must not be
  negative; integer sequences (language-model targets) may hold negative padding ids.
- The user's decoder (data.decode: "module:function"): called with the Table (a partition may
  span several files and row groups, so a Table, not a RecordBatch); it returns (inputs,
  targets), numpy arrays or torch tensors or dicts of them, each with the Table's rows first.

Every problem is a `DecodeError` whose message starts with the config field it concerns; the
driver turns it into a ConfigError, a replica into a RuntimeError naming the file. torch is
imported only if a user's decoder returns tensors (a read task's process stays small).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import pyarrow as pa

from policies.rules.imports import NotImportable, import_function

Tree = Any  # one array, or a dict of arrays sharing their rows (policies/rules/batches.py; not imported:
# it imports torch, which a read task's process does not need)


def leaves(tree: Tree) -> list[Any]:
    return list(tree.values()) if isinstance(tree, dict) else [tree]


class DecodeError(ValueError):
    """Rows that cannot be decoded; the message starts with the config field concerned."""


@dataclass(frozen=True)
class DecodeSpec:
    """How rows become (inputs, targets): the data config's columns resolved against the
    schema on the driver (so every reader decodes the same way), and the task's dtypes."""

    label_columns: tuple[str, ...]
    label_is_list: bool  # data.label_column given as a list: targets are [n, k] even for k = 1
    feature_columns: tuple[str, ...]
    feature_shape: Optional[tuple[int, ...]]
    id_column: Optional[str]
    input_dtype: str = "float32"
    target_dtype: str = "int64"
    decode: Optional[str] = None  # "module:function", or None for the builtin decoder

    def columns(self) -> Optional[list[str]]:
        """The columns a reader needs (None: all of them, for the user's decoder)."""
        if self.decode is not None:
            return None
        wanted = [*self.feature_columns, *self.label_columns, *([self.id_column] if self.id_column else [])]
        return list(dict.fromkeys(wanted))


def column_matrix(table: pa.Table, name: str, dtype: str, field: str) -> np.ndarray:
    """One numeric or fixed-size-list column as an [n, k] array of `dtype` (no copy when the
    column already has that type and one chunk)."""
    col = table.column(name)
    col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    t = col.type
    if col.null_count:
        raise DecodeError(f"{field}: column {name!r} has {col.null_count} missing values")
    if pa.types.is_fixed_size_list(t) and (pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)):
        values = col.flatten().to_numpy(zero_copy_only=False)
        return values.astype(dtype, copy=False).reshape(len(col), t.list_size)
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return col.to_numpy(zero_copy_only=False).astype(dtype, copy=False).reshape(-1, 1)
    raise DecodeError(f"{field}: column {name!r} is {t}, not numeric")


def check_schema(schema: pa.Schema, spec: DecodeSpec, source: str) -> None:
    """What the builtin decoder needs of the columns, from the schema alone (no rows read)."""
    names = schema.names
    if spec.id_column is not None and spec.id_column not in names:
        raise DecodeError(f"data.id_column: no column {spec.id_column!r} in {source}")
    if spec.decode is not None:
        return
    for name in spec.label_columns:
        if name not in names:
            raise DecodeError(f"data.label_column: no column {name!r} in {source} (columns: {', '.join(names)})")
    if not spec.feature_columns:
        raise DecodeError(f"data.feature_columns: {source} has no feature columns")
    for name in spec.feature_columns:
        if name not in names:
            raise DecodeError(f"data.feature_columns: no column {name!r} in {source}")
        t = schema.field(name).type
        inner = t.value_type if pa.types.is_fixed_size_list(t) else t
        if not (pa.types.is_integer(inner) or pa.types.is_floating(inner) or pa.types.is_boolean(inner)):
            raise DecodeError(f"data.feature_columns: column {name!r} is {t}, not numeric")


def builtin_decode(table: pa.Table, spec: DecodeSpec) -> tuple[np.ndarray, np.ndarray]:
    """Today's rows -> (features, targets), with the task's dtypes (see the module docstring)."""
    mats = [column_matrix(table, n, spec.input_dtype, "data.feature_columns") for n in spec.feature_columns]
    x = mats[0] if len(mats) == 1 else np.hstack(mats)
    if spec.feature_shape:
        if int(np.prod(spec.feature_shape)) != x.shape[1]:
            raise DecodeError(f"data.feature_shape: {list(spec.feature_shape)} holds {int(np.prod(spec.feature_shape))} "
                              f"values but rows have {x.shape[1]} features")
        x = x.reshape(len(x), *spec.feature_shape)
    return x, decode_targets(table, spec)


def decode_targets(table: pa.Table, spec: DecodeSpec) -> np.ndarray:
    integer = np.issubdtype(np.dtype(spec.target_dtype), np.integer)
    for name in spec.label_columns:
        t = table.schema.field(name).type
        inner = t.value_type if pa.types.is_fixed_size_list(t) else t
        if integer and not pa.types.is_integer(inner):
            raise DecodeError(f"data.label_column: {name!r} is {t}; the task's targets are {spec.target_dtype} "
                              "(integer class ids)")
    mats = [column_matrix(table, n, spec.target_dtype, "data.label_column") for n in spec.label_columns]
    y = mats[0] if len(mats) == 1 else np.hstack(mats)
    if y.shape[1] == 1 and not spec.label_is_list:
        y = y.reshape(-1)
    if integer and y.ndim == 1 and len(y) and y.min() < 0:
        raise DecodeError(f"data.label_column: {spec.label_columns[0]!r} has negative class ids")
    return y


_DECODERS: dict[str, Callable[[pa.Table], Any]] = {}  # "module:function" -> the function, imported once per process


def load_decoder(name: str) -> Callable[[pa.Table], Any]:
    """The user's decode function; a DecodeError naming data.decode when it cannot be loaded."""
    if name in _DECODERS:
        return _DECODERS[name]
    module_name, sep, func_name = name.partition(":")
    if not sep or not module_name or not func_name:
        raise DecodeError(f"data.decode: must look like 'module:function', got {name!r}")
    try:
        fn = import_function(name)
    except NotImportable as exc:
        raise DecodeError(f"data.decode: {exc}") from None
    _DECODERS[name] = fn
    return fn


def decode(table: pa.Table, spec: DecodeSpec) -> tuple[Tree, Tree]:
    """(inputs, targets) of `table`'s rows by the spec's decoder, numpy leaves, rows checked."""
    if spec.decode is None:
        return builtin_decode(table, spec)
    fn = load_decoder(spec.decode)
    try:
        out = fn(table)
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(f"data.decode: {spec.decode} raised {type(exc).__name__}: {' '.join(str(exc).split())}") from None
    return check_decoded(out, table.num_rows, spec.decode)


def _as_numpy(leaf: Any, what: str, name: str) -> np.ndarray:
    if isinstance(leaf, np.ndarray):
        return leaf
    if type(leaf).__module__.startswith("torch") and hasattr(leaf, "numpy"):
        return leaf.detach().cpu().numpy()
    raise DecodeError(f"data.decode: {name} returned {what} of type {type(leaf).__name__}; expected a numpy array, "
                      "a torch tensor, or a dict of them")


def check_decoded(out: Any, rows: int, name: str) -> tuple[Tree, Tree]:
    """A decode function's output as numpy trees; a DecodeError naming data.decode when it is
    not (inputs, targets) of arrays/tensors (or dicts of them) that all hold `rows` rows."""
    if not isinstance(out, tuple) or len(out) != 2:
        raise DecodeError(f"data.decode: {name} returned {type(out).__name__}; expected a tuple (inputs, targets)")
    trees = []
    for what, tree in zip(("inputs", "targets"), out):
        if isinstance(tree, dict):
            if not tree:
                raise DecodeError(f"data.decode: {name} returned an empty dict as {what}")
            tree = {str(k): _as_numpy(v, f"{what}[{k!r}]", name) for k, v in tree.items()}
        else:
            tree = _as_numpy(tree, what, name)
        for leaf in leaves(tree):
            if leaf.ndim == 0 or leaf.shape[0] != rows:
                got = "a scalar" if leaf.ndim == 0 else f"{leaf.shape[0]} rows"
                raise DecodeError(f"data.decode: {name} returned {what} with {got} for a table of {rows} rows; "
                                  "every array needs the table's rows as its first dimension")
        trees.append(tree)
    return trees[0], trees[1]
