"""Connecting to Ray: an existing session, RAY_ADDRESS, or an embedded local cluster; and
whether the connected cluster can hold the job's replicas."""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

import ray

from orchestrator.checks import bounded
from orchestrator.errors import ConfigError, TrainingError

RESOURCES_TIMEOUT_S = 30.0
ROOM_POLL_S = 1.0
LOCAL_CPUS_PER_CORE = 4  # the most logical CPUs a local cluster declares per core (replicas share cores)


def connect(logical_cpus: float) -> bool:
    """Make sure Ray is up; returns True when this call started it (so the caller shuts it down).

    Inside a process that already called ray.init() that cluster is used, as Ray's own
    libraries do. With RAY_ADDRESS set (e.g. under `ray job submit`) the job joins that
    cluster. Otherwise a local cluster is started with at least `logical_cpus` CPUs declared,
    so replicas fit even on a small machine; address="local" keeps a stray cluster on the
    same machine from being picked up by accident. More than LOCAL_CPUS_PER_CORE per core is
    a ConfigError before Ray starts: so many replica processes on so few cores is a mistake.
    """
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.WARNING)
        return False
    cores = os.cpu_count() or 1
    if logical_cpus > LOCAL_CPUS_PER_CORE * cores + 1e-9:
        raise ConfigError(f"config error: scaling: the job asks for {logical_cpus:g} logical CPUs (scaling.replicas x "
                          f"scaling.cpus_per_replica); a local Ray cluster started here declares at most "
                          f"{LOCAL_CPUS_PER_CORE} per core, {LOCAL_CPUS_PER_CORE * cores} on this machine's {cores} "
                          "cores: ask for fewer, or join a larger cluster (RAY_ADDRESS)")
    num_cpus = max(cores, int(-(-logical_cpus // 1)))
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    return True


def check_fits(replicas: int, cpus_per_replica: float, gpus_per_replica: float) -> None:
    """The connected cluster can hold the replicas (shards and the partition server reserve no
    CPU): ConfigError naming the short resource otherwise, instead of actors that never start."""
    short = shortfall(replicas, cpus_per_replica, gpus_per_replica)
    if short is not None:
        raise ConfigError(short)


def shortfall(replicas: int, cpus_per_replica: float, gpus_per_replica: float) -> Optional[str]:
    """Why the connected cluster cannot hold the replicas now (the config error's line), or None."""
    def look() -> tuple[dict, list[dict]]:
        return ray.cluster_resources(), [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]

    try:
        total, nodes = bounded(look, RESOURCES_TIMEOUT_S, "the Ray cluster's resources")
    except TimeoutError as exc:
        raise TrainingError(str(exc)) from None
    for key, each in (("CPU", cpus_per_replica), ("GPU", gpus_per_replica)):
        if each <= 0:
            continue
        need, have = replicas * each, total.get(key, 0.0)
        if need > have + 1e-9:
            return (f"config error: scaling: {replicas} replicas x {each:g} {key} need {need:g} {key}, "
                    f"the cluster has {have:g}")
        largest = max((n.get(key, 0.0) for n in nodes), default=have)
        if each > largest + 1e-9:
            field = "cpus_per_replica" if key == "CPU" else "gpus_per_replica"
            return (f"config error: scaling.{field}: one replica needs {each:g} {key}, "
                    f"the largest node has {largest:g}")
    return None


def wait_for_room(replicas: int, cpus_per_replica: float, gpus_per_replica: float, timeout_s: float,
                  say: Callable[[str], None] = print) -> float:
    """A joined cluster that cannot hold the starting replicas yet (an autoscaling cluster that
    starts from zero worker nodes): ask Ray's autoscaler for one bundle per replica and wait up
    to `timeout_s` for the room, saying so once; the request is taken back once the room is
    there (the replicas take it within seconds) or the wait is given up. ConfigError naming
    what is short, and how long it waited, if the room never came. Returns the seconds waited."""
    short = shortfall(replicas, cpus_per_replica, gpus_per_replica)
    if short is None:
        return 0.0
    if timeout_s <= 0:
        raise ConfigError(short)
    from ray.autoscaler.sdk import request_resources

    bundle = {k: v for k, v in (("CPU", cpus_per_replica), ("GPU", gpus_per_replica)) if v > 0}
    t0 = time.monotonic()
    bounded(lambda: request_resources(bundles=[bundle] * replicas), RESOURCES_TIMEOUT_S, "the autoscaler request")
    say(f"waiting up to {timeout_s:g}s (scaling.wait_for_room_s) for the autoscaler: "
        f"{short.removeprefix('config error: ')}; asked for {replicas} x {bundle}")
    try:
        while short is not None:
            if time.monotonic() - t0 > timeout_s:
                raise ConfigError(f"{short} (waited {timeout_s:g}s for the autoscaler: scaling.wait_for_room_s)")
            time.sleep(ROOM_POLL_S)
            short = shortfall(replicas, cpus_per_replica, gpus_per_replica)
    finally:
        try:
            bounded(lambda: request_resources(bundles=[]), RESOURCES_TIMEOUT_S, "the autoscaler request")
        except Exception:  # the cluster may be going away; nothing to take back then
            pass
    waited = time.monotonic() - t0
    say(f"room for {replicas} replicas after {waited:.1f}s")
    return waited


def beside_driver():
    """Where the run's small actors (partition server, parameter shards; no CPU reserved) go: the
    driver's node, so losing a worker node (preemption, a resize) loses replicas only. A hard
    affinity: with a soft one Ray placed such actors on other nodes when the driver's node has
    no CPU (a head started with num_cpus=0), 0 CPU asked or not."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def node_local(path: str) -> Optional[str]:
    """A warning when `path` (checkpoint.storage or a local tracking store) is a path on this
    node of a cluster with others: a driver started on another node will not find what is
    written there. None for a URI, or on a one-node cluster."""
    if "://" in path and not path.startswith("sqlite:"):
        return None
    try:
        alive = [n for n in bounded(ray.nodes, RESOURCES_TIMEOUT_S, "the Ray cluster's nodes") if n.get("Alive")]
    except TimeoutError:
        return None  # the cluster's view is not at hand: no warning rather than a wait
    if len(alive) < 2:
        return None
    return (f"{path} is a path on this node ({ray.util.get_node_ip_address()}), one of {len(alive)} nodes: "
            "a driver on another node (a job placed elsewhere, a new head) will not find it; a shared "
            "filesystem or a URI (s3://, gs://) is found from every node")
