"""PartitionServer: leases the train split's partitions to replicas (policies/leases.py decides).

The driver puts every partition into the object store once; the server only holds their refs
(wrapped in lists, so it never fetches the data) and hands a ref out with each lease; the
replica reads the partition zero-copy from its node's object store. It reserves no CPU.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

import numpy as np
import ray
import torch

from actors.shard import _view

from policies.leases import PartitionLedger


@ray.remote(num_cpus=0)
class PartitionServer:
    def __init__(self, refs: list, rows: list[int], replicas: int, seed: int, pinned: bool, shuffle: bool) -> None:
        self.refs, self.rows = refs, rows
        self.ledger = PartitionLedger(len(refs), replicas, seed, pinned, shuffle)

    def start_epoch(self, epoch: int, ranks: list[int] = ()) -> dict[int, Optional[dict[str, Any]]]:
        """Begin an epoch and lease the first partition of each of `ranks` (handed to the
        replicas with their epoch call, which saves each a round trip at the epoch's start)."""
        self.ledger.start_epoch(epoch)
        return {rank: self.lease(rank) for rank in ranks}

    def lease(self, rank: int, completed: list[int] = ()) -> Optional[dict[str, Any]]:
        """Record `completed` partitions of `rank`, then lease it the next one (None: nothing left)."""
        self.complete(rank, completed)
        lease = self.ledger.lease(rank)
        if lease is None:
            return None
        p = lease.partition
        return {"epoch": lease.epoch, "partition": p, "seed": lease.seed, "rows": self.rows[p], "ref": [self.refs[p]]}

    def complete(self, rank: int, partitions: list[int]) -> None:
        for p in partitions:
            self.ledger.complete(rank, p)

    def release(self, rank: int, survivors: list[int]) -> list[int]:
        return self.ledger.release(rank, survivors)

    def status(self) -> dict[str, Any]:
        return {"epoch": self.ledger.epoch, "complete": self.ledger.epoch_complete,
                "remaining": self.ledger.remaining(), "done": dict(self.ledger.done),
                "redone": list(self.ledger.redone)}


class PartitionReader:
    """The replica side: lease partitions until the server has none left for this replica this
    epoch, and cut them into batches. The next lease is requested, and its bytes pulled to this
    node, while the current partition trains; batches are made by tensor indexing (no per-row
    Python); with a GPU, batches are pinned and copied asynchronously."""

    def __init__(self, server, rank: int, batch_size: int, shuffle: bool, device: torch.device, timeout_s: float):
        self.server, self.rank, self.batch_size, self.shuffle = server, rank, batch_size, shuffle
        self.device, self.timeout_s = device, timeout_s
        self.seen: dict[int, dict] = {}  # partition -> zero-copy views into the object store

    def partitions(self, first: Optional[dict] = None) -> Iterator[tuple[dict, dict]]:
        """One server call per partition: each lease request prefetches the next partition and
        reports the ones finished since the last request; the epoch's last completions are
        reported (and acknowledged) before the generator ends, so the server's count is exact
        when the replica says it is done. `first`: a lease already granted with the epoch."""
        finished: list[int] = []
        pending = None if first is not None else self.server.lease.remote(self.rank, finished)
        while True:
            lease = first if pending is None else ray.get(pending, timeout=self.timeout_s)
            if lease is None:
                break
            pending = self.server.lease.remote(self.rank, finished)  # prefetch the next lease
            finished = []
            p = lease["partition"]
            if p not in self.seen:  # views, not copies: a partition met again costs no ray.get
                self.seen[p] = ray.get(lease["ref"][0], timeout=self.timeout_s)
            yield lease, self.seen[p]
            finished.append(p)
        ray.get(self.server.complete.remote(self.rank, finished), timeout=self.timeout_s)

    def batches(self, lease: dict, part: dict, steps: Optional[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """One partition in this epoch's in-partition order: (x, y, row positions in the
        partition; `part["ids"][positions]` are the row ids). `steps` fixed (allreduce: full
        batches only, the ragged end dropped) or None (every row exactly once)."""
        bs = self.batch_size
        x, y = _view(part["x"]), _view(part["y"])
        rows = len(y)
        order = (torch.from_numpy(np.random.default_rng(lease["seed"]).permutation(rows)) if self.shuffle
                 else torch.arange(rows))
        n = steps if steps is not None else -(-rows // bs)
        # index_select gathers rows ~2.5x faster than x[idx] advanced indexing on CPU
        if self.device.type == "cpu":
            for idx in order[: n * bs].split(bs):
                yield torch.index_select(x, 0, idx), torch.index_select(y, 0, idx), idx
            return
        for idx in order[: n * bs].split(bs):  # GPU: pinned host batches, copied asynchronously
            xb, yb = torch.index_select(x, 0, idx).pin_memory(), torch.index_select(y, 0, idx).pin_memory()
            yield xb.to(self.device, non_blocking=True), yb.to(self.device, non_blocking=True), idx
