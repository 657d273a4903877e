"""The data a job trains on: `load_dataset` picks the loader for the job's source (a builtin,
in-memory data, files, which are planned rather than read: orchestrator/data/planning.py, or a
map-style torch Dataset, planned the same way: orchestrator/data/torch_data.py)."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Union

import numpy as np

from orchestrator.data.in_memory import Dataset, hold_out_val, load_source
from orchestrator.errors import ConfigError
from orchestrator.data.planning import StreamedDataset, plan_file_dataset
from orchestrator.data.sources import classes_of, decode_spec, read_table, table_from_memory, table_to_split
from orchestrator.data.torch_data import check_fields, load_torch_dataset, wants_torch
from policies.rules.batches import shape_of


# how rows are decoded and split: a builtin dataset comes decoded and split, and would ignore them
FILE_ONLY_FIELDS = ("label_column", "feature_columns", "decode", "feature_shape", "id_column", "test_source",
                    "test_fraction", "val_source")


def check_builtin_fields(data_cfg) -> None:
    """A builtin source with one of FILE_ONLY_FIELDS changed from its default: ConfigError naming it."""
    for name in FILE_ONLY_FIELDS:
        if getattr(data_cfg, name) != type(data_cfg).model_fields[name].default:
            raise ConfigError(f"config error: data.{name}: {data_cfg.source} comes decoded and split; data.{name} "
                              "applies to file sources and in-memory data only (remove it)")


def load_dataset(data_cfg, in_memory: Any = None, task: Any = None, replicas: int = 1) -> Union[Dataset, StreamedDataset]:
    """The train and test data for a job (see DataConfig for the fields): builtins and in-memory
    data as arrays (put into the object store by the driver), a file source as a plan
    (orchestrator/data/planning.py: read where it is consumed). `task`: whose dtypes the builtin
    decoder makes (default: classification's); `replicas`: for a file source's partition count.
    A torch Dataset (`in_memory` one, or a 'module:function' data.source) is planned like a file
    source (orchestrator/data/torch_data.py)."""
    source = data_cfg.source
    if wants_torch(data_cfg, in_memory):
        return load_torch_dataset(data_cfg, in_memory, task, replicas)
    check_fields(data_cfg, torch_source=False)
    if in_memory is None and source.startswith("builtin:"):
        check_builtin_fields(data_cfg)
        return hold_out_val(load_source(source, data_cfg.seed), data_cfg.val_fraction, data_cfg.seed)
    if in_memory is None:
        return plan_file_dataset(data_cfg, task, replicas)
    table = table_from_memory(in_memory)
    if isinstance(in_memory, tuple):
        data_cfg = data_cfg.model_copy(update={"label_column": "label", "feature_columns": ["features"], "id_column": None})
    whole = table_to_split(table, decode_spec(data_cfg, table.schema, task), source="in-memory data")
    if data_cfg.test_source:  # in-memory training data: its test set is read whole too
        test_table = read_table(data_cfg.test_source, "data.test_source")
        test = table_to_split(test_table, decode_spec(data_cfg, test_table.schema, task), source=data_cfg.test_source)
        train = whole
        if shape_of(test.x) != shape_of(train.x):
            raise ConfigError(f"config error: data.test_source: {data_cfg.test_source} rows decode to inputs "
                              f"{shape_of(test.x)}, the train data to {shape_of(train.x)}")
    else:
        order = np.random.default_rng(data_cfg.seed).permutation(len(whole))
        n_test = int(round(len(whole) * data_cfg.test_fraction))
        if n_test < 1 or n_test >= len(whole):
            raise ConfigError(f"config error: data.test_fraction: {data_cfg.test_fraction} of {len(whole)} rows "
                              "leaves an empty train or test split")
        test, train = whole.take(order[:n_test]), whole.take(order[n_test:])
    dataset = Dataset(os.path.basename(source.rstrip("/")) or source, train, test, classes_of(train, test))
    if data_cfg.val_source:  # in-memory training data: its validation set is read whole too
        val_table = read_table(data_cfg.val_source, "data.val_source")
        val = table_to_split(val_table, decode_spec(data_cfg, val_table.schema, task), source=data_cfg.val_source)
        if shape_of(val.x) != shape_of(train.x):
            raise ConfigError(f"config error: data.val_source: {data_cfg.val_source} rows decode to inputs "
                              f"{shape_of(val.x)}, the train data to {shape_of(train.x)}")
        return dataclasses.replace(dataset, val=val)
    return hold_out_val(dataset, data_cfg.val_fraction, data_cfg.seed)
