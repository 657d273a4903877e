"""Calibrating the cost model (policies/decisions/cost_model.py) for `python -m orchestrator
simulate` (orchestrator/cli/simulate.py): on this machine, or from a finished run. What each
calibration measures and how a run's figures are read: that module's docstring."""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from datetime import timedelta
from typing import Any, Optional

from orchestrator.errors import ConfigError
from policies.decisions.cost_model import Calibration, fit_link

STEPS = 30  # calibration steps (after 5 warm-up steps)
LINK_REPEATS = 15
LINK_MIN_BYTES = 1 << 20
LINK_TRIES = 3  # measurements of the link before its slope is taken from the big message alone
LINK_TIMEOUT_S = 60.0
SHARD_ROUNDS = 20
MEMORY_BYTES = 128 << 20  # each of the two vectors `calibrate_memory` adds: past any core's caches
MEMORY_REPEATS = 7
SHARD_PATHS = ("link", "here")


def model_and_batch(cfg: Any) -> tuple[Any, Any, Any, Any]:
    """The job's model, task, and one batch of its train data (inputs, targets)."""
    import numpy as np

    from orchestrator.models import build_model
    from orchestrator.data.loading import load_dataset
    from policies.rules.batches import as_tensors, rows, take

    task = cfg.task.build()
    data = load_dataset(cfg.data, task=task)
    split = data.train if hasattr(data, "train") else data.sample
    n = rows(split.y)
    idx = np.arange(cfg.data.batch_size) % n
    x, y = as_tensors(take(split.x, idx)), as_tensors(take(split.y, idx))
    model = build_model(cfg.model.factory, cfg.model.kwargs, cfg.data.seed)
    return model, task, x, y


def calibrate_compute(cfg: Any, steps: int = STEPS) -> tuple[int, float]:
    """(trainable parameters, median seconds of one training step on one replica)."""
    import torch

    from policies.rules.outputs import run_model

    threads = max(1, int(cfg.scaling.cpus_per_replica))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, task, x, y = model_and_batch(cfg)
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        o = cfg.optimizer
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=o.lr, momentum=o.momentum,
                              weight_decay=o.weight_decay)
        times = []
        for i in range(5 + steps):
            t = time.perf_counter()
            opt.zero_grad()
            task.loss(run_model(model, task, x, y), y).backward()
            opt.step()
            if i >= 5:
                times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return params, statistics.median(times)


def _compute_worker(cfg_dict: dict, steps: int, start: Any, out: Any) -> None:
    from orchestrator.config import JobConfig

    cfg = JobConfig.from_dict(cfg_dict)
    model_and_batch(cfg)  # the data set loaded (and cached) before the barrier: only the steps overlap
    start.wait(timeout=LINK_TIMEOUT_S)
    out.put(calibrate_compute(cfg, steps)[1])


def calibrate_cores(cfg: Any, alone_s: float, k: Optional[int] = None, steps: int = STEPS) -> tuple[float, float]:
    """(effective cores, slowdown): `k` processes (default: this host's CPU count) take the
    calibration steps at once, each with one replica's threads; slowdown = their median step /
    `alone_s` (one process alone), effective cores = k / slowdown (at most k). Logical CPUs that
    are hyper-threads of one core, memory bandwidth and the host's other work all show up here."""
    k = k or os.cpu_count() or 1
    if k < 2:
        return 1.0, 1.0
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(k), ctx.Queue()
    procs = [ctx.Process(target=_compute_worker, args=(cfg.model_dump(), steps, start, out), daemon=True)
             for _ in range(k)]
    for p in procs:
        p.start()
    try:
        times = [out.get(timeout=LINK_TIMEOUT_S * 2) for _ in range(k)]
    except Exception as exc:  # a process that died or hung: no figure
        raise ConfigError(f"--cores here: {k} calibration processes did not all answer within "
                          f"{LINK_TIMEOUT_S * 2:.0f}s ({type(exc).__name__}); give --cores N instead") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    slow = max(1.0, statistics.median(times) / alone_s)
    return min(float(k), k / slow), slow


