"""Reading a map-style torch Dataset where its rows are consumed: the worker side of a torch
Dataset source (`data.source: "module:function"`, or `ElasticTrainer(config, data=dataset)`).

The driver plans such a dataset like a file source (orchestrator/data/torch_data.py): a `StreamPlan`
(actors/partitions/reading.py) whose `items` is an `ItemSource`. A plan's *positions* index a list of
dataset indices (the seeded split and shuffle made on the driver), so a partition is a
contiguous range of positions, as for files, and the partition server, the leases and the
ledger deal in partition numbers exactly as they do for every other source. Reading positions
[lo, hi) (`read_items`, called by `reading.read_range`: in a partition's read task on the
replica's node, or in the replica for its evaluation pieces):

- the dataset comes from the object store, where the driver put it once (pickled: a dataset
  that opens its files lazily stays small); each process unpickles it once and keeps it
  (`resolve_dataset`, the last few datasets);
- `dataset[i]` is called for each position's index, on `workers` threads when
  data.loader_workers > 0 (threads, not processes: see docs/data.md, "A torch Dataset");
- the items are collated once for the whole range, by torch's `default_collate` or the user's
  data.collate, into (inputs, targets): an item is an `(inputs, targets)` pair, or a dict whose
  data.label_column key(s) are the targets and whose other keys are the inputs (a dict, passed
  to the model as keyword arguments); inputs and targets are tensors, arrays or numbers, or
  dicts of them;
- the result is numpy, like every read: floating inputs take the task's input dtype when it
  is floating (float64 -> float32), integer inputs its integer dtype when it is one, others are
  kept (a uint8 image stays uint8); a single target takes the task's target dtype (integer
  class ids for classification: an integer or bool target is cast to int64, a floating one is
  refused; ids must not be negative); a dict of targets keeps its dtypes;
- the row ids are the dataset indices (what traces report).

Every problem is a `DecodeError` (the driver's up-front sample: a ConfigError) or, read on a
replica, a `SourceReadError` naming the dataset and the index.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import ray
import torch
from torch.utils.data import default_collate

from actors.partitions.decoding import DecodeError, DecodeSpec
from actors.partitions.plan import SourceReadError, StreamPlan
from policies.rules.imports import NotImportable, import_function

RESOLVE_TIMEOUT_S = 120.0  # getting the dataset or its index list out of the object store
KEEP_DATASETS = 2  # unpickled datasets a process keeps (a run's train and test sets)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: it holds an index array
class ItemSource:
    """What a StreamPlan of a torch Dataset reads: `dataset` (the object, or once the driver
    placed it, its ObjectRef) at `indices` (int64, position -> dataset index; or its ObjectRef)."""

    dataset: Any
    indices: Any
    name: str  # the dataset as the user gave it ('module:function' or its class name): named in errors
    collate: Optional[str] = None  # data.collate, 'module:function'; None: torch's default_collate
    workers: int = 0  # data.loader_workers: threads calling __getitem__ (0: in the reading thread)


_datasets: "OrderedDict[str, Any]" = OrderedDict()  # ObjectRef hex -> the unpickled dataset
_lock = threading.Lock()
_collates: dict[str, Callable[[list], Any]] = {}


def resolve_dataset(obj: Any) -> Any:
    """The dataset itself: `obj` unless it is an ObjectRef, which is fetched and unpickled once
    per process (a dataset that opened files in __getitem__ keeps them open across reads)."""
    if not isinstance(obj, ray.ObjectRef):
        return obj
    key = obj.hex()
    with _lock:
        if key in _datasets:
            _datasets.move_to_end(key)
            return _datasets[key]
    dataset = ray.get(obj, timeout=RESOLVE_TIMEOUT_S)
    with _lock:
        _datasets[key] = dataset
        while len(_datasets) > KEEP_DATASETS:
            _datasets.popitem(last=False)
    return dataset


def indices_of(src: ItemSource, lo: int, hi: int) -> np.ndarray:
    """The dataset indices at positions [lo, hi), a private int64 copy (a view would keep the
    object-store buffer of the whole index list mapped)."""
    indices = src.indices
    if isinstance(indices, ray.ObjectRef):
        indices = ray.get(indices, timeout=RESOLVE_TIMEOUT_S)
    return np.array(indices[lo:hi], dtype=np.int64, copy=True)


def load_collate(name: str) -> Callable[[list], Any]:
    """The user's collate function; a DecodeError naming data.collate when it cannot be loaded."""
    if name not in _collates:
        try:
            _collates[name] = import_function(name)
        except NotImportable as exc:
            raise DecodeError(f"data.collate: {exc}") from None
    return _collates[name]


