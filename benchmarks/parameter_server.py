"""Parameter shards: push+pull bandwidth against raw ray.put + ray.get, and each mode's
samples/s on the CNN against allreduce.

Part 1. A model-sized float32 vector (~1.6 MB = the CNN, 16 MB, 100 MB) is pushed to S shards
(the shards apply it with SGD) and pulled back, S in 1, 2, 4, through the same RayShardClient
replicas use. The reference moves the same bytes with plain `ray.put` + `ray.get` (once for the
push direction, once for the pull). Bandwidth = bytes moved (2 x model) / seconds.

Part 2. The CNN on mnist5k with 2 replicas for a few epochs in allreduce, downpour and easgd
(the examples' settings); steady samples/s of each sharded mode / allreduce's.

    python benchmarks/parameter_server.py [--quick] [--json PATH]
"""
from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from common import median, parse_args, report

SIZES_MB = {"1.6MB": 421_642 * 4 / 1e6, "16MB": 16.0, "100MB": 100.0}


def push_pull_gbps(numel: int, shards: int, reps: int) -> float:
    import torch

    from actors.shard import RayShardClient, create_shards
    from policies.sharding import shard_bounds

    import ray

    bounds = shard_bounds(numel, shards)
    actors = create_shards(np.zeros(numel, np.float32), bounds, "sgd", 1e-3, 0.0, 0.0, replicas=1)
    client = RayShardClient(actors, bounds, max_in_flight=1, timeout_s=120)
    grad, params = torch.full((numel,), 1e-3), torch.empty(numel)
    versions = client.pull(params)  # warm-up: actors up, first transfer done
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        client.push(grad, versions, 0, 1, False)
        client.drain()
        versions = client.pull(params)
        times.append(time.perf_counter() - t0)
    for a in actors:
        ray.kill(a)
    return 2 * numel * 4 / median(times) / 1e9


def raw_put_get_gbps(numel: int, reps: int) -> float:
    import ray

    arr = np.full(numel, 1e-3, np.float32)
    out = np.empty_like(arr)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for _direction in range(2):  # the bytes of a push and of a pull
            out[:] = ray.get(ray.put(arr))
        times.append(time.perf_counter() - t0)
    return 2 * numel * 4 / median(times[1:]) / 1e9


def mode_samples_per_s(mode: str, epochs: int, storage: str) -> float:
    from orchestrator import ElasticTrainer, JobConfig

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = JobConfig.from_yaml(os.path.join(repo, "examples", f"mnist_{mode}.yaml"), [
        f"stop.epochs={epochs}", "stop.target_accuracy=null",
        f"tracking.tracking_uri=sqlite:///{storage}/mlflow.db", f"checkpoint.storage={storage}/ck"])
    return ElasticTrainer(cfg, show_progress=False).fit().steady_samples_per_s


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import ray

    reps, epochs = (3, 3) if args.quick else (7, 6)
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    results: dict = {"bandwidth_gbps": {}, "raw_gbps": {}, "samples_per_s": {}}
    ratios: dict[str, float] = {}
    for label, mb in SIZES_MB.items():
        numel = int(mb * 1e6 / 4)
        raw = raw_put_get_gbps(numel, reps)
        results["raw_gbps"][label] = raw
        for shards in (1, 2, 4):
            ours = push_pull_gbps(numel, shards, reps)
            results["bandwidth_gbps"][f"{label}_{shards}shards"] = ours
            ratios[f"push_pull_vs_raw_put_get_{label}_{shards}shards"] = ours / raw
            print(f"{label:>6} {shards} shards: {ours:6.3f} GB/s  (raw put+get {raw:6.3f} GB/s)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("allreduce", "downpour", "easgd"):
            results["samples_per_s"][mode] = mode_samples_per_s(mode, epochs, tmp)
            print(f"{mode}: {results['samples_per_s'][mode]:.0f} samples/s", flush=True)
    ray.shutdown()
    base = results["samples_per_s"]["allreduce"]
    for mode in ("downpour", "easgd"):
        ratios[f"{mode}_vs_allreduce_samples_per_s"] = results["samples_per_s"][mode] / base
    report("parameter_server", args.quick, results, ratios, args.json)


if __name__ == "__main__":
    main()
