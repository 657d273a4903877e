"""Batches as the model and the task see them: a tensor, or a dict of tensors (name -> tensor).

A decoder (actors/partitions/decoding.py, or the user's `data.decode`) turns a pyarrow Table of rows
into (inputs, targets), each a "tree": one array, or a dict of arrays that share their first
dimension (the rows). Everything that moves rows around (partitions, batches, test slices)
goes through the helpers here, so a dict of tensors travels exactly like one tensor.
"""
from __future__ import annotations

from typing import Any, Callable, Union

import numpy as np
import torch

Tree = Union[torch.Tensor, np.ndarray, dict[str, Any]]


def tree_map(fn: Callable[[Any], Any], tree: Tree) -> Tree:
    if isinstance(tree, dict):
        return {k: fn(v) for k, v in tree.items()}
    return fn(tree)


def leaves(tree: Tree) -> list[Any]:
    return list(tree.values()) if isinstance(tree, dict) else [tree]


def rows(tree: Tree) -> int:
    """The number of rows (the first dimension every leaf shares)."""
    first = leaves(tree)
    return int(first[0].shape[0]) if first else 0


def check_rows(tree: Tree, what: str) -> int:
    """The shared row count; a ValueError naming `what` when the leaves disagree."""
    counts = {k: int(v.shape[0]) for k, v in (tree.items() if isinstance(tree, dict) else [("", tree)])}
    if len(set(counts.values())) > 1:
        raise ValueError(f"{what}: the arrays hold different numbers of rows: {counts}")
    return next(iter(counts.values()), 0)


def take(tree: Tree, idx: Union[np.ndarray, torch.Tensor]) -> Tree:
    """The rows `idx` of every leaf (numpy leaves by numpy indexing, tensors by index_select,
    which gathers rows ~2.5x faster than advanced indexing on CPU)."""
    if isinstance(idx, torch.Tensor):
        return tree_map(lambda t: torch.index_select(t, 0, idx), tree)
    return tree_map(lambda a: a[idx], tree)


def slice_rows(tree: Tree, lo: int, hi: int) -> Tree:
    return tree_map(lambda a: a[lo:hi], tree)


def concat(trees: list[Tree]) -> Tree:
    """Rows of several trees (numpy) one after the other."""
    first = trees[0]
    if isinstance(first, dict):
        return {k: np.concatenate([t[k] for t in trees]) for k in first}
    return np.concatenate(trees)


def as_tensors(tree: Tree) -> Tree:
    """numpy leaves as tensors sharing their memory (a read-only object-store view is wrapped
    without a copy: torch warns about it, but the rows are only ever read)."""
    def one(a: Any) -> torch.Tensor:
        if isinstance(a, torch.Tensor):
            return a
        if not a.flags.writeable:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(a)
        return torch.from_numpy(np.ascontiguousarray(a))
    return tree_map(one, tree)


def to_device(tree: Tree, device: torch.device, pin: bool = False) -> Tree:
    if device.type == "cpu":
        return tree
    return tree_map(lambda t: (t.pin_memory() if pin else t).to(device, non_blocking=pin), tree)


def forward(model: torch.nn.Module, inputs: Tree) -> Any:
    """The model on a batch's inputs: model(x), or model(**x) for a dict of named inputs."""
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def shape_of(tree: Tree) -> Any:
    """Each leaf's per-row shape and dtype (for error messages and checks)."""
    return tree_map(lambda a: (tuple(a.shape[1:]), str(a.dtype)), tree)
