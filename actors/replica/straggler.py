"""Where a replica trains and how a deliberate straggler sleeps (faults.slow_replicas): the
device it reserved, and the delay the slow windows active now add to a step (pure)."""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import ray
import torch

LATE_POLL_S = 0.005  # backups: how often a deliberate straggler's delay asks whether it is late


def replica_device(gpus_per_replica: float) -> torch.device:
    """The device a replica trains on: its GPU when it reserved one, else the CPU. A replica
    given GPUs by Ray that torch cannot see is an error, never a silent fall back to the CPU."""
    if gpus_per_replica <= 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"scaling.gpus_per_replica is {gpus_per_replica} but torch sees no CUDA device on "
                           f"node {ray.util.get_node_ip_address()} (torch {torch.__version__})")
    return torch.device("cuda")


def straggler_delay(windows: list[dict[str, Any]], step: int, elapsed_s: float, step_s: float) -> float:
    """Seconds the windows active at `step`, `elapsed_s` into training, add to a step that took
    `step_s`: a fixed delay_s, or (factor - 1) x step_s, summed over the active windows."""
    delay = 0.0
    for w in windows:
        if w["from_step"] is not None and step < w["from_step"]:
            continue
        if w["to_step"] is not None and step >= w["to_step"]:
            continue
        if w["from_s"] is not None and elapsed_s < w["from_s"]:
            continue
        if w["to_s"] is not None and elapsed_s >= w["to_s"]:
            continue
        delay += w["delay_s"] if w["delay_s"] is not None else (w["factor"] - 1.0) * step_s
    return delay


def sleep_unless_late(delay: float, late: Optional[Callable[[], bool]] = None) -> None:
    """Sleep `delay` seconds; with `late`, asked every LATE_POLL_S, until it says True."""
    if delay <= 0:
        return
    if late is None:
        time.sleep(delay)
        return
    end = time.perf_counter() + delay
    while not late():
        left = end - time.perf_counter()
        if left <= 0:
            return
        time.sleep(min(left, LATE_POLL_S))
