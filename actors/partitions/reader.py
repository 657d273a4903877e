"""A replica's side of the partition server: `PartitionReader` asks the server for leases
(actors/partitions/server.py) and turns each granted partition into batches. Where the rows come
from depends on the source:
- in memory (`StoredPartitions`): the driver put every partition into the object store once and
  gave each reader the list of refs (wrapped in a list, so Ray passes them through unresolved);
  the reader maps a partition zero-copy the first time it is leased and keeps the view;
- a file source (`StreamedPartitions`): the reader holds the driver's plan
  (actors/partitions/reading.py) and runs a zero-CPU read task pinned to its own node for each granted
  partition, at most data.prefetch_partitions ahead of the one training; the rows land in that
  node's object store, are mapped zero-copy, and are let go once the partition is trained, so a
  replica holds a bounded number of partitions and any replica can re-read one by number.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Optional

import numpy as np
import ray
import torch

from actors.incarnation import find_successor, wait_for_successor
from actors.partitions.server import PAUSE, ServerAddress, is_pause
from actors.partitions.reading import StreamPlan, read_partition_task
from policies.messages import ReaderPosition
from policies.rules.batches import as_tensors, rows as batch_rows, take, to_device

ASK_SLICE_S = 1.0  # a grant unanswered this long: is there a newer server? (the driver replaced a stopped one)
READ_TIMEOUT_S = 120.0  # a streamed partition's read is given at least this long (remote stores retry on their own)


class StoredPartitions:
    """In-memory partitions: the driver's refs; a partition is mapped zero-copy the first time
    it is granted and the view kept (a partition met again costs no ray.get)."""

    def __init__(self, refs: list, timeout_s: float) -> None:
        self.refs, self.timeout_s = refs, timeout_s
        self.seen: dict[int, dict] = {}

    def new_pass(self) -> None:
        pass

    def request(self, partitions: list[int]) -> None:
        """Map granted partitions (the helper thread does this while the current one trains)."""
        for p in partitions:
            if p not in self.seen:
                self.seen[p] = ray.get(self.refs[p], timeout=self.timeout_s)

    def want(self, partition: int, upcoming: list[int]) -> None:
        pass

    def get(self, partition: int) -> dict:
        self.request([partition])
        return self.seen[partition]

    def release(self, partition: int) -> None:
        pass  # kept: the run's partitions live in the object store anyway


class StreamedPartitions:
    """File-source partitions read by tasks pinned to this replica's node, at most
    1 + `ahead` at a time (the one training and the read-ahead); a trained partition is let go
    (its ref dropped, so the object store frees it once the last batch cut from it is gone).
    The helper thread (grant requests) and the step loop both launch reads: a lock."""

    def __init__(self, plan: StreamPlan, ahead: int, timeout_s: float) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.plan, self.ahead, self.timeout_s = plan, ahead, max(timeout_s, READ_TIMEOUT_S)
        self.here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.reads: OrderedDict[int, Any] = OrderedDict()  # partition -> its read task's ref
        self.lock = threading.Lock()

    def new_pass(self) -> None:
        with self.lock:
            self.reads.clear()

    def _launch(self, partitions: list[int], bound: int) -> None:
        with self.lock:
            for p in partitions:
                if p in self.reads:
                    continue
                if len(self.reads) >= bound:
                    break
                self.reads[p] = read_partition_task.options(scheduling_strategy=self.here).remote(self.plan, p)

    def request(self, partitions: list[int]) -> None:
        """Granted partitions: read ahead while the bound allows."""
        self._launch(partitions, 1 + self.ahead)

    def want(self, partition: int, upcoming: list[int]) -> None:
        """`partition` is next: read it now whatever the bound, then what follows while it allows."""
        self._launch([partition], len(self.reads) + 1)
        self._launch(upcoming, 1 + self.ahead)

    def get(self, partition: int) -> dict:
        """The partition's rows, zero-copy from this node's object store; a RuntimeError naming
        the file when it could not be read."""
        self.want(partition, [])
        with self.lock:
            ref = self.reads[partition]
        lo, hi = self.plan.ranges[partition]
        where = f"partition {partition} ({', '.join(self.plan.files(lo, hi))})"
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None) or exc
            line = " ".join(str(cause).split()) if isinstance(cause, RuntimeError) else \
                f"{self.plan.field}: reading {where} failed: {type(cause).__name__}: {' '.join(str(cause).split())}"
            raise RuntimeError(line) from None
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"{self.plan.field}: {where} was not read within {self.timeout_s:.0f}s") from None
        except ray.exceptions.RayError as exc:  # the read task's process died (e.g. out of memory)
            raise RuntimeError(f"{self.plan.field}: reading {where} failed: {type(exc).__name__}: "
                               f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from None

    def release(self, partition: int) -> None:
        with self.lock:
            self.reads.pop(partition, None)


class PartitionReader:
    """The replica side: take the partitions the server grants this replica until it has none
    left this epoch, and cut them into batches. The next grant is requested, and the bytes of
    the partitions it grants pulled to this node (or, for a file source, read on it), on a
    helper thread while the current partition trains; batches are made by tensor indexing (no
    per-row Python); with a GPU, batches are pinned and copied asynchronously. `refs`: the
    in-memory partitions' refs, or a file source's plan (actors/partitions/reading.py); `read_ahead`: how
    many partitions of a file source are read ahead of the one training (data.prefetch_partitions);
    `tasks` (sandblaster's strategy.task_rows, policies/rules/gradient_tasks.py `partition_tasks`):
    the server leases tasks, not partitions: lease i is rows [lo, hi) of partition p's stored
    order, tasks[i] = (p, lo, hi), shuffled within itself; everything the reader says of a lease
    (`read`, `position`, `unreported`, `drop`) is then by task."""

    def __init__(self, server: "ServerAddress | Any", refs: "list | StreamPlan", rank: int, batch_size: int,
                 shuffle: bool, device: torch.device, timeout_s: float, read_ahead: int = 2,
                 tasks: Optional[list[tuple[int, int, int]]] = None):
        self.where = server if isinstance(server, ServerAddress) else ServerAddress(server)
        self.rank, self.batch_size, self.shuffle = rank, batch_size, shuffle
        self.span = False  # a partition's short last batch is completed from the next partition
        self.caller, self.calls = uuid.uuid4().hex[:12], 0  # every grant call carries a unique id
        self.device, self.timeout_s = device, timeout_s
        self.source = (StreamedPartitions(refs, read_ahead, timeout_s) if isinstance(refs, StreamPlan)
                       else StoredPartitions(refs, timeout_s))
        self.unreported: list[int] = []
        self.read: list[int] = []
        self.out: deque[list[tuple[int, int]]] = deque()  # each batch yielded and not trained yet: (partition, rows)
        self.trained: dict[int, int] = {}  # partition -> rows of its in-epoch order trained (a lease's skip counted)
        self.sizes: dict[int, int] = {}  # partition -> its rows
        self.drained = False  # the last grant said the pass's queue is empty (sandblaster: its tail)
        self.backups: set[int] = set()  # partitions granted this pass as backup copies
        self.dropped: set[int] = set()  # partitions whose rest this replica no longer reads (`drop`)
        self.passes = 0  # partitions() calls: a grant that comes back after its pass was left is not noted
        self.prefetch = ThreadPoolExecutor(1, thread_name_prefix="partition-prefetch")
        self.tasks = [tuple(int(v) for v in t) for t in tasks] if tasks is not None else None

    def stored(self, leased: int) -> int:
        """The stored partition a lease's number reads: itself, or its task's partition (`tasks`)."""
        return leased if self.tasks is None else self.tasks[leased][0]

    def span_of(self, leased: Optional[int], rows: int) -> tuple[int, int]:
        """The rows [lo, hi) of its stored partition (of `rows`) that a lease reads: all of them, or
        its task's slice; a RuntimeError where the slice does not fit (a plan of another dataset)."""
        if self.tasks is None:
            return 0, rows
        p, lo, hi = self.tasks[int(leased)]
        if not 0 <= lo < hi <= rows:
            raise RuntimeError(f"sandblaster: task {leased} is rows [{lo}, {hi}) of partition {p}, which has {rows}")
        return lo, hi

    def partitions(self, first: Optional[dict] = None) -> Iterator[tuple[dict, dict]]:
        """The partitions granted to this replica this pass, in order. A grant holds one or two
        partitions; when the replica starts the last one it holds, it asks for the next grant
        (reporting the partitions finished since its last request) unless the server said the
        queue is empty; the answer, and the granted partitions' bytes, arrive while the partition
        trains. The last completions are left in `self.unreported`: the replica returns them with
        its epoch result and the driver reports them (with the next `start_epoch`, or `finish`),
        which saves every replica a round trip per epoch. `first`: the grant the epoch starts
        with (`policies.decisions.leases.first_grant_messages`)."""
        self.unreported = []
        self.drained, self.backups, self.dropped = False, set(), set()
        self.passes += 1
        this = self.passes
        self.source.new_pass()
        grant = self._fetch(first) if first is not None else self._grant([], None)
        self._heard(grant)
        epoch = grant["leases"][0]["epoch"] if grant["leases"] else None
        finished = []
        while grant.get("pause"):  # a phase switch: stop here, ask again when resumed
            self.unreported = list(finished)
            yield PAUSE
            grant, finished = self._grant_heard(finished, epoch, this), []
        held, last = deque(grant["leases"]), grant["last"]
        kept = None  # `tasks`: the stored partition of the last task, kept while the next task is of it too
        while held:
            lease = held.popleft()
            stored = self.stored(lease["partition"])
            if kept is not None and kept != stored:
                self.source.release(kept)
            kept = None
            self.source.want(stored, [self.stored(x["partition"]) for x in held])
            pending = None
            if not held and not last:  # starting the last partition in hand: ask for more now
                pending, finished = self.prefetch.submit(self._grant_heard, finished, lease["epoch"], this), []
            yield lease, self.source.get(stored)
            if self.tasks is None:
                self.source.release(stored)  # a streamed partition is let go once trained
            else:  # let go once a task of another partition starts (a grant may be on its way), or the pass ends
                kept = stored
            finished.append(lease["partition"])
            if pending is not None:
                grant = pending.result(timeout=3 * self.timeout_s)  # a call, a wait for a rebuilt server, a call
                while grant.get("pause"):
                    self.unreported = list(finished)  # said with the pause: a replica moved off its node never resumes
                    yield PAUSE
                    grant, finished = self._grant_heard(finished, lease["epoch"], this), []
                held.extend(grant["leases"])
                last = grant["last"]
        if kept is not None:
            self.source.release(kept)
        self.unreported = finished

    def _heard(self, grant: dict) -> None:
        """What a grant says of the pass, noted as soon as it arrives (on the helper thread while a
        partition trains): the queue is empty (`drained`), the backup copies granted."""
        self.drained = self.drained or bool(grant.get("drained"))
        self.backups.update(x["partition"] for x in grant.get("leases", ()) if x.get("backup"))

    def _grant_heard(self, completed: list[int], epoch: Optional[int], pass_no: int) -> dict:
        """The next grant, noted if its pass (`pass_no`) is still the reader's: the helper thread's
        answer to a pass left part way (an interrupted epoch) says nothing of the next one."""
        grant = self._grant(completed, epoch)
        if pass_no == self.passes:
            self._heard(grant)
        return grant

    def drop(self, partition: int) -> None:
        """Read no more batches of `partition` this pass (sandblaster: another copy of the task is
        in); it is still reported completed, as its task is."""
        self.dropped.add(partition)

    def _grant(self, completed: list[int], epoch: Optional[int]) -> dict:
        """The next grant (reporting `completed`), asked again while the server has not yet
        started `epoch` (see PartitionServer.grant), for at most timeout_s."""
        self.calls += 1
        caller = f"{self.caller}:{self.calls}"  # the same id if sent again to a rebuilt server: applied once
        deadline, wait = time.monotonic() + self.timeout_s, 0.0005
        while True:
            try:
                grant = self._ask(self.where.handle.grant.remote(self.rank, completed, epoch, caller))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                self._reconnect(exc)
                deadline = time.monotonic() + self.timeout_s
                continue
            if not grant.get("retry"):
                return self._fetch(grant)
            if time.monotonic() > deadline:
                raise TimeoutError(f"epoch {epoch} did not start on the partition server within {self.timeout_s:.0f}s")
            time.sleep(wait)
            wait = min(2 * wait, 0.05)

    def _ask(self, ref: Any) -> Any:
        """`ref`'s answer within timeout_s. A server that is slow to answer may have been
        stopped and replaced by the driver: past each second without an answer, a newer
        incarnation is looked for (GetTimeoutError at once if there is one: the call goes to it)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            ready, _ = ray.wait([ref], timeout=max(0.0, min(ASK_SLICE_S, deadline - time.monotonic())))
            if ready:
                return ray.get(ref)
            where = self.where
            if time.monotonic() >= deadline or (where.name is not None and find_successor(
                    where.name, where.namespace, where.generation, where.handle, time.monotonic() + ASK_SLICE_S,
                    lambda h: h.incarnation.remote()) is not None):
                raise ray.exceptions.GetTimeoutError(f"the partition server did not answer within {self.timeout_s:.0f}s")

    def _reconnect(self, error: BaseException) -> None:
        """The server died or stopped answering: wait (at most timeout_s) for the incarnation
        the driver starts from its journal and use it; `error` again if none comes."""
        where = self.where
        if where.name is None:
            raise error
        found = wait_for_successor(where.name, where.namespace, where.generation, where.handle, self.timeout_s,
                                   lambda h: h.incarnation.remote())
        if found is None:
            raise error
        where.handle, where.generation = found

    def _fetch(self, grant: dict) -> dict:
        """Start getting the granted partitions' rows (StoredPartitions / StreamedPartitions)."""
        self.source.request([self.stored(lease["partition"]) for lease in grant["leases"]])
        return grant

    def epoch_batches(self, first: Optional[dict] = None) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]]:
        """Every batch of the partitions granted to this replica this pass, in order: (x, y, row
        positions in the partition, the partition's columns; `part["ids"][positions]` are the
        row ids). The partitions read whole are listed in `self.read` when the pass ends."""
        self.read = []
        self.out.clear()
        self.trained, self.sizes = {}, {}
        carry = None  # span: a partition's last rows, waiting to be joined by the next one's first
        carried: list[tuple[int, int]] = []  # what the carry holds: (partition, rows)
        for item in self.partitions(first):
            if is_pause(item):
                if carry is not None:  # the switch comes at this boundary: the rows go first
                    self.out.append(carried)
                    yield carry
                    carry = None
                yield PAUSE
                continue
            lease, part = item
            p = lease["partition"]
            self.sizes[p] = int(lease["rows"])
            self.trained.setdefault(p, int(lease.get("skip", 0)))
            short = self.batch_size - batch_rows(carry[1]) if carry is not None else None
            for x, y, idx in self.batches(lease, part, short):
                if carry is not None:  # the first batch of this partition completes the carried rows
                    x, y, idx, part_ids = joined(carry, (x, y, idx, part))
                    self.out.append(carried + [(p, len(idx) - batch_rows(carry[1]))])
                    carry = None
                    yield x, y, idx, part_ids
                elif self.span and batch_rows(y) < self.batch_size:  # the rest: carried into the next
                    carry, carried = (x, y, idx, part), [(p, len(idx))]
                else:
                    self.out.append([(p, len(idx))])
                    yield x, y, idx, part
            self.read.append(p)
        if carry is not None:
            self.out.append(carried)
            yield carry

    def trained_one(self) -> None:
        """The oldest batch yielded and not yet trained was trained (the step loop says so after
        each step on a batch): its rows count in `position()`."""
        for p, n in self.out.popleft():
            self.trained[p] = self.trained.get(p, 0) + n

    def position(self) -> ReaderPosition:
        """Where this replica stands in its pass: the partitions trained whole (`full`) and the
        ones trained part way (`partial`: partition -> rows of its in-epoch order trained), for
        a checkpoint taken inside the epoch (the rows it still holds are served again from there)."""
        full = sorted(p for p, n in self.trained.items() if n >= self.sizes.get(p, n + 1))
        partial = {p: n for p, n in self.trained.items() if 0 < n < self.sizes.get(p, n + 1)}
        return ReaderPosition(full, partial)

    def task_batches(self, partition: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every row of `partition` (with `tasks`: of that task's slice), in batches of batch_size,
        for a task computed outside the epoch's loop (sandblaster's fill-in of a task a shard
        lacks): whatever this pass dropped of it (`drop`: another copy was in then, on shards one
        of which may since have been rebuilt without it) or trained before a restart, it is read
        whole. Yields (x, y)."""
        stored = self.stored(partition)
        part = self.source.get(stored)
        try:
            for x, y, _ in self.batches({"partition": partition, "seed": 0}, part, whole=True):
                yield x, y
        finally:
            self.source.release(stored)

    def batches(self, lease: dict, part: dict, first: Optional[int] = None,
                whole: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """One partition in this epoch's in-partition order, cut into batches of batch_size
        with a short last batch: every row exactly once. batch_size is read again for every
        batch (a load-balanced allreduce changes it as the replicas' speeds move); `first`: the
        size of the first batch (the rows a carried remainder still needs, `span`); `whole`: read
        to the end even if the partition was dropped this pass. With `tasks`, the lease's slice
        of the partition only, in its own shuffled order. Yields (x, y, row positions in the
        partition)."""
        x, y = as_tensors(part["x"]), as_tensors(part["y"])
        lo, hi = self.span_of(lease.get("partition"), batch_rows(y))
        rows = hi - lo
        order = lo + (torch.from_numpy(np.random.default_rng(lease["seed"]).permutation(rows)) if self.shuffle
                      else torch.arange(rows))
        cpu = self.device.type == "cpu"
        at = start = min(int(lease.get("skip", 0)), rows)  # rows trained before a restart: not again
        while at < rows and (whole or lease.get("partition") not in self.dropped):
            size = first if at == start and first else self.batch_size
            idx = order[at : at + size]
            at += len(idx)
            if cpu:  # index_select gathers rows ~2.5x faster than x[idx] advanced indexing on CPU
                yield take(x, idx), take(y, idx), idx
            else:  # GPU: pinned host batches, copied asynchronously
                yield to_device(take(x, idx), self.device, pin=True), to_device(take(y, idx), self.device, pin=True), idx


def joined(carry: tuple, batch: tuple) -> tuple:
    """A carried remainder and the next partition's first batch as one batch: (x, y, positions
    0..n-1, {"ids": the rows' ids}) (the ids of a joined batch are listed whole, as a trace
    reads them: part["ids"][positions])."""
    (cx, cy, cidx, cpart), (x, y, idx, part) = carry, batch
    cat = lambda a, b: ({k: torch.cat([a[k], b[k]]) for k in a} if isinstance(a, dict)  # noqa: E731
                         else torch.cat([a, b]))
    x, y = cat(cx, x), cat(cy, y)
    if cpart.get("ids") is None or part.get("ids") is None:
        return x, y, torch.arange(batch_rows(y)), {}
    ids = np.concatenate([np.asarray(cpart["ids"])[cidx.numpy()], np.asarray(part["ids"])[idx.numpy()]])
    return x, y, torch.arange(len(ids)), {"ids": ids}
