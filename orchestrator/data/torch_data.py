"""A map-style torch Dataset as a job's data: `ElasticTrainer(config, data=dataset)`, or
`data.source: "module:function"` returning one (or a `(train, test)` pair of them).

It is planned like a file source (orchestrator/data/planning.py), so everything downstream (the
partition server, leases, the ledger, read tasks on the replicas' nodes, read-ahead,
evaluation pieces, recovery) is the one file sources use:

- **The split**: a single dataset is split by a seeded random permutation of its indices
  (data.seed): the first round(n x data.test_fraction) are the test set. A `(train, test)`
  pair, or data.test_source ('module:function' returning the test set), gives the test set
  instead. The train indices stay in their permuted order and the test indices are sorted.
- **Positions**: a plan's positions index its list of dataset indices; the train partitions are
  contiguous position ranges of near-equal size (so each is a random subset of the dataset:
  a dataset stored sorted by class, like torchvision's ImageFolder, is mixed anyway), and the
  test plan is cut into evaluation pieces. The row ids (traces) are the dataset indices.
- **Shipping**: the dataset is pickled to the replicas: checked here (a part that cannot be
  pickled is named), put into the object store once by the placement (orchestrator/data/placement.py
  `StreamedData`), with each plan's index list.

Up front (ConfigError, one line): the source imports and returns a map-style dataset (an
IterableDataset is refused: rows are leased and re-served by index), it is not empty,
`dataset[0]` works, it pickles, and the first rows collate into inputs and targets the task
takes (the sample, also the model check's input).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from actors.partitions.decoding import DecodeError, DecodeSpec
from actors.partitions.reading import Block, StreamPlan, cut_ranges
from orchestrator.checks import bounded, one_line
from orchestrator.data.in_memory import Split
from orchestrator.errors import ConfigError
from policies.rules.imports import NotImportable, import_function

FUNCTION_SOURCE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
# set only for a table source (a file, in-memory arrays or tables): refused with a torch Dataset
TABLE_ONLY_FIELDS = ("feature_columns", "decode", "feature_shape", "id_column")
TORCH_ONLY_FIELDS = ("collate", "loader_workers")
SAMPLE_TIMEOUT_S = 300.0  # collating the first rows on the driver (a dataset may read remote files)


def is_function_source(source: Optional[str]) -> bool:
    """A 'module:function' data source (a dotted module, a colon, a name; no '://', not builtin:)."""
    return (isinstance(source, str) and "://" not in source and not source.startswith("builtin:")
            and FUNCTION_SOURCE.fullmatch(source) is not None)


def is_torch_dataset(obj: Any) -> bool:
    """A dataset of items: a torch.utils.data.Dataset or a Hugging Face datasets.Dataset (any
    of the `datasets` package's dataset classes, so a DatasetDict or an IterableDataset is
    refused by check_map_style with its reason, not read as a dict of columns)."""
    from torch.utils.data import Dataset

    from actors.partitions.items import is_hf_dataset

    return isinstance(obj, Dataset) or is_hf_dataset(obj) or (
        type(obj).__module__.split(".")[0] == "datasets" and "Dataset" in type(obj).__name__)


def driver_files_refusal(files: list[str], node_ips: list[str], driver_ip: str, what: str) -> Optional[str]:
    """The one-line error for a dataset whose rows live in files on the driver's machine (a
    Hugging Face dataset's Arrow cache files, memory-mapped: pickling it sends their paths) when
    the cluster has a node on another machine, which could not read them; None when it can."""
    away = sorted({ip for ip in node_ips if ip != driver_ip})
    if not files or not away:
        return None
    return (f"config error: data: {what} reads its rows from files on this machine ({files[0]}"
            f"{f' and {len(files) - 1} more' if len(files) > 1 else ''}), which the cluster's nodes at "
            f"{', '.join(away[:3])}{' ...' if len(away) > 3 else ''} cannot read; load it into memory "
            "(datasets.Dataset.from_dict, or load_dataset(..., keep_in_memory=True)) or write it to Parquet on "
            "storage every node reads (ds.to_parquet) and give that as data.source")


def check_driver_files(dataset: Any, what: str) -> None:
    """driver_files_refusal for `dataset` on the connected cluster's alive nodes; ConfigError."""
    files = [f.get("filename", "") for f in (getattr(dataset, "cache_files", None) or []) if isinstance(f, dict)]
    if not files:
        return
    import ray

    driver_ip = ray.util.get_node_ip_address()
    ips = [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")]
    refusal = driver_files_refusal(files, ips, driver_ip, what)
    if refusal is not None:
        raise ConfigError(refusal)


def wants_torch(data_cfg: Any, in_memory: Any) -> bool:
    """Is the job's data a torch Dataset: `data=` one (or a pair with one), or a 'module:function' source?"""
    if in_memory is not None:
        return is_torch_dataset(in_memory) or (isinstance(in_memory, tuple) and len(in_memory) == 2
                                               and any(is_torch_dataset(d) for d in in_memory))
    return is_function_source(data_cfg.source)


def _changed(data_cfg: Any, name: str) -> bool:
    return getattr(data_cfg, name) != type(data_cfg).model_fields[name].default


def check_fields(data_cfg: Any, torch_source: bool) -> None:
    """Fields of the other kind of source, set: a ConfigError naming the field (refused, not ignored)."""
    if torch_source:
        for name in TABLE_ONLY_FIELDS:
            if _changed(data_cfg, name):
                raise ConfigError(f"config error: data.{name}: applies to table sources (files, in-memory arrays and "
                                  "tables); a torch Dataset's items are collated instead (data.collate; remove it)")
        return
    for name in TORCH_ONLY_FIELDS:
        if _changed(data_cfg, name):
            raise ConfigError(f"config error: data.{name}: applies to a torch Dataset source only (data.source: "
                              "'module:function', or ElasticTrainer(config, data=dataset); remove it)")
    for name in ("test_source", "val_source"):
        spec = getattr(data_cfg, name)
        if is_function_source(spec):
            raise ConfigError(f"config error: data.{name}: {spec} is a 'module:function' {name[:-7]} set, which goes "
                              "with a torch Dataset train set (data.source: 'module:function')")


def call_source(spec: str, field: str) -> Any:
    """What the user's 'module:function' returns; ConfigError when it cannot be imported or raises."""
    try:
        fn = import_function(spec)
    except NotImportable as exc:
        raise ConfigError(f"config error: {field}: {exc}") from None
    try:
        return fn()
    except Exception as exc:
        raise ConfigError(f"config error: {field}: {spec} raised {type(exc).__name__}: {one_line(exc)}") from None


def is_map_style(obj: Any) -> bool:
    """__len__ and __getitem__, as torch's DataLoader takes (a list of items too), but not an
    IterableDataset, a tuple, a dict, text, or an array (whose items are not (inputs, targets))."""
    import torch
    from torch.utils.data import IterableDataset

    if isinstance(obj, (IterableDataset, str, bytes, tuple, Mapping, np.ndarray, torch.Tensor)):
        return False
    return hasattr(type(obj), "__getitem__") and hasattr(type(obj), "__len__")


def check_map_style(obj: Any, field: str, name: str) -> int:
    """`obj`'s length when it is a non-empty map-style dataset; ConfigError saying what it is otherwise."""
    from torch.utils.data import IterableDataset

    kind = type(obj).__name__
    what = name if f"({kind})" in name else f"{name} ({kind})"
    if isinstance(obj, IterableDataset):
        raise ConfigError(f"config error: {field}: {what} is an IterableDataset, which is not supported: rows "
                          "are dealt out, traced and served again after a failure by index, and an IterableDataset "
                          "has none; give a map-style Dataset (__len__ and __getitem__), or write the rows to "
                          "Parquet files (a file source is streamed)")
    if is_torch_dataset(obj) and not hasattr(type(obj), "__len__"):
        raise ConfigError(f"config error: {field}: {what} has no __len__; a map-style Dataset needs "
                          "__len__ and __getitem__")
    if kind in ("DatasetDict", "IterableDatasetDict"):
        raise ConfigError(f"config error: {field}: {name} is a {kind} of splits ({', '.join(map(repr, obj))}); give "
                          "its (train, test) pair, e.g. (ds['train'], ds['test'])")
    if not is_map_style(obj):
        raise ConfigError(f"config error: {field}: {name} is of type {kind}, not a map-style dataset (an object with "
                          "__len__ and __getitem__, e.g. a torch.utils.data.Dataset), nor a (train, test) pair of them")
    try:
        n = len(obj)
    except Exception as exc:
        raise ConfigError(f"config error: {field}: {name}: len(dataset) raised "
                          f"{type(exc).__name__}: {one_line(exc)}") from None
    if n < 1:
        raise ConfigError(f"config error: {field}: {name} is empty (len {n})")
    try:
        obj[0]
    except Exception as exc:
        raise ConfigError(f"config error: {field}: {name}: dataset[0] raised "
                          f"{type(exc).__name__}: {one_line(exc)}") from None
    return n


class _Sink:
    """A file that only counts what is written to it: pickling without holding the bytes."""

    def __init__(self) -> None:
        self.bytes = 0

    def write(self, data: Any) -> int:
        self.bytes += memoryview(data).nbytes
        return memoryview(data).nbytes


def _pickles(obj: Any) -> Optional[BaseException]:
    from ray import cloudpickle

    try:
        cloudpickle.dump(obj, _Sink(), protocol=5)
    except Exception as exc:
        return exc
    return None


def _unpicklable(obj: Any, path: str, depth: int = 4) -> Optional[str]:
    """The dotted path of the first attribute (depth first, up to `depth` levels down) that
    does not pickle, with its type; None when no attribute can be blamed."""
    attrs = getattr(obj, "__dict__", None)
    if depth == 0 or not isinstance(attrs, dict):
        return None
    for key, value in attrs.items():
        if _pickles(value) is not None:
            return _unpicklable(value, f"{path}.{key}", depth - 1) or f"{path}.{key} ({type(value).__name__})"
    return None


def check_picklable(obj: Any, field: str, name: str) -> None:
    """ConfigError naming what cannot be pickled: the dataset goes to the replicas pickled."""
    error = _pickles(obj)
    if error is None:
        return
    part = _unpicklable(obj, "dataset") or f"the dataset ({type(obj).__name__})"
    raise ConfigError(f"config error: {field}: {name} cannot be pickled to ship it to the replicas: {part} does not "
                      f"pickle ({type(error).__name__}: {one_line(error)}); open files and connections lazily in "
                      "__getitem__, not in __init__")


def _datasets(data_cfg: Any, in_memory: Any) -> tuple[Any, Any, str, str, str]:
    """(train, test or None, field, train name, test name) as the user gave them: one dataset,
    or a tuple of two, (train, test)."""
    if in_memory is not None:
        field, got = "data", in_memory
    else:
        field, got = "data.source", call_source(data_cfg.source, "data.source")
    pair = isinstance(got, tuple) and len(got) == 2
    if in_memory is not None:
        names = ([f"the {what} dataset ({type(d).__name__})" for what, d in zip(("train", "test"), got)] if pair
                 else [f"the dataset ({type(got).__name__})"] * 2)
    else:
        names = [f"{data_cfg.source}()" + (f"[{i}]" if pair else "") for i in (0, 1)]
    train, test = got if pair else (got, None)
    return train, test, field, names[0], names[1]


def _tree_shapes(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: list(v.shape[1:]) for k, v in tree.items()}
    return list(tree.shape[1:])


def _bytes_per_row(split: Split) -> float:
    leaves = [*(split.x.values() if isinstance(split.x, dict) else [split.x]),
              *(split.y.values() if isinstance(split.y, dict) else [split.y])]
    return sum(a.nbytes for a in leaves) / max(len(split), 1)


def _sample(plan: StreamPlan, rows: int) -> Split:
    """The plan's first rows read here (the dataset called on the driver): the up-front check."""
    from actors.partitions.items import ItemError, read_unchecked

    def read() -> dict:
        return read_unchecked(plan, 0, min(rows, plan.total))

    try:
        part = bounded(read, SAMPLE_TIMEOUT_S, f"{plan.field}: reading the first rows of {plan.items.name}")
    except ItemError as exc:
        raise ConfigError(f"config error: {plan.field}: {exc.line(plan.items.name)}") from None
    except (DecodeError, TimeoutError) as exc:
        raise ConfigError(f"config error: {one_line(exc)}") from None
    return Split(part["x"], part["y"], part["ids"])


def load_torch_dataset(data_cfg: Any, in_memory: Any = None, task: Any = None, replicas: int = 1) -> Any:
    """A torch Dataset planned for streaming (a `StreamedDataset`, see the module docstring);
    ConfigError on bad input."""
    from actors.partitions.items import ItemSource
    from orchestrator.data.planning import SAMPLE_ROWS, StreamedDataset, default_partitions, piece_ranges

    check_fields(data_cfg, torch_source=True)
    train, test, field, name, test_name = _datasets(data_cfg, in_memory)
    test_field = field
    if data_cfg.test_source is not None:
        if test is not None:
            raise ConfigError(f"config error: data.test_source: {name.removesuffix('[0]')} already gives a test set "
                              "(a (train, test) pair); remove data.test_source")
        if not is_function_source(data_cfg.test_source):
            raise ConfigError(f"config error: data.test_source: {data_cfg.test_source!r}: with a torch Dataset, the test "
                              "set is a 'module:function' returning a map-style Dataset too")
        test_field, test_name = "data.test_source", f"{data_cfg.test_source}()"
        test = call_source(data_cfg.test_source, test_field)
    n = check_map_style(train, field, name)
    check_picklable(train, field, name)
    rng = np.random.default_rng(data_cfg.seed)
    if test is None:
        order = rng.permutation(n).astype(np.int64)
        n_test = int(round(n * data_cfg.test_fraction))
        if n_test < 1 or n_test >= n:
            raise ConfigError(f"config error: data.test_fraction: {data_cfg.test_fraction} of {n} rows "
                              "leaves an empty train or test split")
        test, test_idx, train_idx = train, np.sort(order[:n_test]), order[n_test:]
    else:
        n_test = check_map_style(test, test_field, test_name)
        if test is not train:
            check_picklable(test, test_field, test_name)
        train_idx, test_idx = rng.permutation(n).astype(np.int64), np.arange(n_test, dtype=np.int64)
    val_idx = val_set = None
    if data_cfg.val_source is not None:
        if not is_function_source(data_cfg.val_source):
            raise ConfigError(f"config error: data.val_source: {data_cfg.val_source!r}: with a torch Dataset, the "
                              "validation set is a 'module:function' returning a map-style Dataset too")
        val_set = call_source(data_cfg.val_source, "data.val_source")
        n_val = check_map_style(val_set, "data.val_source", f"{data_cfg.val_source}()")
        check_picklable(val_set, "data.val_source", f"{data_cfg.val_source}()")
        val_idx = np.arange(n_val, dtype=np.int64)
    elif data_cfg.val_fraction > 0:  # a seeded share of the train indices, drawn apart from the test split
        from orchestrator.data.in_memory import VAL_SEED

        n_val = int(round(len(train_idx) * data_cfg.val_fraction))
        if n_val < 1 or n_val >= len(train_idx):
            raise ConfigError(f"config error: data.val_fraction: {data_cfg.val_fraction} of {len(train_idx)} train rows "
                              "leaves an empty train or validation split")
        pick = np.random.default_rng(data_cfg.seed + VAL_SEED).permutation(len(train_idx))
        val_idx, train_idx = np.sort(train_idx[pick[:n_val]]), train_idx[np.sort(pick[n_val:])]
    labels = [data_cfg.label_column] if isinstance(data_cfg.label_column, str) else list(data_cfg.label_column)
    spec = DecodeSpec(tuple(labels), not isinstance(data_cfg.label_column, str), (), None, None,
                      getattr(task, "input_dtype", "float32"), getattr(task, "target_dtype", "int64"))

    def plan_of(dataset: Any, indices: np.ndarray, what: str, where: str) -> StreamPlan:
        items = ItemSource(dataset, indices, what, data_cfg.collate, data_cfg.loader_workers)
        return StreamPlan(what, where, "torch", None, (Block(what, None, 0, len(indices)),), spec, "all",
                          data_cfg.test_fraction, data_cfg.seed, items=items)

    train_plan = plan_of(train, train_idx, name, field)
    test_plan = plan_of(test, test_idx, test_name if test is not train else name, test_field)
    sample = _sample(train_plan, SAMPLE_ROWS)
    if test is not train:
        test_sample = _sample(test_plan, 2)
        if _tree_shapes(test_sample.x) != _tree_shapes(sample.x):
            raise ConfigError(f"config error: {test_field}: {test_name} items collate to inputs of shape "
                              f"{_tree_shapes(test_sample.x)}, the train set's to {_tree_shapes(sample.x)}")
    per_row = _bytes_per_row(sample)
    n_train = len(train_idx)
    parts = data_cfg.partitions or default_partitions(replicas, n_train, n_train, int(per_row * n_train))
    if parts > n_train:
        raise ConfigError(f"config error: data.partitions: {parts} partitions for {n_train} train rows")
    ranges, rows = cut_ranges(train_plan, parts)
    train_plan = dataclasses.replace(train_plan, ranges=tuple(ranges), rows=tuple(rows))
    test_plan = piece_ranges(test_plan, int(per_row * n_test))
    val_plan = None
    if val_idx is not None:
        val_plan = (plan_of(train, val_idx, name, field) if val_set is None else
                    plan_of(val_set, val_idx, f"{data_cfg.val_source}()", "data.val_source"))
        if val_set is not None and _tree_shapes(_sample(val_plan, 2).x) != _tree_shapes(sample.x):
            raise ConfigError(f"config error: data.val_source: {data_cfg.val_source}() items collate to inputs of shape "
                              f"{_tree_shapes(_sample(val_plan, 2).x)}, the train set's to {_tree_shapes(sample.x)}")
        val_plan = piece_ranges(val_plan, int(per_row * len(val_idx)))
    y = sample.y
    classes = int(y.max()) + 1 if isinstance(y, np.ndarray) and y.ndim == 1 and y.dtype.kind in "iu" else 0
    label = data_cfg.source if in_memory is None else type(train).__name__
    return StreamedDataset(label, train_plan, test_plan, sample, classes, val_plan)


def place_items(*plans: Optional[StreamPlan]) -> tuple[Optional[StreamPlan], ...]:
    """The plans with their datasets and index lists in the object store: each dataset put once
    (a split's train, validation and test plans share theirs), so read tasks and replicas get
    refs. None stays None."""
    import ray

    refs: dict[int, Any] = {}

    def placed(plan: StreamPlan) -> StreamPlan:
        items = plan.items
        if id(items.dataset) not in refs:
            check_driver_files(items.dataset, plan.source)
            refs[id(items.dataset)] = ray.put(items.dataset)
        items = dataclasses.replace(items, dataset=refs[id(items.dataset)], indices=ray.put(items.indices))
        return dataclasses.replace(plan, items=items)

    return tuple(None if plan is None else placed(plan) for plan in plans)