class ItemError(Exception):
    """`dataset[index]` raised `cause`."""

    def __init__(self, index: int, cause: BaseException) -> None:
        super().__init__(index, cause)
        self.index, self.cause = index, cause

    def line(self, name: str) -> str:
        return f"{name}: dataset[{self.index}] raised {type(self.cause).__name__}: {' '.join(str(self.cause).split())}"


def fetch(dataset: Any, indices: np.ndarray, workers: int) -> list:
    """`dataset[i]` for each index, in order; on `workers` threads when > 0. ItemError on the
    first index (in order) whose __getitem__ raised."""
    def one(i: int) -> Any:
        try:
            return dataset[i]
        except Exception as exc:
            raise ItemError(i, exc) from None

    todo = [int(i) for i in indices]
    if workers <= 0 or len(todo) < 2:
        return [one(i) for i in todo]
    with ThreadPoolExecutor(min(workers, len(todo)), thread_name_prefix="getitem") as pool:
        return list(pool.map(one, todo))


def is_hf_dataset(obj: Any) -> bool:
    """A Hugging Face `datasets.Dataset` (map-style, `ds[list_of_indices]` a dict of columns),
    known by its class, so `datasets` is imported only by jobs that use it."""
    return any(c.__name__ == "Dataset" and c.__module__.split(".")[0] == "datasets" for c in type(obj).__mro__)


def fetch_columns(dataset: Any, indices: np.ndarray) -> dict[str, Any]:
    """A Hugging Face dataset's rows at `indices` in one call (`ds[indices]`: a dict of columns,
    read from its Arrow table at once rather than item by item), each column as an array (a
    plain dataset's lists of numbers, a formatted one's tensors or arrays as they come).
    ItemError on the first index when the call raised."""
    try:
        batch = dataset[[int(i) for i in indices]]
    except Exception as exc:
        raise ItemError(int(indices[0]), exc) from None
    return {k: v if isinstance(v, (torch.Tensor, np.ndarray)) else _column_array(v) for k, v in batch.items()}


def _column_array(values: list) -> np.ndarray:
    try:
        return np.asarray(values)
    except ValueError:  # rows of different lengths: numpy refuses to stack them
        return np.asarray(values, dtype=object)


def _leaf(value: Any, what: str, rows: int, field: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        array = (value.float() if value.dtype == torch.bfloat16 else value).numpy()
    elif isinstance(value, np.ndarray):
        array = value
    else:
        raise DecodeError(f"{field}: {what} collated to a {type(value).__name__}; inputs and targets must be "
                          "tensors, numpy arrays or numbers (or a dict of them)")
    if array.dtype == object:
        raise DecodeError(f"{field}: {what} collated to an array of Python objects; inputs and targets must be "
                          "numeric (rows of one length: pad them, or give a data.collate that does)")
    if array.ndim == 0 or array.shape[0] != rows:
        got = "a scalar" if array.ndim == 0 else f"{array.shape[0]} rows"
        raise DecodeError(f"{field}: {what} collated to {got} for {rows} items; a collate function returns one "
                          "row per item")
    return array


def _tree(value: Any, what: str, rows: int, field: str) -> Any:
    if isinstance(value, Mapping):
        if not value:
            raise DecodeError(f"{field}: {what} collated to an empty dict")
        out = {}
        for k, v in value.items():
            if isinstance(v, Mapping):
                raise DecodeError(f"{field}: {what}[{k!r}] is a dict; one level of names is supported")
            out[str(k)] = _leaf(v, f"{what}[{k!r}]", rows, field)
        return out
    return _leaf(value, what, rows, field)


def split_batch(batch: Any, spec: DecodeSpec, field: str) -> tuple[Any, Any]:
    """A collated batch as (inputs, targets): a pair as it is; a dict split by data.label_column."""
    if isinstance(batch, Mapping):
        missing = [k for k in spec.label_columns if k not in batch]
        if missing:
            keys = ", ".join(repr(str(k)) for k in batch)
            raise DecodeError(f"data.label_column: the dataset's items are dicts with keys {keys}; no {missing[0]!r} "
                              "(data.label_column names the target key or keys)")
        targets = ({k: batch[k] for k in spec.label_columns} if spec.label_is_list
                   else batch[spec.label_columns[0]])
        inputs = {k: v for k, v in batch.items() if k not in spec.label_columns}
        if not inputs:
            raise DecodeError(f"data.label_column: the dataset's items hold only the target key(s) "
                              f"{', '.join(map(repr, spec.label_columns))}; no inputs are left")
        return inputs, targets
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    shape = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (list, tuple)) else f"a {type(batch).__name__}"
    raise DecodeError(f"{field}: the dataset's items collate to {shape}; an item must be an (inputs, targets) pair or a "
                      "dict holding data.label_column")


