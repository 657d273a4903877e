"""allreduce (2 replicas) vs Ray Train TorchTrainer (2 workers, DDP) vs single-process PyTorch.

Same model (the CNN), data (mnist5k: the same 8 partitions, the same pinned round-robin
assignment per epoch, the same in-partition order), per-worker batch (64, the last batch of a
partition short: every row is used), lr, momentum, and the same evaluation (each worker its
half of the test split, batches of 64 under torch.inference_mode, correct and summed
cross-entropy). Figures of both distributed sides, taken the same way:
  steady   samples / seconds inside the step loops, the slowest worker's per epoch, summed
  whole    samples/s over whole epochs (evaluation and reporting included)
  t97      seconds from the call to fit() until test accuracy first reached 97%
Each repetition runs both distributed sides one after the other, ours first in even
repetitions and Ray Train first in odd ones, so a drift of the machine's speed falls on both.
The limits:
  linear limit   2 x the samples/s of one single-threaded PyTorch process (batch 64)
  single process one PyTorch process with 1 thread and with 2 threads training on the same
                 global batches (at each step rank 0's batch then rank 1's, concatenated),
                 evaluating the whole test split in batches of 64 after each epoch; t97 is
                 seconds from the model being built to 97% test accuracy.

    python benchmarks/throughput.py [--quick] [--json PATH]
"""
from __future__ import annotations

import json
import os
import tempfile
import time

from common import REPO, median, parse_args, report  # noqa: F401  (REPO puts the project on sys.path)

WORKERS, BATCH, LR, MOMENTUM, SEED, TARGET = 2, 64, 0.05, 0.9, 0, 0.97
PARTITIONS = 4 * WORKERS  # the default data.partitions: 4 per replica


def epoch_batches(sizes: list[int], rank: int, epoch: int, world: int = WORKERS,
                  seed: int = SEED) -> list[tuple[int, "torch.Tensor"]]:
    """(partition, row positions) of every step `rank` of `world` takes in `epoch`, as our
    replicas take them: the partitions pinned to `rank` (PartitionLedger, pinned), each in its
    lease's shuffled order, cut into batches of BATCH, the last one of each partition short."""
    import numpy as np
    import torch

    from policies.decisions.leases import PartitionLedger

    ledger = PartitionLedger(len(sizes), world, seed, pinned=True)
    ledger.start_epoch(epoch)
    steps = []
    while (lease := ledger.lease(rank)) is not None:
        order = torch.from_numpy(np.random.default_rng(lease.seed).permutation(sizes[lease.partition]))
        steps += [(lease.partition, idx) for idx in order.split(BATCH)]
    return steps


def evaluate(model, x, y) -> tuple[int, float, int]:
    """As ModelReplica.evaluate: batches of BATCH under inference_mode; (correct, summed loss, rows)."""
    import torch
    import torch.nn.functional as F

    model.eval()
    correct, loss_sum = 0, 0.0
    with torch.inference_mode():
        for lo in range(0, len(y), BATCH):
            out = model(x[lo:lo + BATCH])
            loss_sum += float(F.cross_entropy(out, y[lo:lo + BATCH], reduction="sum"))
            correct += int((out.argmax(1) == y[lo:lo + BATCH]).sum())
    return correct, loss_sum, len(y)


def single_process_steady(steps: int) -> float:
    """Samples/s of one single-threaded PyTorch process (after a warm-up), batches gathered
    with index_select as every other side does."""
    import torch
    import torch.nn.functional as F

    from examples.models import mnist_cnn
    from orchestrator.data.in_memory import load_source

    threads = torch.get_num_threads()
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
        F.cross_entropy(model(torch.index_select(x, 0, idx)), torch.index_select(y, 0, idx)).backward()
        opt.step()
    rate = steps * BATCH / (time.perf_counter() - t0)
    torch.set_num_threads(threads)
    return rate


