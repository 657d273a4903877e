"""The live half of the epoch the driver reads: each member's open epoch stream (the Ray
generator its `run_epoch` call returns), when the driver last heard from it (its hang clock),
and the partition server's start-of-epoch call not yet checked.

The controller's states hold the epoch as a value (orchestrator/control/states.py
EpochSegment: its number, when it began, whether its streams are open, its pass); what the
streams said is the epoch's record (orchestrator/control/epoch_record.py). A run has one reader
(the fleet's); a new epoch clears it."""
from __future__ import annotations

import time
from typing import Any, Optional

import ray


class EpochReader:
    def __init__(self) -> None:
        self.streams: dict[int, Any] = {}  # rank -> its open run_epoch stream
        self.heard: dict[int, float] = {}  # rank -> perf_counter of its last item (its hang clock)
        self.started: Any = None  # the server's start_epoch call, checked once the replicas are done

    def clear(self) -> None:
        """A new epoch: no stream open, no clock running, no server call outstanding."""
        self.streams, self.heard, self.started = {}, {}, None

    def open(self, rank: int, stream: Any) -> None:
        self.streams[rank] = stream
        self.heard[rank] = time.perf_counter()

    def ended(self, rank: int) -> None:
        """The member's stream ended (its segment's end was its last item)."""
        self.streams.pop(rank, None)

    def lost(self, rank: int) -> None:
        """The member failed: its stream and its clock are dropped."""
        self.streams.pop(rank, None)
        self.heard.pop(rank, None)

    def hear(self, rank: int) -> None:
        self.heard[rank] = time.perf_counter()

    def restart_clocks(self) -> None:
        """Every member's hang clock starts again now (a replica blocked on the partition server
        or a shard being rebuilt makes no progress meanwhile; a state that read no stream)."""
        now = time.perf_counter()
        for rank in self.heard:
            self.heard[rank] = now

    def silent(self, limit_s: float, now: Optional[float] = None) -> list[tuple[int, float]]:
        """(rank, seconds silent) of every member with an open stream not heard for over `limit_s`."""
        now = time.perf_counter() if now is None else now
        return [(r, now - t) for r, t in self.heard.items() if now - t > limit_s and r in self.streams]

    def ready(self, wait_s: float) -> list[tuple[int, Any]]:
        """(rank, stream) of every stream with an item waiting: the first within `wait_s`, then all
        others already ready (not one per call: a stream read later than another is not a
        quieter replica)."""
        streams = list(self.streams.values())
        first, rest = ray.wait(streams, num_returns=1, timeout=wait_s)
        if first and rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            first += more
        ready = set(first)
        return [(rank, s) for rank, s in list(self.streams.items()) if s in ready]

    def take_started(self) -> Any:
        """The server's start_epoch call (None: none outstanding), handed to be checked once."""
        started, self.started = self.started, None
        return started

    def check_started(self, server: Any, epoch: int) -> None:
        """The server's start_epoch call, if still outstanding, answered (its error raised): before
        the driver reports what the epoch's members completed (`server`: the ServerLink)."""
        started = self.take_started()
        if started is not None:
            server.result(started, f"partition server, start of epoch {epoch}")