def cast_inputs(x: Any, input_dtype: str) -> Any:
    want = np.dtype(input_dtype)

    def one(a: np.ndarray) -> np.ndarray:
        same_kind = (a.dtype.kind == "f" and want.kind == "f") or (a.dtype.kind in "iu" and want.kind in "iu")
        return np.ascontiguousarray(a.astype(want, copy=False) if same_kind else a)
    return {k: one(v) for k, v in x.items()} if isinstance(x, dict) else one(x)


def cast_targets(y: Any, target_dtype: str, field: str) -> Any:
    if isinstance(y, dict):  # several targets: a custom task's, with their own dtypes
        return {k: np.ascontiguousarray(v) for k, v in y.items()}
    want = np.dtype(target_dtype)
    if want.kind in "iu":
        if y.dtype.kind not in "iub":
            raise DecodeError(f"{field}: the targets are {y.dtype}; the task's targets are {target_dtype} "
                              "(integer class ids for classification)")
        y = y.astype(want, copy=False)
        if y.ndim == 1 and len(y) and y.min() < 0:
            raise DecodeError(f"{field}: the targets hold negative class ids ({int(y.min())})")
    elif want.kind == "f":
        if y.dtype.kind not in "iubf":
            raise DecodeError(f"{field}: the targets are {y.dtype}; the task's targets are {target_dtype}")
        y = y.astype(want, copy=False)
    return np.ascontiguousarray(y)


def collate_items(items: Any, spec: DecodeSpec, collate: Optional[str], field: str,
                  columns: bool = False) -> tuple[Any, Any]:
    """Items -> (inputs, targets) numpy trees with one row per item, in the task's dtypes.
    `columns`: `items` is a batch already (fetch_columns: a dict of columns), not collated again."""
    fn = (lambda batch: batch) if columns else default_collate if collate is None else load_collate(collate)
    rows = len(next(iter(items.values()))) if columns and items else len(items)
    try:
        batch = fn(items)
    except DecodeError:
        raise
    except Exception as exc:
        who = f"data.collate: {collate}" if collate else "data.collate: torch's default_collate"
        hint = "" if collate else "; items that do not stack (e.g. of different shapes) need a data.collate of your own"
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        raise DecodeError(f"{who} could not batch the items ({why}){hint}") from None
    where = f"{field} (data.collate {collate})" if collate else field
    x, y = split_batch(batch, spec, where)
    x = _tree(x, "inputs", rows, where)
    y = _tree(y, "targets", rows, where)
    return cast_inputs(x, spec.input_dtype), cast_targets(y, spec.target_dtype, where)


def read_unchecked(plan: StreamPlan, lo: int, hi: int) -> dict[str, Any]:
    """`read_items` raising ItemError (an index's __getitem__ raised) or DecodeError as they come."""
    src: ItemSource = plan.items
    ids = indices_of(src, lo, hi)
    if not len(ids):
        raise DecodeError(f"{plan.field}: {src.name}: positions {lo}-{hi} hold no rows")
    dataset = resolve_dataset(src.dataset)
    if src.collate is None and is_hf_dataset(dataset):  # its rows by column, in one call
        x, y = collate_items(fetch_columns(dataset, ids), plan.spec, None, plan.field, columns=True)
    else:
        x, y = collate_items(fetch(dataset, ids, src.workers), plan.spec, src.collate, plan.field)
    return {"x": x, "y": y, "ids": ids}


def read_items(plan: StreamPlan, lo: int, hi: int) -> dict[str, Any]:
    """{"x", "y", "ids"} of positions [lo, hi) of a torch Dataset plan (ids: dataset indices);
    a SourceReadError naming the dataset (and the index whose __getitem__ raised) otherwise."""
    src: ItemSource = plan.items
    try:
        return read_unchecked(plan, lo, hi)
    except ItemError as exc:
        raise SourceReadError(f"{plan.field}: {exc.line(src.name)} (rows {lo}-{hi})") from None
    except DecodeError as exc:
        raise SourceReadError(f"{exc} (reading {src.name}, rows {lo}-{hi})") from None
