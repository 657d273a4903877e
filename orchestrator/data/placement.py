"""Where a run's data lives, and what each replica is given to reach it.

- `StoredData` (builtins, in-memory data): the driver puts every train partition and the test
  split into the object store once; a replica gets the partitions' refs and a [lo, hi) slice
  of the test split.
- `StreamedData` (file sources): nothing of the source is put; a replica gets the train plan
  (its reader reads each granted partition on its own node, actors/partitions/reading.py) and its share
  of the test plan's pieces. Only the decoded sample is put (the spares' rehearsal batch).
  A torch Dataset is planned like a file source: its dataset object (pickled) and each plan's
  index list are put once, and the plans carry their refs (orchestrator/data/torch_data.py).

Both answer the same questions (`rows`, `train`, `sample`, `test_share`), so the controller
does not ask which kind it has. `test_share(..., split="val")` is the validation split's share
(data.val_fraction), the one replicas evaluate during the run when there is one.
"""
from __future__ import annotations

from typing import Any, Union

import ray

from actors.partitions.reading import eval_shares
from orchestrator.data.in_memory import Dataset, eval_slices, partition
from orchestrator.data.planning import StreamedDataset


class StoredData:
    def __init__(self, dataset: Dataset, parts: int, seed: int) -> None:
        cut = partition(dataset.train, parts, seed)
        self.train: Any = [ray.put({"x": p.x, "y": p.y, "ids": p.ids}) for p in cut]  # each partition put once
        self.rows = [len(p) for p in cut]
        self.test = ray.put({"x": dataset.test.x, "y": dataset.test.y})
        self.test_rows = len(dataset.test)
        self.val = None if dataset.val is None else ray.put({"x": dataset.val.x, "y": dataset.val.y})
        self.val_rows = 0 if dataset.val is None else len(dataset.val)
        self.sample = self.test

    def test_share(self, index: int, members: int, split: str = "test") -> tuple[list, Any]:
        """What `ModelReplica.set_test_slice` takes for the member at `index` of `members`."""
        if split == "val":
            return [self.val], eval_slices(self.val_rows, members)[index]
        return [self.test], eval_slices(self.test_rows, members)[index]


class StreamedData:
    def __init__(self, dataset: StreamedDataset) -> None:
        self.train: Any = dataset.train_plan
        self.rows = list(dataset.train_plan.rows)
        self.test, self.val = dataset.test_plan, dataset.val_plan
        if self.train.items is not None:  # a torch Dataset: the dataset and its index lists put once
            from orchestrator.data.torch_data import place_items

            self.train, self.test, self.val = place_items(self.train, self.test, self.val)
        self.test_rows, self.val_rows = dataset.test_rows, dataset.val_rows
        self.sample = ray.put({"x": dataset.sample.x, "y": dataset.sample.y})

    def test_share(self, index: int, members: int, split: str = "test") -> tuple[list, Any]:
        plan = self.val if split == "val" else self.test
        return [plan], eval_shares(plan, members)[index]


def place_data(dataset: Union[Dataset, StreamedDataset], parts: int, seed: int) -> Union[StoredData, StreamedData]:
    """`parts`: the in-memory partition count (a file source's plan has its own)."""
    if isinstance(dataset, StreamedDataset):
        return StreamedData(dataset)
    return StoredData(dataset, parts, seed)
