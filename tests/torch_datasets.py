"""Map-style torch Datasets for the tests of torch Dataset sources (docs/data.md, "A torch
Dataset"): classes, and 'module:function' sources (`data.source: tests.torch_datasets:rows`),
importable on every Ray worker like tests/factories.py."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset


class Rows(Dataset):
    """Item i: (float64 features [i, i+1, ..., i+dim-1], class id i % classes as a Python int):
    every value says which index it came from."""

    def __init__(self, n: int = 200, dim: int = 4, classes: int = 5) -> None:
        self.n, self.dim, self.classes = n, dim, classes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.arange(i, i + self.dim, dtype=np.float64), i % self.classes


class DictRows(Dataset):
    """Item i: {"image": float32 [1, 2, 2] filled with i, "label": i % 4, "weight": float i}."""

    def __init__(self, n: int = 120) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return {"image": torch.full((1, 2, 2), float(i)), "label": i % 4, "weight": float(i)}


class ThreadNames(Rows):
    """Rows that remember which threads called __getitem__ (within one process)."""

    def __init__(self, n: int = 200) -> None:
        super().__init__(n)
        self.seen: set[str] = set()

    def __getitem__(self, i: int):
        self.seen.add(threading.current_thread().name)
        time.sleep(0.0005)  # as a read would: the calls overlap, so the pool starts all its threads
        return super().__getitem__(i)

    def __getstate__(self):
        return {**self.__dict__, "seen": set()}


class Failing(Rows):
    """Rows whose __getitem__ raises at one index."""

    def __init__(self, n: int = 200, bad: int = 0) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i: int):
        if i == self.bad:
            raise FileNotFoundError(f"sample-{i}.png")
        return super().__getitem__(i)


class Empty(Dataset):
    def __len__(self) -> int:
        return 0

    def __getitem__(self, i: int):
        raise IndexError(i)


class NoLen(Dataset):
    def __getitem__(self, i: int):
        return np.zeros(2), 0


class Stream(IterableDataset):
    def __iter__(self):
        return iter([(np.zeros(2), 0)])


class Holder:
    def __init__(self) -> None:
        self.lock = threading.Lock()


class Unpicklable(Rows):
    """Rows holding a lock two levels down (self.state.lock): it cannot be pickled."""

    def __init__(self) -> None:
        super().__init__()
        self.state = Holder()


class Ragged(Rows):
    """Items of different lengths: default_collate cannot stack them."""

    def __getitem__(self, i: int):
        return np.zeros(1 + i % 3, np.float32), 0


class FloatTargets(Rows):
    def __getitem__(self, i: int):
        return np.zeros(4, np.float32), 0.5


class Triples(Rows):
    def __getitem__(self, i: int):
        return np.zeros(4, np.float32), 0, 1


def rows():
    return Rows(200)


def rows_pair():
    return Rows(150), Rows(50)


def rows_test():
    return Rows(40)


def raises():
    raise RuntimeError("the bucket is not there")


def stream():
    return Stream()


def a_number():
    return 42


def collate_marked(items):
    """A collate of one's own: inputs all 7s, the targets as given, as numpy."""
    x = np.full((len(items), 4), 7.0, np.float32)
    y = np.array([item[1] for item in items], np.int64)
    return x, y


def collate_one_row(items):
    return np.zeros((1, 4), np.float32), np.zeros(1, np.int64)


# ---- image-like samples decoded from files (the Ray integration test) -----------------------
def write_digit_files(directory, n: int = 600) -> np.ndarray:
    """scikit-learn's first `n` 8x8 digits as one .npy file each (`<i>.npy`, float32 [1, 8, 8]
    scaled to [0, 1]) and their labels (`labels.npy`); returns the labels."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    os.makedirs(directory, exist_ok=True)
    for i in range(n):
        np.save(os.path.join(directory, f"{i}.npy"), (bunch.images[i] / 16.0).astype(np.float32)[None])
    np.save(os.path.join(directory, "labels.npy"), bunch.target[:n].astype(np.int64))
    return bunch.target[:n]


class DigitFiles(Dataset):
    """A dataset that opens its files lazily: only the directory is pickled; __getitem__ reads
    and decodes one sample's file (as an image dataset decodes a PNG)."""

    def __init__(self, directory) -> None:
        self.directory = str(directory)
        self.labels = np.load(os.path.join(self.directory, "labels.npy"))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        image = torch.from_numpy(np.load(os.path.join(self.directory, f"{i}.npy")))
        return image, int(self.labels[i])
