"""ProcessGroupReducer: how an allreduce replica all-reduces over its torch.distributed (gloo or
NCCL) process group, with a timeout on every wait and an abort a peer's death turns into
`Interrupted` at once; and the port a rendezvous store listens on."""
from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any, NamedTuple, Optional

import torch

from policies.rules.modes import Interrupted


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]



NCCL_POLL_S = 0.0002  # how often a wait on an NCCL collective asks whether it is done


def group_backend(device: torch.device, gpus_per_replica: float) -> str:
    """The collective backend of an allreduce replica: NCCL when it trains on a GPU of its own
    (gpus_per_replica >= 1), gloo otherwise: on the CPU, and when replicas share a GPU
    (0 < gpus_per_replica < 1: NCCL cannot put two ranks on one device; gloo sums CUDA tensors
    through host memory)."""
    return "nccl" if device.type == "cuda" and gpus_per_replica >= 1 else "gloo"


def new_process_group(store: Any, group_rank: int, world_size: int, backend: str, timeout: timedelta,
                      default: bool = False) -> Any:
    """A process group of `backend` over `store` (a generation's PrefixStore), as a replica joins one.
    `default`: the process's default group (fsdp: torch's DTensor and FSDP collectives address
    registered groups only), the previous generation's destroyed first (no collective of it is
    in flight: the replica left it when a step failed, or it is between segments)."""
    import torch.distributed as dist

    if default:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group(backend, store=store, rank=group_rank, world_size=world_size, timeout=timeout)
        return dist.group.WORLD
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, group_rank, world_size)
    return dist.ProcessGroupGloo(store, group_rank, world_size, timeout)


