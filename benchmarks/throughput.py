"""allreduce (2 replicas) vs Ray Train TorchTrainer (2 workers, DDP) vs the linear-scaling limit.

Same model (the CNN), data (mnist5k, same partitions per rank), per-worker batch (64), lr and
ragged-end rule. Three figures for each side:
  steady   samples/s inside the step loops (between epoch boundaries)
  whole    samples/s over whole epochs (evaluation and reporting included)
  t97      seconds from the call to fit() until test accuracy first reached 97%
The linear limit is 2 x the steady samples/s of one single-threaded PyTorch process.

    python benchmarks/throughput.py [--quick] [--json PATH]
"""
from __future__ import annotations

import json
import os
import tempfile
import time

from common import REPO, median, parse_args, report  # noqa: F401  (REPO puts the project on sys.path)

WORKERS, BATCH, LR, MOMENTUM, SEED, TARGET = 2, 64, 0.05, 0.9, 0, 0.97


def single_process_steady(steps: int) -> float:
    """Samples/s of one single-threaded PyTorch process (after a warm-up)."""
    import torch
    import torch.nn.functional as F

    from examples.models import mnist_cnn
    from orchestrator.data import load_source

    torch.set_num_threads(1)
    d = load_source("builtin:mnist5k")
    x, y = torch.from_numpy(d.train.x), torch.from_numpy(d.train.y)
    torch.manual_seed(SEED)
    model = mnist_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    perm = torch.randperm(len(y))
    t0 = None
    for i in range(steps + 5):
        if i == 5:
            t0 = time.perf_counter()
        idx = perm[(i * BATCH) % (len(y) - BATCH):][:BATCH]
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return steps * BATCH / (time.perf_counter() - t0)


def ours(epochs: int, storage: str) -> dict:
    from orchestrator import ElasticTrainer, JobConfig

    cfg = JobConfig.from_dict({
        "model": {"factory": "examples.models:mnist_cnn"},
        "data": {"source": "builtin:mnist5k", "batch_size": BATCH, "seed": SEED},
        "optimizer": {"name": "sgd", "lr": LR, "momentum": MOMENTUM},
        "scaling": {"replicas": WORKERS, "cpus_per_replica": 1},
        "stop": {"epochs": epochs, "target_accuracy": TARGET, "at_target": False},
        "tracking": {"experiment": "bench-throughput", "tracking_uri": f"sqlite:///{storage}/mlflow.db"},
        "checkpoint": {"storage": f"{storage}/ck"},
    })
    r = ElasticTrainer(cfg, show_progress=False).fit()
    return {"steady": r.steady_samples_per_s, "whole": r.samples_per_s, "t97": r.time_to_target_s,
            "startup_s": r.startup_s, "final_accuracy": r.final.test_accuracy}