def single_process_to_target(threads: int, epochs: int, world: int = WORKERS, partitions: int = PARTITIONS,
                             seed: int = SEED) -> dict:
    """One PyTorch process with `threads` threads on the distributed sides' global batches (at
    each step the concatenation of every rank's batch, rank 0's first: with equal parts, the
    mean loss over it is DDP's mean of the workers' means), the same lr and momentum; evaluates
    the whole test split after each epoch and stops at TARGET (or after `epochs`). `world`,
    `partitions`, `seed`: the distributed sides' workers, data.partitions and data.seed."""
    import torch
    import torch.nn.functional as F

    from examples.models import mnist_cnn
    from orchestrator.data.in_memory import load_source, partition

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    d = load_source("builtin:mnist5k")
    parts = partition(d.train, partitions, seed)
    sizes = [len(p) for p in parts]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    x = torch.cat([torch.from_numpy(p.x) for p in parts])
    y = torch.cat([torch.from_numpy(p.y) for p in parts])
    tx, ty = torch.from_numpy(d.test.x), torch.from_numpy(d.test.y)
    plans = [[[(p, idx + offsets[p]) for p, idx in epoch_batches(sizes, r, e, world, seed)] for r in range(world)]
             for e in range(1, epochs + 1)]  # the data order, computed before the clock starts
    torch.manual_seed(seed)
    model = mnist_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    t0 = time.perf_counter()
    history, t97, samples, train_s = [], None, 0, 0.0
    for epoch, per_rank in enumerate(plans, start=1):
        assert len({len(steps) for steps in per_rank}) == 1, "the workers take different numbers of steps"
        model.train()
        t_loop = time.perf_counter()
        for step in zip(*per_rank):
            idx = torch.cat([i for _, i in step])
            opt.zero_grad()
            F.cross_entropy(model(torch.index_select(x, 0, idx)), torch.index_select(y, 0, idx)).backward()
            opt.step()
            samples += len(idx)
        train_s += time.perf_counter() - t_loop
        correct, loss_sum, rows = evaluate(model, tx, ty)
        elapsed = time.perf_counter() - t0
        history.append({"epoch": epoch, "acc": correct / rows, "test_loss": loss_sum / rows, "t": elapsed})
        if correct / rows >= TARGET:
            t97 = elapsed
            break
    torch.set_num_threads(saved)
    return {"t97": t97, "epochs": len(history), "steady": samples / train_s, "history": history}


def ours(epochs: int, storage: str) -> dict:
    from orchestrator import ElasticTrainer, JobConfig

    cfg = JobConfig.from_dict({
        "model": {"factory": "examples.models:mnist_cnn"},
        "data": {"source": "builtin:mnist5k", "batch_size": BATCH, "seed": SEED},
        "optimizer": {"name": "sgd", "lr": LR, "momentum": MOMENTUM},
        "scaling": {"replicas": WORKERS, "cpus_per_replica": 1},
        "stop": {"epochs": epochs, "target_accuracy": TARGET, "at_target": False},
        "tracking": {"experiment": "bench-throughput", "tracking_uri": f"sqlite:///{storage}/mlflow.db"},
        "checkpoint": {"storage": f"{storage}/ck", "every_epochs": 0},  # the reference writes none: same work
    })
    r = ElasticTrainer(cfg, show_progress=False).fit()
    return {"steady": r.steady_samples_per_s, "whole": r.samples_per_s, "t97": r.time_to_target_s,
            "startup_s": r.startup_s, "final_accuracy": r.final.test_accuracy,
            "rows_per_epoch": list(getattr(r, "rows_per_epoch", []))}


