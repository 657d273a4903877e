"""PartitionServer: leases the train split's partitions to replicas (policies/leases.py decides).

The driver puts every partition into the object store once; the server only holds their refs
(wrapped in lists, so it never fetches the data) and hands a ref out with each lease; the
replica reads the partition zero-copy from its node's object store. It reserves no CPU.
"""
from __future__ import annotations

from typing import Any, Optional

import ray

from policies.leases import PartitionLedger


@ray.remote(num_cpus=0)
class PartitionServer:
    def __init__(self, refs: list, rows: list[int], replicas: int, seed: int, pinned: bool, shuffle: bool) -> None:
        self.refs, self.rows = refs, rows
        self.ledger = PartitionLedger(len(refs), replicas, seed, pinned, shuffle)

    def start_epoch(self, epoch: int) -> int:
        self.ledger.start_epoch(epoch)
        return len(self.refs)

    def lease(self, rank: int) -> Optional[dict[str, Any]]:
        lease = self.ledger.lease(rank)
        if lease is None:
            return None
        p = lease.partition
        return {"epoch": lease.epoch, "partition": p, "seed": lease.seed, "rows": self.rows[p], "ref": [self.refs[p]]}

    def complete(self, rank: int, partition: int) -> None:
        self.ledger.complete(rank, partition)

    def release(self, rank: int, survivors: list[int]) -> list[int]:
        return self.ledger.release(rank, survivors)

    def status(self) -> dict[str, Any]:
        return {"epoch": self.ledger.epoch, "complete": self.ledger.epoch_complete,
                "remaining": self.ledger.remaining(), "done": dict(self.ledger.done),
                "redone": list(self.ledger.redone)}
