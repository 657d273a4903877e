"""PartitionServer: leases the train split's partitions to replicas (policies/decisions/leases.py decides).

The server deals only in partition numbers, so a lease is a few small ints and no object
reference crosses the wire per lease. The server reserves no CPU. A replica's reader
(actors/partitions/reader.py) gets a granted partition's rows from the object store or, for a
file source, reads them on its own node.
"""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import Any, Optional

import ray

from policies.decisions.leases import MAX_GRANT, PartitionLedger, grant_message
from policies.messages import ServerStatus

PAUSE = "pause"  # what the reader yields where the server said pause (a phase switch)


@dataclass
class ServerAddress:
    """How a replica reaches the partition server: its handle and, when the driver rebuilds it
    after a death (orchestrator/fleet/server_link.py), the name its incarnations take."""
    handle: Any
    name: Optional[str] = None  # None: a server nobody rebuilds (a caller that built it alone)
    namespace: Optional[str] = None
    generation: int = 0


def is_pause(item: Any) -> bool:
    """Compared by value: a pickled copy of a class that uses PAUSE holds its own copy of the string."""
    return isinstance(item, str) and item == PAUSE


@ray.remote(num_cpus=0)
class PartitionServer:
    """`journal`: a file the server rewrites (atomically) after every call that changes its
    state, before answering; a server started on an existing journal (the driver's rebuild of
    one whose process died, orchestrator/fleet/server_link.py) goes on from it. A call that carries a
    call id (`caller` from a replica, `call` from the driver) and was answered already, by this
    incarnation or the one before, gets the same answer again and changes nothing: a call
    re-sent after the server died is applied once."""

    def __init__(self, rows: list[int], replicas: int, seed: int, pinned: bool, shuffle: bool,
                 max_grant: int = MAX_GRANT, backups: bool = False, journal: Optional[str] = None,
                 generation: int = 0) -> None:
        self.rows, self.journal, self.generation = rows, journal, generation
        self.ledger = PartitionLedger(len(rows), replicas, seed, pinned, shuffle, max_grant, backups=backups)
        self.refused: dict[int, str] = {}  # epoch -> why it could not start
        self.pausing = False
        self.answered: dict[str, tuple[Any, Any]] = {}  # caller -> (its last call id, the answer)
        if journal is not None and os.path.exists(journal):
            with open(journal, "rb") as f:
                kept = pickle.load(f)  # written by this run's own servers, in the driver's private directory
            self.ledger, self.refused, self.pausing, self.answered = (kept["ledger"], kept["refused"], kept["pausing"],
                                                                      kept["answered"])

    def _save(self) -> None:
        if self.journal is None:
            return
        tmp = f"{self.journal}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump({"ledger": self.ledger, "refused": self.refused, "pausing": self.pausing,
                         "answered": self.answered}, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, self.journal)

    def _once(self, caller: str, call: Any, act):
        """`act()` unless `caller`'s call `call` was answered already (then that answer). The
        state and the answer are saved in one write before the answer leaves: a journal that
        held the change without the answer would apply a re-sent call twice (a grant would
        lease new partitions while the ones it first leased stayed held by nobody)."""
        if call is not None:
            seen = self.answered.get(caller)
            if seen is not None and seen[0] == call:
                return seen[1]
        try:
            answer = act()
        except BaseException:
            self._save()  # a refused epoch is kept too
            raise
        if call is not None:
            self.answered[caller] = (call, answer)
            if caller.startswith("driver:"):
                for old in [k for k in self.answered if k.startswith("driver:")][:-DRIVER_CALLS_KEPT]:
                    del self.answered[old]
        self._save()
        return answer

    def start_epoch(self, epoch: int, ranks: list[int] = (),
                    completed: Optional[dict[int, list[int]]] = None,
                    pinned: Optional[bool] = None, resume: Optional[dict[str, Any]] = None,
                    call: Optional[int] = None) -> dict[int, dict[str, Any]]:
        """Record the previous epoch's last completions (`completed`, as for `finish`), check
        that it was served whole (a RuntimeError names what is left), begin `epoch` and grant
        the first partitions of each of `ranks`, in that order: the grants
        `policies.decisions.leases.first_grant_messages` computes, which the driver has already handed to
        the replicas. `pinned`: this epoch's leasing (the mode may have changed). `resume`: the
        epoch goes on from a checkpoint taken inside it ({"done", "skips"}: `PartitionLedger.resume_epoch`)."""
        def act():
            try:
                self._finish(completed or {})
                if pinned is not None:
                    self.ledger.pinned = pinned
                if resume is not None:
                    self.ledger.resume_epoch(epoch, list(ranks), resume["done"], resume["skips"])
                else:
                    self.ledger.start_epoch(epoch, list(ranks))
            except (RuntimeError, ValueError) as exc:
                self.refused[epoch] = str(exc)
                raise
            return {rank: self._next(rank) for rank in ranks}
        return self._once(f"driver:{call}", call, act)

    def grant(self, rank: int, completed: list[int] = (), epoch: Optional[int] = None,
              caller: Optional[str] = None) -> dict[str, Any]:
        """Record `completed` partitions of `rank` (of `epoch`, when given), then grant it the
        next ones (`policies.decisions.leases.grant_message`). {"retry": True} when `epoch` has not started
        yet: the replica began with the grants the driver computed and its request overtook the
        driver's `start_epoch` (calls from different callers are not ordered); a RuntimeError
        when that epoch was refused. `caller`: "<reader id>:<call number>", unique per call."""
        if epoch is not None and epoch != self.ledger.epoch:
            if epoch in self.refused:
                raise RuntimeError(f"epoch {epoch} could not start: {self.refused[epoch]}")
            if epoch > self.ledger.epoch:
                return {"retry": True}
            raise RuntimeError(f"replica {rank} asked for partitions of epoch {epoch}, the server is in {self.ledger.epoch}")

        def act():
            self.complete(rank, completed)
            if self.pausing:
                return {"pause": True, "leases": [], "last": False}
            return self._next(rank)
        return self._once(f"rank:{rank}", caller, act)

    def _next(self, rank: int) -> dict[str, Any]:
        return grant_message(self.ledger.grant(rank), self.rows)

    def pid(self) -> int:
        return os.getpid()

    def incarnation(self) -> int:
        """This server's generation (a reconnecting reader's probe, actors/incarnation.py)."""
        return self.generation

    def pause(self, on: bool, share: bool = False, call: Optional[int] = None) -> None:
        """A phase switch: while on, a replica asking for partitions is told to pause (it stops
        at that partition boundary and asks again when resumed). `share`: the rest of this
        epoch is leased from one shared queue (the next mode is asynchronous)."""
        def act():
            self.pausing = on
            if share:
                self.ledger.share_rest()
        return self._once(f"driver:{call}", call, act)

    def complete(self, rank: int, partitions: list[int]) -> None:
        for p in partitions:
            self.ledger.complete(rank, p)

    def finish(self, completed: dict[int, list[int]], call: Optional[int] = None) -> ServerStatus:
        """Record the last completions of a pass, as the replicas returned them with their epoch
        results (`PartitionReader.unreported`), and return the status."""
        return self._once(f"driver:{call}", call, lambda: self._finish(completed))

    def _finish(self, completed: dict[int, list[int]]) -> ServerStatus:
        for rank, partitions in completed.items():
            self.complete(rank, partitions)
        return self.status()

    def release(self, rank: int, survivors: list[int], call: Optional[int] = None) -> list[int]:
        return self._once(f"driver:{call}", call, lambda: self.ledger.release(rank, survivors))

    def status(self) -> ServerStatus:
        return ServerStatus(self.ledger.epoch, self.ledger.epoch_complete, self.ledger.remaining(),
                            dict(self.ledger.done), list(self.ledger.redone), self.generation)


DRIVER_CALLS_KEPT = 32  # the driver's answered calls a rebuilt server remembers (it re-sends only unanswered ones)
