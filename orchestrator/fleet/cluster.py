"""Connecting to Ray: an existing session, RAY_ADDRESS, or an embedded local cluster; and
whether the connected cluster can hold the job's replicas; its nodes as the run sees them."""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Callable, Optional

import ray

from orchestrator.checks import bounded, one_line
from orchestrator.errors import ConfigError, TrainingError

RESOURCES_TIMEOUT_S = 30.0
RAY_ADDRESS_WAIT_S = 20.0  # a cluster to join may refuse connections this long (a head restarting), then: bad input
RAY_ADDRESS_TRY_S = 3.0  # one connection attempt
RAY_ADDRESS_RETRY_S = 1.0  # between attempts
ROOM_POLL_S = 1.0
LOCAL_CPUS_PER_CORE = 4  # the most logical CPUs a local cluster declares per core (replicas share cores)


def connect(logical_cpus: float) -> bool:
    """Make sure Ray is up; returns True when this call started it (so the caller shuts it down).

    Inside a process that already called ray.init() that cluster is used, as Ray's own
    libraries do. With RAY_ADDRESS set (e.g. under `ray job submit`) the job joins that
    cluster once it accepts a connection (check_reachable: a ConfigError naming the address
    when it does not, or is not an address). Otherwise a local cluster is started with at
    least `logical_cpus` CPUs declared, so replicas fit even on a small machine;
    address="local" keeps a stray cluster on the same machine from being picked up by
    accident. More than LOCAL_CPUS_PER_CORE per core is a ConfigError before Ray starts: so
    many replica processes on so few cores is a mistake.
    """
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        check_reachable(address)
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except ConnectionError as exc:  # found by Ray's own checks after ours
            raise ConfigError(f"config error: RAY_ADDRESS: cannot join the Ray cluster at {address} "
                              f"({one_line(exc)})") from None
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


def check_reachable(address: str) -> None:
    """RAY_ADDRESS names a cluster that accepts a connection within RAY_ADDRESS_WAIT_S, or a
    ConfigError naming the address: ray.init would otherwise retry for minutes, printing only
    its own warnings. `auto` is the cluster Ray finds on this machine; `ray://host:port` is a
    Ray Client server; `local` and other schemes are left to Ray."""
    shown = address
    if address == "auto":
        try:
            found = local_cluster_address()
        except ConnectionError:
            raise ConfigError("config error: RAY_ADDRESS: auto: no running Ray cluster found on this machine; "
                              "start one, or set RAY_ADDRESS to its host:port") from None
        if found is None:  # Ray's lookup moved: let ray.init find it
            return
        address, shown = found, f"{found} (found by auto)"
    endpoint = gcs_endpoint(address)
    if endpoint is None:
        return
    why = _refusal(*endpoint, RAY_ADDRESS_WAIT_S)
    if why is not None:
        raise ConfigError(f"config error: RAY_ADDRESS: no Ray cluster answers at {shown} ({why} for "
                          f"{RAY_ADDRESS_WAIT_S:g}s); start it, or unset RAY_ADDRESS to start a local cluster")


def gcs_endpoint(address: str) -> Optional[tuple[str, int]]:
    """(host, port) that `address` (a RAY_ADDRESS) connects to; None where Ray decides alone
    (`local`, a scheme other than ray://, ray:// without a port); ConfigError when it cannot be
    an address: no port, or an HTTP address (a dashboard's, which job submission takes)."""
    scheme, sep, rest = address.partition("://")
    if sep and scheme in ("http", "https"):
        raise ConfigError(f"config error: RAY_ADDRESS: {address} is an HTTP address (a dashboard's); joining a "
                          "cluster takes its GCS address host:port (default port 6379) or ray://host:port")
    if sep and scheme != "ray" or address == "local":
        return None
    host, colon, port = (rest if sep else address).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:6379
    if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
        if sep:
            return None
        raise ConfigError(f"config error: RAY_ADDRESS: {address!r} is not host:port (the cluster's GCS "
                          "address, e.g. 10.0.0.5:6379), auto, or ray://host:port")
    return host, int(port)


