"""Fault injection for tests: one helper that kills a replica's process once training reaches a
given step, whichever way the run is driven (a Controller, or ElasticTrainer.fit)."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import ray


class KillReplica:
    """Kill replica `rank` (ray.kill: the process dies as on a SIGKILL) as soon as any replica
    has reported step `at_step`. `controller` is a Controller or a callable returning one (an
    ElasticTrainer's controller exists only once fit() runs). Use as a context manager around
    the run; `killed_at` is the perf_counter time of the kill (None if it never happened)."""

    def __init__(self, controller: Any, rank: int, at_step: int, timeout_s: float = 120.0) -> None:
        self._controller: Callable[[], Any] = controller if callable(controller) else (lambda: controller)
        self.rank, self.at_step, self.timeout_s = rank, at_step, timeout_s
        self.killed_at: Optional[float] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            ctl = self._controller()
            progress = getattr(ctl, "progress", None) or {}
            if progress and max(progress.values()) >= self.at_step:
                ray.kill(ctl.replicas[self.rank], no_restart=True)
                self.killed_at = time.perf_counter()
                return
            time.sleep(0.01)

    def __enter__(self) -> "KillReplica":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
