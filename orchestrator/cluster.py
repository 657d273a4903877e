"""Connecting to Ray: an existing session, RAY_ADDRESS, or an embedded local cluster."""
from __future__ import annotations

import logging
import os

import ray


def connect(logical_cpus: float) -> bool:
    """Make sure Ray is up; returns True when this call started it (so the caller shuts it down).

    Inside a process that already called ray.init() that cluster is used, as Ray's own
    libraries do. With RAY_ADDRESS set (e.g. under `ray job submit`) the job joins that
    cluster. Otherwise a local cluster is started with at least `logical_cpus` CPUs declared,
    so replicas fit even on a small machine; address="local" keeps a stray cluster on the
    same machine from being picked up by accident.
    """
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.WARNING)
        return False
    num_cpus = max(os.cpu_count() or 1, int(-(-logical_cpus // 1)))
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    return True
