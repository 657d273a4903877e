"""Parameter shards: push+pull bandwidth against plain Ray actors moving the same bytes, and
each mode's samples/s on the CNN against allreduce.

Part 1. A model-sized float32 vector (~1.6 MB = the CNN, 16 MB, 100 MB) is pushed to S shards
(the shards apply it with SGD) and pulled back, S in 1, 2, 4, through the same RayShardClient
replicas use. The reference is the least a Ray program can do to move those bytes the same way:
S plain actors (`Echo`), each sent its slice of the same array in one call (it keeps the
array and returns nothing) and asked for it back in a second call (it returns the array it
kept), the S calls of each direction in flight together, the pulled slices copied into one
tensor: the same actor round trips, slices and copy out as our client's push, drain and pull,
minus the shards' work (the SGD update, versions and clocks). Both are timed the same way,
alternating rep by rep (median of the reps after one warm-up round). Bandwidth = bytes moved
(2 x model) / seconds.

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


def echo_class():
    import ray

    @ray.remote(num_cpus=0)
    class Echo:
        """A plain actor that holds what it is sent and sends it back: no work on the bytes.
        (A plain actor: an asyncio one, as the shards are, was slower per call in a trial here.)"""

        def __init__(self) -> None:
            self.values = None

        def push(self, values: np.ndarray) -> None:
            self.values = values  # zero-copy view of the object-store copy, as a shard reads a gradient

        def pull(self) -> np.ndarray:
            return self.values

    return Echo


def push_pull_gbps(numel: int, shards: int, reps: int) -> tuple[float, float]:
    """(ours, plain actors) GB/s of one push+pull of a `numel` float32 vector split over `shards`
    actors. Ours: RayShardClient push (one call per shard), drain (await them), pull (one call per
    shard, each slice copied into one tensor). Plain actors: the same calls to Echo actors. The
    two alternate rep by rep after one warm-up each, so the machine's drift hits both alike."""
    import warnings

    import ray
    import torch

    from actors.shards.parameter_shard import create_shards
    from actors.shards.client import RayShardClient
    from policies.rules.sharding import shard_bounds

    bounds = shard_bounds(numel, shards)
    shard_actors = create_shards(np.zeros(numel, np.float32), bounds, "sgd", 1e-3, 0.0, 0.0, replicas=1)
    client = RayShardClient(shard_actors, bounds, max_in_flight=1, timeout_s=120)
    Echo = echo_class()
    echoes = [Echo.remote() for _ in bounds]
    grad, params = torch.full((numel,), 1e-3), torch.empty(numel)
    flat = grad.numpy()
    versions = client.pull(params)

    def ours() -> None:
        nonlocal versions
        client.push(grad, versions, 0, 1, False)
        client.drain()
        versions = client.pull(params)

    def plain() -> None:
        ray.get([a.push.remote(flat[lo:hi]) for a, (lo, hi) in zip(echoes, bounds)], timeout=120)
        replies = ray.get([a.pull.remote() for a in echoes], timeout=120)
        with warnings.catch_warnings():  # a read-only array from the object store; only read
            warnings.simplefilter("ignore", UserWarning)
            for (lo, hi), values in zip(bounds, replies):
                params[lo:hi].copy_(torch.from_numpy(values))

    times: dict = {ours: [], plain: []}
    for _ in range(reps + 1):  # the first round is the warm-up: actors up, first transfer done
        for side in times:
            t0 = time.perf_counter()
            side()
            times[side].append(time.perf_counter() - t0)
    for a in shard_actors + echoes:
        ray.kill(a)
    return 2 * numel * 4 / median(times[ours][1:]) / 1e9, 2 * numel * 4 / median(times[plain][1:]) / 1e9


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

    reps, epochs = (5, 3) if args.quick else (15, 6)
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    try:
        results: dict = {"bandwidth_gbps": {}, "raw_actor_gbps": {}, "samples_per_s": {}}
        ratios: dict[str, float] = {}
        for label, mb in SIZES_MB.items():
            numel = int(mb * 1e6 / 4)
            for shards in (1, 2, 4):
                ours, raw = push_pull_gbps(numel, shards, reps)
                results["raw_actor_gbps"][f"{label}_{shards}shards"] = raw
                results["bandwidth_gbps"][f"{label}_{shards}shards"] = ours
                ratios[f"push_pull_vs_raw_actors_{label}_{shards}shards"] = ours / raw
                print(f"{label:>6} {shards} shards: {ours:6.3f} GB/s  (plain actors {raw:6.3f} GB/s)", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            for mode in ("allreduce", "downpour", "easgd"):
                results["samples_per_s"][mode] = mode_samples_per_s(mode, epochs, tmp)
                print(f"{mode}: {results['samples_per_s'][mode]:.0f} samples/s", flush=True)
    finally:
        ray.shutdown()
    base = results["samples_per_s"]["allreduce"]
    for mode in ("downpour", "easgd"):
        ratios[f"{mode}_vs_allreduce_samples_per_s"] = results["samples_per_s"][mode] / base
    report("parameter_server", args.quick, results, ratios, args.json)


if __name__ == "__main__":
    main()