def _link_worker(rank: int, port: int, sizes: list[int], repeats: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=LINK_TIMEOUT_S))
    try:
        result = []
        for size in sizes:
            t = torch.zeros(max(1, size // 4))
            for _ in range(3):
                dist.all_reduce(t)
            times = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - t0)
            result.append(statistics.median(times))
        if rank == 0:
            out.put(result)
    finally:
        dist.destroy_process_group()


def calibrate_link(model_bytes: int, repeats: int = LINK_REPEATS, tries: int = LINK_TRIES) -> tuple[float, float]:
    """(alpha, beta) of this host's loopback link, from a gloo all-reduce between two processes.
    On a busy host the timings can come out with no slope (the small message as slow as the
    big one: beta fits to 0, a link with free bandwidth): measured again, up to `tries` times;
    then beta is the big message's time over its bytes (an upper bound: all of it bandwidth)."""
    # a message of at least LINK_MIN_BYTES: a tiny model's messages are all latency, and their
    # slope (beta) is timing noise that fits to 0 as often as not
    big = max(LINK_MIN_BYTES, model_bytes)
    sizes = [4, big // 4, big]
    for _ in range(tries):
        seconds = _link_timings(sizes, repeats)
        alpha, beta = fit_link(sizes, seconds, n=2)
        if beta > 0:
            return alpha, beta
    return alpha, seconds[-1] / big  # n = 2: the ring moves 2 (n-1)/n x big = big bytes


def _link_timings(sizes: list[int], repeats: int) -> list[float]:
    """The median all-reduce seconds of each message size, between two processes over gloo."""
    from actors.replica.reducer import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_link_worker, args=(r, port, sizes, repeats, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=LINK_TIMEOUT_S)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def calibrate_shard_path(cfg: Any, params: int, rounds: int = SHARD_ROUNDS) -> tuple[str, float]:
    """(mode, seconds one exchange with the parameter shards takes here): real ParameterShards
    (scaling.shards of them, beside this process as a run places them) holding a vector of the
    model's size, and a replica's RayShardClient in this process making the exchanges of the
    config's first sharded mode (downpour when it has none): downpour pushes a gradient
    (strategy.max_in_flight outstanding) and pulls the parameters, two exchanges a round; easgd
    makes one elastic exchange, the model up and back, two as well. The median round of
    `rounds`, after 3 warm-up rounds, halved. Ray as a run finds it (orchestrator/fleet/cluster.py:
    this process's, RAY_ADDRESS's, or a local one started for the calibration and stopped after)."""
    import uuid

    import numpy as np
    import ray
    import torch

    from actors.shards.client import RayShardClient
    from orchestrator.fleet import cluster
    from orchestrator.fleet.shard_group import ShardGroup
    from policies.rules.registry import mode_spec
    from policies.rules.sharding import shard_bounds

    mode = next((p["mode"] for p in cfg.strategy.plan() if mode_spec(p["mode"]).sharded), "downpour")
    started = cluster.connect(1)
    group, times = None, []
    try:
        group = ShardGroup.create(np.zeros(params, dtype=np.float32), shard_bounds(params, cfg.scaling.shards),
                                  "sgd", 0.0, 0.0, 0.0, 1, 3600.0, name_prefix=f"eo-calibrate-{uuid.uuid4().hex[:8]}",
                                  timeout_s=LINK_TIMEOUT_S, placement=cluster.beside_driver())
        client = RayShardClient(group.directory(), cfg.strategy.max_in_flight, LINK_TIMEOUT_S)
        flat, grad = torch.zeros(params), torch.zeros(params)
        versions = client.pull(flat)
        for i in range(3 + rounds):
            t = time.perf_counter()
            if mode in ("downpour", "hogwild"):  # hogwild's replicas off the shard's node push and pull
                client.push(grad, versions, 0, i + 1, False)
                client.completed()
                versions = client.pull(flat)
            else:
                client.elastic(flat, 0.1)
            if i >= 3:
                times.append(time.perf_counter() - t)
        client.drain()
    finally:
        if group is not None:
            group.shutdown()
        if started:
            ray.shutdown()
    return mode, statistics.median(times) / 2


def calibrate_memory(nbytes: int = MEMORY_BYTES, repeats: int = MEMORY_REPEATS) -> float:
    """This host's memory bandwidth in bytes/s, with every core at it: x += y over two float32
    vectors of `nbytes` each (x read and written, y read: 3 nbytes a pass), the median pass of
    `repeats` after one to warm them. For hogwild's shared vector (cost_model: each direct step
    reads it and updates it in place, and the writers share the node's memory)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        x = torch.ones(nbytes // 4)
        y = torch.ones(nbytes // 4)
        x.add_(y)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            x.add_(y)
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return 3 * (nbytes // 4) * 4 / statistics.median(times)


def from_run(run_id: str, tracking_uri: Optional[str]) -> dict[str, Any]:
    """A finished run's step figures: replicas, batch, mode, compute and communication seconds."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from orchestrator.reporting.tracking import check_store_to_read

    check_store_to_read(tracking_uri, f"--from-run {run_id}")  # read only: a store that is not there is not made
    client = MlflowClient(tracking_uri)
    try:
        run = client.get_run(run_id)
        rates = [m.value for m in client.get_metric_history(run_id, "samples_per_s") if m.value > 0]
        shares = [m.value for m in client.get_metric_history(run_id, "comm_share")]
    except MlflowException as exc:
        raise ConfigError(f"--from-run {run_id}: not found in {client.tracking_uri} ({exc})") from None
    params = run.data.params
    shape = {"n_push": int(params.get("strategy.n_push", "1")), "n_fetch": int(params.get("strategy.n_fetch", "1")),
             "tau": int(params.get("strategy.tau", "4")), "shards": int(params.get("scaling.shards", "1"))}
    if not rates:
        raise ConfigError(f"--from-run {run_id}: the run logged no samples_per_s (no step was logged)")
    batch = int(params.get("data.batch_size", "0"))
    replicas = int(params.get("scaling.replicas", "1"))
    step = batch / statistics.median(rates)
    share = statistics.median(shares) if shares else 0.0
    return {"run": run_id, "mode": params.get("strategy.mode", "allreduce"), "replicas": replicas, "batch": batch,
            "step_s": step, "comm_s": share * step, "compute_s": (1 - share) * step, "shape": shape}


def calibration(cfg: Any, run: Optional[dict[str, Any]] = None, bandwidth_gbps: Optional[float] = None,
                latency_us: Optional[float] = None, cores: "float | str | None" = None,
                shard_path: str = "link") -> Calibration:
    """The model's inputs: this machine's (or the run's) figures, flags over both. `cores`
    "here": this host's effective cores, measured (`calibrate_cores`). `shard_path` "here": the
    shards' path measured with real shards (`calibrate_shard_path`) unless a downpour or easgd
    run gives its own; "link": the shards' exchanges cost what the link's do."""
    if shard_path not in SHARD_PATHS:
        raise ConfigError(f"--shard-path must be one of {', '.join(SHARD_PATHS)}, got {shard_path!r}")
    if shard_path == "here" and bandwidth_gbps is not None:
        raise ConfigError("--shard-path here measures this host's shards; with --bandwidth-gbps the shards' "
                          "exchanges follow the modelled link: give one of the two")
    params, compute = calibrate_compute(cfg)
    source = [f"compute: {STEPS} steps of the model here"]
    if cores == "here":
        cores, slow = calibrate_cores(cfg, compute)
        source.append(f"cores: {os.cpu_count()} processes at once step {slow:.2f}x slower than one alone")
    alpha = beta = shard_beta = None
    if latency_us is not None:
        alpha = latency_us * 1e-6
    if bandwidth_gbps is not None:
        beta = 8 / (bandwidth_gbps * 1e9)
    if alpha is None or beta is None:
        a, b = calibrate_link(params * 4)
        alpha = a if alpha is None else alpha
        beta = b if beta is None else beta
        source.append("link: gloo all-reduce on this host's loopback")
    batch = cfg.data.batch_size
    if run is not None:
        n = run["replicas"]
        batch = run["batch"] or batch
        if n == 1:
            compute = run["compute_s"]
            source = [f"compute: run {run['run']}'s progress rows"]
        else:  # its replicas shared the hosts: the step here alone, and the cores that slowed it as it was
            if cores is None:
                if 0 < run["compute_s"] <= compute:  # no slower than alone here: each replica had its own cores,
                    compute, cores = run["compute_s"], float(n)  # and its step is the evidence (a busy host here is not)
                else:
                    cores = n * compute / run["compute_s"] if run["compute_s"] > 0 else float(n)
            source.append(f"cores: run {run['run']}'s step compute at {n} replicas "
                          f"({run['compute_s'] * 1e3:.1f} ms)")
        # the run's communication as it would be on cores of its own (the model stretches it back at n)
        comm_s = run["comm_s"] / (max(1.0, n / float(cores)) if cores else 1.0)
        if run["mode"] == "allreduce" and n > 1 and bandwidth_gbps is None:
            # the bytes the prediction will count (simulate: half precision, PowerSGD's factors)
            ring_bytes = 2 * (n - 1) / n * params * allreduce_bytes_per_param(cfg)
            if latency_us is not None:  # the latency given: the bandwidth is what the run's time leaves
                beta = max(0.0, (comm_s - 2 * (n - 1) * alpha) / ring_bytes)
            else:  # the link's shape (alpha : beta) from here, its scale from the run's own all-reduce time
                ring = ring_bytes * beta + 2 * (n - 1) * alpha
                scale = comm_s / ring if ring > 0 else 1.0
                alpha, beta = alpha * scale, beta * scale
            source.append(f"link: run {run['run']}'s communication at {n} replicas")
        if run["mode"] in ("downpour", "easgd"):  # the shards' path (Ray calls, the object store), not gloo's
            shape = run.get("shape", {})
            exchanges = (1 / shape.get("n_push", 1) + 1 / shape.get("n_fetch", 1) if run["mode"] == "downpour"
                         else 2 / shape.get("tau", 4))
            shard_beta = max(0.0, (comm_s / exchanges - alpha) / (params * 4))
            source.append(f"shard path: run {run['run']}'s communication")
    if shard_path == "here" and shard_beta is None:
        mode, exchange_s = calibrate_shard_path(cfg, params)
        shard_beta = max(0.0, (exchange_s - alpha) / (params * 4))
        source.append(f"shard path: {mode}'s exchanges with {cfg.scaling.shards} real shards here "
                      f"({exchange_s * 1e3:.2f} ms each)")
    if bandwidth_gbps is not None or latency_us is not None:
        source.append("link: given")
    memory = calibrate_memory()
    source.append(f"memory: x += y over {MEMORY_BYTES >> 20} MiB vectors here ({memory / 1e9:.1f} GB/s)")
    return Calibration(params, batch, compute, alpha, beta, cores, "; ".join(source),
                       shard_beta_s_per_byte=shard_beta, memory_bytes_per_s=memory)


def allreduce_bytes_per_param(cfg: Any) -> float:
    """Bytes allreduce sends per trainable parameter: 4 (float32), 2 (fp16, bf16), or PowerSGD's
    rank-r factors' floats x 4 / parameters (from the model's shapes)."""
    st = cfg.strategy
    if st.compression in ("fp16", "bf16"):
        return 2.0
    if st.compression != "powersgd":
        return 4.0
    from orchestrator.models import build_model
    from policies.rules.powersgd import floats_sent

    params = [p for p in build_model(cfg.model.factory, cfg.model.kwargs, cfg.data.seed).parameters() if p.requires_grad]
    return 4.0 * floats_sent([tuple(p.shape) for p in params], st.powersgd_rank) / sum(p.numel() for p in params)