def ray_train_loop(config: dict) -> None:
    """What a Ray Train user writes: prepare_model (DDP), per-epoch evaluation, ray.train.report;
    the batches are ours (epoch_batches) and the figures are gathered as our controller does.
    Optional config: `partitions`, `seed` (as data.partitions, data.seed), `slow` (a straggler
    as faults.slow_replicas makes one: {rank, factor, from_s, to_s}, seconds of training),
    `stop_at` (stop once the test accuracy reaches it, as stop.at_target)."""
    import ray.train
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from ray.train.torch import prepare_model

    from examples.models import mnist_cnn
    from orchestrator.data.in_memory import eval_slices, load_source, partition

    t_start = time.time()
    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    seed = config.get("seed", SEED)
    slow = {"from_s": 0.0, "to_s": float("inf"), **(config.get("slow") or {})}
    d = load_source("builtin:mnist5k")
    parts = partition(d.train, config.get("partitions", PARTITIONS), seed)  # the same partitions as ours
    tensors = [(torch.from_numpy(p.x), torch.from_numpy(p.y)) for p in parts]
    sizes = [len(p) for p in parts]
    lo, hi = eval_slices(len(d.test), world)[rank]
    tx, ty = torch.from_numpy(d.test.x[lo:hi]), torch.from_numpy(d.test.y[lo:hi])
    slow_row_s = 0.0  # the straggler's sleep per row: factor - 1 times its compute per row, measured here
    if slow.get("rank") == rank:  # on a plain copy: DDP's backward would include waiting for the others
        probe, times = mnist_cnn(), []
        for _ in range(6):
            t = time.perf_counter()
            F.cross_entropy(probe(tensors[0][0][:BATCH]), tensors[0][1][:BATCH]).backward()
            times.append(time.perf_counter() - t)
        slow_row_s = (slow["factor"] - 1) * sorted(times[1:])[2] / BATCH
    torch.manual_seed(seed)
    model = prepare_model(mnist_cnn())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    history, t_first = [], time.time()
    for epoch in range(1, config["epochs"] + 1):
        model.train()
        samples = 0
        t0 = time.perf_counter()
        # the same partitions in the same order as ours; each partition's batches in its
        # lease's order, every row used (the last batch of a partition short)
        for p, idx in epoch_batches(sizes, rank, epoch, world, seed):
            x, y = tensors[p]
            opt.zero_grad()
            F.cross_entropy(model(torch.index_select(x, 0, idx)), torch.index_select(y, 0, idx)).backward()
            opt.step()
            samples += len(idx)
            if slow_row_s and slow["from_s"] <= time.time() - t_first < slow["to_s"]:
                time.sleep(slow_row_s * len(idx))  # as ours: after the step, factor - 1 times its compute
        train_s = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        correct, loss_sum, rows = evaluate(model, tx, ty)
        sums = torch.tensor([correct, loss_sum, rows, samples], dtype=torch.float64)
        dist.all_reduce(sums)  # as our controller sums the replicas' evaluations and samples
        dist.all_reduce(train_s, op=dist.ReduceOp.MAX)  # the slowest worker's step loop, as ours
        acc = float(sums[0] / sums[2])
        ray.train.report({"epoch": epoch, "test_accuracy": acc, "test_loss": float(sums[1] / sums[2])})
        history.append({"epoch": epoch, "train_s": float(train_s[0]), "samples": int(sums[3]),
                        "acc": acc, "t_end": time.time()})
        if config.get("stop_at") is not None and acc >= config["stop_at"]:  # every worker sees the same sum
            break
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
            "t97": t97, "startup_s": h["t_first"] - t_call, "final_accuracy": hist[-1]["acc"],
            "rows_per_epoch": [e["samples"] for e in hist]}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import ray

    reps, epochs = (2, 6) if args.quick else (3, 8)
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    runs: dict[str, list] = {"single_process_steady": [], "single_process_1t": [], "single_process_2t": [],
                             "ours": [], "ray_train": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(reps):
                runs["single_process_steady"].append(single_process_steady(150 if args.quick else 300))
                runs["single_process_1t"].append(single_process_to_target(1, epochs))
                runs["single_process_2t"].append(single_process_to_target(2, epochs))
                sides = [("ours", ours), ("ray_train", ray_train)]
                for side, run in sides if rep % 2 == 0 else sides[::-1]:  # A B, then B A: drift falls on both
                    runs[side].append(run(epochs, tmp))
                print(f"rep {rep + 1}/{reps}: " + json.dumps(
                    {k: ({kk: vv for kk, vv in v[-1].items() if kk != "history"} if isinstance(v[-1], dict) else v[-1])
                     for k, v in runs.items()}), flush=True)
    finally:
        ray.shutdown()

    def med(side: str, key: str):
        vals = [r[key] for r in runs[side] if r[key] is not None]
        return median(vals) if vals else None

    limit = WORKERS * median(runs["single_process_steady"])
    results = {"linear_limit_samples_per_s": limit, "epochs": epochs, "repetitions": reps, "runs": runs}
    for side in ("ours", "ray_train"):
        results[side] = {k: med(side, k) for k in ("steady", "whole", "t97", "startup_s", "final_accuracy")}
    for side in ("single_process_1t", "single_process_2t"):
        results[side] = {k: med(side, k) for k in ("t97", "epochs", "steady")}
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
    for threads in (1, 2):
        single = results[f"single_process_{threads}t"]["t97"]
        if o["t97"] and single:
            ratios[f"ours_vs_single_process_{threads}t_time_to_97"] = single / o["t97"]
    report("throughput", args.quick, results, ratios, args.json)


if __name__ == "__main__":
    main()
