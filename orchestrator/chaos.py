"""Fault injection for chaos tests and benchmarks: one helper, a fault kind, a target, a time
or a step.

    from orchestrator.chaos import Fault, FaultInjector
    with FaultInjector(lambda: trainer.controller, [Fault("kill_replica", target=1, at_step=40)]) as inj:
        result = trainer.fit()
    inj.fired  # [{"kind", "target", "t_wall", "pid", ...}] in the order they happened

Kinds (all act from outside, as the real thing would):
- `kill_replica`: SIGKILL the replica's process (its pid, as Ray reported it at start);
- `hang_replica`: SIGSTOP the replica's process: it stops answering but its sockets stay open,
  as a replica stuck in a system call or a livelocked kernel would;
- `kill_shard`: kill a parameter shard's actor (ray.kill: its process dies as on SIGKILL).
Triggers: `at_step` (once a progress row reports that global step or a later one: rows come
every tracking.log_every_steps steps, and are sent at once with tracking.progress_interval_s 0,
so the fault lands within log_every_steps of the step) or `at_s` (seconds after training
starts).
A fault whose target is a replica kills the process that holds that rank at the time it fires,
so two faults on the same rank hit the original and then its replacement.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import ray

KINDS = ("kill_replica", "hang_replica", "kill_shard")


@dataclass(frozen=True)
class Fault:
    kind: str
    target: int  # replica rank, or shard index
    at_step: Optional[int] = None
    at_s: Optional[float] = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {KINDS}, got {self.kind!r}")
        if (self.at_step is None) == (self.at_s is None):
            raise ValueError("give a fault exactly one of at_step or at_s")


class FaultInjector:
    """Fires `faults` in order against the controller `controller()` returns (a Controller, or a
    callable: an ElasticTrainer's controller exists only once fit() runs)."""

    POLL_S = 0.005

    def __init__(self, controller: Any, faults: list[Fault], timeout_s: float = 600.0) -> None:
        self._controller: Callable[[], Any] = controller if callable(controller) else (lambda: controller)
        self.faults = list(faults)
        self.timeout_s = timeout_s
        self.fired: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="fault-injector")

    def _due(self, ctl: Any, fault: Fault, t_start: float) -> bool:
        if fault.at_s is not None:
            return time.monotonic() - t_start >= fault.at_s
        progress = getattr(ctl, "progress", None) or {}
        return bool(progress) and max(progress.values()) >= fault.at_step

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        t_start = None
        pending = list(self.faults)
        while pending and not self._stop.is_set() and time.monotonic() < deadline:
            ctl = self._controller()
            group = getattr(ctl, "group", None)
            if group is None or not group.pids:
                time.sleep(self.POLL_S)
                continue
            t_start = t_start or time.monotonic()
            fault = pending[0]
            if self._due(ctl, fault, t_start):
                try:
                    self.fired.append(self._fire(ctl, fault))
                except Exception as exc:  # e.g. the target is being replaced right now: try again
                    time.sleep(0.05)
                    if time.monotonic() > deadline:
                        self.fired.append({"kind": fault.kind, "target": fault.target, "error": str(exc)})
                    continue
                pending.pop(0)
            time.sleep(self.POLL_S)

    def _fire(self, ctl: Any, fault: Fault) -> dict[str, Any]:
        if fault.kind == "kill_shard":
            ray.kill(ctl.shard_group.handles[fault.target], no_restart=True)
            return {"kind": fault.kind, "target": fault.target, "t_wall": time.time(), "t_perf": time.perf_counter()}
        pid = ctl.group.pids[fault.target]
        os.kill(pid, signal.SIGKILL if fault.kind == "kill_replica" else signal.SIGSTOP)
        return {"kind": fault.kind, "target": fault.target, "pid": pid, "t_wall": time.time(),
                "t_perf": time.perf_counter(), "step": max(getattr(ctl, "progress", {}).values(), default=0)}

    def __enter__(self) -> "FaultInjector":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