def local_cluster_address() -> Optional[str]:
    """The host:port of the cluster `RAY_ADDRESS=auto` joins (the newest one started on this
    machine); ConnectionError when there is none; None when Ray no longer offers the lookup."""
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:
        return None
    return canonicalize_bootstrap_address("auto")


def _refusal(host: str, port: int, wait_s: float) -> Optional[str]:
    """None once host:port accepts a TCP connection; else, after trying for `wait_s` seconds, why
    it did not (the last attempt's error: connection refused, timed out, unknown host)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            timeout = min(RAY_ADDRESS_TRY_S, max(0.1, deadline - time.monotonic()))
            with socket.create_connection((host, port), timeout=timeout):
                return None
        except OSError as exc:
            why = (exc.strerror or str(exc) or type(exc).__name__).lower()
        if time.monotonic() + RAY_ADDRESS_RETRY_S >= deadline:
            return why
        time.sleep(RAY_ADDRESS_RETRY_S)


@dataclass(frozen=True)
class NodeView:
    """One node as Ray's GCS lists it: alive or not, its resources (total and free) and its
    raylet's address."""
    node_id: str
    alive: bool
    total: dict[str, float]
    free: dict[str, float]
    address: str = ""
    port: int = 0


def nodes() -> list[NodeView]:
    """Every node Ray knows of, alive or dead, with what each has free (asks the GCS: call it
    through a timeout, e.g. a Lane)."""
    from ray._private.state import available_resources_per_node

    listed, free = ray.nodes(), available_resources_per_node()
    return [NodeView(n["NodeID"], bool(n.get("Alive")), dict(n.get("Resources") or {}), dict(free.get(n["NodeID"], {})),
                     n.get("NodeManagerAddress", ""), int(n.get("NodeManagerPort") or 0)) for n in listed]


def check_fits(replicas: int, cpus_per_replica: float, gpus_per_replica: float) -> None:
    """The connected cluster can hold the replicas (shards and the partition server reserve no
    CPU): ConfigError naming the short resource otherwise, instead of actors that never start."""
    short = shortfall(replicas, cpus_per_replica, gpus_per_replica)
    if short is not None:
        raise ConfigError(short)


def shortfall(replicas: int, cpus_per_replica: float, gpus_per_replica: float) -> Optional[str]:
    """Why the connected cluster cannot hold the replicas now (the config error's line), or None."""
    def look() -> tuple[dict, list[dict]]:
        return ray.cluster_resources(), [n.total for n in nodes() if n.alive]

    try:
        total, alive = bounded(look, RESOURCES_TIMEOUT_S, "the Ray cluster's resources")
    except TimeoutError as exc:
        raise TrainingError(str(exc)) from None
    for key, each in (("CPU", cpus_per_replica), ("GPU", gpus_per_replica)):
        if each <= 0:
            continue
        need, have = replicas * each, total.get(key, 0.0)
        if need > have + 1e-9:
            return (f"config error: scaling: {replicas} replicas x {each:g} {key} need {need:g} {key}, "
                    f"the cluster has {have:g}")
        largest = max((n.get(key, 0.0) for n in alive), default=have)
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
        alive = [n for n in bounded(nodes, RESOURCES_TIMEOUT_S, "the Ray cluster's nodes") if n.alive]
    except TimeoutError:
        return None  # the cluster's view is not at hand: no warning rather than a wait
    if len(alive) < 2:
        return None
    return (f"{path} is a path on this node ({ray.util.get_node_ip_address()}), one of {len(alive)} nodes: "
            "a driver on another node (a job placed elsewhere, a new head) will not find it; a shared "
            "filesystem or a URI (s3://, gs://) is found from every node")