def ray_train_loop(config: dict) -> None:
    """What a Ray Train user writes: prepare_model (DDP), per-epoch evaluation, ray.train.report."""
    import numpy as np
    import ray.train
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from ray.train.torch import prepare_model

    from examples.models import mnist_cnn
    from orchestrator.data import eval_slices, load_source, partition
    from policies.allreduce import steps_per_partition
    from policies.leases import PartitionLedger

    t_start = time.time()
    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    d = load_source("builtin:mnist5k")
    # the same partitions, the same per-epoch assignment and in-partition order as ours
    parts = partition(d.train, 4 * world, SEED)
    tensors = [(torch.from_numpy(p.x), torch.from_numpy(p.y)) for p in parts]
    steps = steps_per_partition([len(p) for p in parts], BATCH)
    lo, hi = eval_slices(len(d.test), world)[rank]
    tx, ty = torch.from_numpy(d.test.x[lo:hi]), torch.from_numpy(d.test.y[lo:hi])
    torch.manual_seed(SEED)
    model = prepare_model(mnist_cnn())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    history, t_first = [], time.time()
    for epoch in range(1, config["epochs"] + 1):
        model.train()
        ledger = PartitionLedger(len(parts), world, SEED, pinned=True)
        ledger.start_epoch(epoch)
        n_parts = 0
        t0 = time.perf_counter()
        while (lease := ledger.lease(rank)) is not None:
            x, y = tensors[lease.partition]
            order = torch.from_numpy(np.random.default_rng(lease.seed).permutation(len(y)))
            for idx in order[: steps * BATCH].split(BATCH):  # batches cut as ours are
                opt.zero_grad()
                F.cross_entropy(model(torch.index_select(x, 0, idx)), torch.index_select(y, 0, idx)).backward()
                opt.step()
            n_parts += 1
        train_s = time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            out = model(tx)
            stats = torch.tensor([(out.argmax(1) == ty).sum().item(), len(ty)], dtype=torch.float64)
        dist.all_reduce(stats)
        acc = float(stats[0] / stats[1])
        ray.train.report({"epoch": epoch, "test_accuracy": acc})
        history.append({"epoch": epoch, "train_s": train_s, "samples": n_parts * steps * BATCH * world,
                        "acc": acc, "t_end": time.time()})
    if rank == 0:
        with open(config["out"], "w") as f:
            json.dump({"t_start": t_start, "t_first": t_first, "history": history}, f)


def ray_train(epochs: int, storage: str) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = os.path.join(storage, "raytrain.json")
    trainer = TorchTrainer(
        ray_train_loop, train_loop_config={"epochs": epochs, "out": out},
        scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=storage, name=f"bench-{time.time_ns()}"),
    )
    t_call = time.time()
    trainer.fit()
    h = json.load(open(out))
    hist = h["history"]
    samples = sum(e["samples"] for e in hist)
    t97 = next((e["t_end"] - t_call for e in hist if e["acc"] >= TARGET), None)
    return {"steady": samples / sum(e["train_s"] for e in hist), "whole": samples / (hist[-1]["t_end"] - h["t_first"]),
            "t97": t97, "startup_s": h["t_first"] - t_call, "final_accuracy": hist[-1]["acc"]}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import ray

    reps, epochs = (2, 6) if args.quick else (3, 8)
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    runs: dict[str, list] = {"single_process_steady": [], "ours": [], "ray_train": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            runs["single_process_steady"].append(single_process_steady(150 if args.quick else 300))
            runs["ours"].append(ours(epochs, tmp))
            runs["ray_train"].append(ray_train(epochs, tmp))
            print(f"rep {rep + 1}/{reps}: " + json.dumps({k: v[-1] for k, v in runs.items()}))
    ray.shutdown()

    def med(side: str, key: str):
        vals = [r[key] for r in runs[side] if r[key] is not None]
        return median(vals) if vals else None

    limit = WORKERS * median(runs["single_process_steady"])
    results = {"linear_limit_samples_per_s": limit, "epochs": epochs, "repetitions": reps, "runs": runs}
    for side in ("ours", "ray_train"):
        results[side] = {k: med(side, k) for k in ("steady", "whole", "t97", "startup_s", "final_accuracy")}
    o, t = results["ours"], results["ray_train"]
    ratios = {
        "ours_vs_raytrain_steady": o["steady"] / t["steady"],
        "ours_vs_raytrain_whole_epochs": o["whole"] / t["whole"],
        "ours_vs_linear_limit_steady": o["steady"] / limit,
        "ours_vs_linear_limit_whole_epochs": o["whole"] / limit,
        "raytrain_vs_linear_limit_steady": t["steady"] / limit,
        "raytrain_vs_linear_limit_whole_epochs": t["whole"] / limit,
    }
    if o["t97"] and t["t97"]:
        ratios["ours_vs_raytrain_time_to_97"] = t["t97"] / o["t97"]
    report("throughput", args.quick, results, ratios, args.json)


if __name__ == "__main__":
    main()