class ProcessGroupReducer:
    """Sums a bucket across replicas with an asynchronous all-reduce on this generation's gloo
    process group, and broadcasts group rank 0's buffers.

    Gloo cannot abort a collective, and a member that is not a dead rank's ring neighbour would
    wait for the full collective timeout. So every wait is cut into WAIT_SLICE_S slices; between
    slices the replica looks for the generation's abort flag in its TCP store. The first member
    whose collective fails (a neighbour of the dead one: at once) sets the flag, and every other
    member leaves its wait within a slice. Failed or aborted waits raise `Interrupted` (never
    inside the backward pass's hooks). Each generation has its own store and group; the old
    group is abandoned, not destroyed (destroying it would wait for its stuck work)."""

    WAIT_SLICE_S = 0.2

    def __init__(self, link: Optional[EmulatedLink] = None) -> None:
        self.link = link  # faults.link_gbps: every collective held to the emulated link's time
        self.pg = None
        self.store = None
        self.timeout_s = 60.0
        self.abandoned: list = []  # past generations' groups and stores: freeing one waits for its stuck work

    def configure(self, store, pg, timeout_s: float, keep: Any = None) -> None:
        if self.pg is not None:
            self.abandoned.append((self.pg, self.store, getattr(self, "_keep", None)))
        self.store, self.pg, self.timeout_s, self._keep = store, pg, timeout_s, keep

    def group(self) -> tuple[int, int]:
        """(This replica's rank in the group, the group's size); (0, 1) before it joined one."""
        return (self.pg.rank(), self.pg.size()) if self.pg is not None else (0, 1)

    def start(self, tensor: torch.Tensor):
        try:
            work = self.pg.allreduce([tensor])
        except Exception as exc:  # the group is already broken: report it at wait()
            return exc
        if self.link is not None:
            return Paced(work, self.link.reserve(tensor.numel() * tensor.element_size(), self.pg.size()))
        return work

    def wait(self, handle) -> None:
        if isinstance(handle, Paced):
            self.wait(handle.work)
            delay = handle.done_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            return
        if isinstance(handle, Exception):
            self.abort()
            raise Interrupted(f"all-reduce failed: {first_line(handle)}")
        deadline = time.monotonic() + self.timeout_s
        if type(self.pg).__name__ == "ProcessGroupNCCL":  # NCCL's wait(timeout) fails a slow collective: poll instead
            while not handle.is_completed():  # True too once it failed; wait() below raises then
                if self.aborted():
                    raise Interrupted("collective aborted: another member saw the group fail")
                if time.monotonic() > deadline:
                    self.abort()
                    raise Interrupted(f"collective timed out after {self.timeout_s:.0f}s")
                time.sleep(NCCL_POLL_S)
            try:
                handle.wait()
                return
            except Exception as exc:
                self.abort()
                raise Interrupted(f"collective failed: {first_line(exc)}") from None
        slice_ = timedelta(seconds=self.WAIT_SLICE_S)
        while True:
            try:
                handle.wait(slice_)
                return
            except Exception as exc:
                if "timed out" not in str(exc).lower():
                    self.abort()
                    raise Interrupted(f"collective failed: {first_line(exc)}") from None
            if self.aborted():
                raise Interrupted("collective aborted: another member saw the group fail")
            if time.monotonic() > deadline:  # a member stopped answering (hung): this generation is over
                self.abort()
                raise Interrupted(f"collective timed out after {self.timeout_s:.0f}s")

    def broadcast(self, tensor: torch.Tensor) -> None:
        try:
            work = self.pg.broadcast(tensor, 0)
            if self.link is not None:
                work = Paced(work, self.link.reserve(tensor.numel() * tensor.element_size(), self.pg.size()))
        except Exception as exc:
            work = exc
        self.wait(work)

    def exchange(self, tensor: torch.Tensor, peers: list[int]) -> list[torch.Tensor]:
        """Send `tensor` to each of `peers` (ranks of this group) and receive theirs (gossip's
        neighbour averaging): every send and receive is posted before any wait (no order two
        neighbours could deadlock on), each waited as a collective is (a dead peer:
        `Interrupted`). Returns the peers' tensors, in `peers` order."""
        got = [torch.empty_like(tensor) for _ in peers]
        works: list = []
        try:
            for peer, buf in zip(peers, got):
                works.append(self.pg.send([tensor], peer, 0))
                works.append(self.pg.recv([buf], peer, 0))
        except Exception as exc:  # the group is already broken
            works.append(exc)
        for work in works:
            self.wait(work)
        return got

    def arrivals(self) -> "StoreArrivals":
        """Counters in this generation's store (backup replicas' places: policies/rules/backup.py)."""
        return StoreArrivals(self.store)

    def abort(self) -> None:
        """Tell the other members this generation is over (best effort: the store's host may be
        the one that died, which the others notice by themselves)."""
        with contextlib.suppress(Exception):
            self.store.set("abort", "1")

    def aborted(self) -> bool:
        try:
            return bool(self.store.check(["abort"]))
        except Exception:  # the store's host is gone: so is the generation
            return True


class StoreArrivals:
    """policies/rules/backup.py's `Arrivals` on a generation's TCP store: one round trip per call. A
    store that no longer answers (its host died) is the generation's end: `Interrupted`."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def add(self, key: str, amount: int) -> int:
        try:
            return int(self.store.add(key, amount))
        except Exception as exc:
            raise Interrupted(f"group store unreachable: {first_line(exc)}") from None

    def delete(self, key: str) -> None:
        with contextlib.suppress(Exception):
            self.store.delete_key(key)


class Paced(NamedTuple):
    """A collective on an emulated link: done no sooner than `done_at` (time.perf_counter)."""

    work: Any
    done_at: float


class EmulatedLink:
    """faults.link_gbps: a slower network than the real one, for benchmarks. A collective of
    `nbytes` among p replicas occupies the link for latency + 2 (p - 1) / p x nbytes x 8 / bps
    seconds (a ring all-reduce's traffic per link); collectives queue on the link one after
    another, as buckets started during the backward pass share one NIC."""

    def __init__(self, gbps: float, latency_us: float = 0.0) -> None:
        self.bps, self.latency_s = gbps * 1e9, latency_us * 1e-6
        self.free_at = 0.0

    def seconds(self, nbytes: int, p: int) -> float:
        return self.latency_s + (2 * (p - 1) / p * nbytes * 8 / self.bps if p > 1 else 0.0)

    def reserve(self, nbytes: int, p: int) -> float:
        """Queue a transfer now; returns when it is through (time.perf_counter)."""
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + self.seconds(nbytes, p)
        return self.free_at
