"""The modern recipe on tiny_lm: ours in every mode vs single-process PyTorch vs Ray Train (DDP).

Workload: examples/tiny_lm.yaml as shipped (the causal transformer examples.models:tiny_lm on
the stdlib's pydoc topics as rows of 65 bytes, written by examples.datasets.write_text into a
temp directory; test rows: those whose position hashes below data.test_fraction with
data.seed, 8 train partitions) and its recipe, read from the YAML by every side: AdamW (lr,
weight_decay, kwargs betas and eps), warm-up then cosine decay to min_factor over the planned
steps (policies.rules.recipe.planned_steps: epochs x ceil(train rows / (batch_size x accumulate x
2))), the gradient's global norm clipped at clip_grad_norm, data.accumulate micro-batches of
data.batch_size rows per step and replica, forward and loss under torch.autocast(bf16) on CPU,
parameters and optimizer in fp32, evaluation without autocast. 2 replicas / workers of 1 thread;
the single process has 2 threads (the same total). Every side runs all its epochs (no stop at
the target) and evaluates every test row after each epoch: test perplexity = exp(summed
next-token NLL / tokens), in batches of data.batch_size under inference_mode.

Sides:
  allreduce, downpour, easgd, local_sgd
        ElasticTrainer(cfg).fit() on examples/tiny_lm.yaml with strategy.mode set (easgd with
        strategy.momentum 0, as the YAML has it: AdamW takes the local steps; downpour's shards
        apply AdamW to their slices; local SGD averages every strategy.period steps); real Ray
        actors, MLflow in a temp sqlite store, no checkpoints (the references write none).
        downpour and easgd are evaluated on their reference model (the shards' copy, the center).
  single
        one PyTorch process, 2 threads, no Ray: the same model and initial parameters
        (policies.rules.factory.build_model with data.seed), the same partitions read by the same
        reader (actors.partitions.reading.read_range on the driver's plan), each step the union of the 2
        allreduce replicas' batches of that step (rank r's pinned partitions in the PartitionLedger's
        order, each in its lease's shuffled order, cut into batches of batch_size x accumulate
        rows, the last of each partition short; a rank with no batch left adds nothing), as
        `accumulate` micro-batches (the j-th micro-batch: every rank's j-th, concatenated),
        each loss weighted by its share of the step's rows: the mean gradient over the step's
        rows, as allreduce computes it. torch.optim.AdamW with the YAML's kwargs, its rate set
        before every step to lr x policies.rules.recipe.Schedule(schedule, planned_steps).factor(step),
        clip_grad_norm_, bf16 autocast. The step count is allreduce's clock (one per global
        batch). The reference of what the data and recipe allow with no distribution at all.
  ray_train
        Ray Train TorchTrainer, 2 workers x 1 CPU, prepare_model (DDP, gloo); the same batches
        per rank as our allreduce (the same partitions, order and in-partition shuffle), as a
        Ray Train user writes the recipe: micro-batches of the rank's batch, the first ones
        under model.no_sync(), each loss / accumulate (a mean of micro-batch means: exact only
        when the micro-batches are equal, so a partition's short last batch is weighted a little
        differently from ours, and DDP's mean over the 2 workers is a mean of their means),
        torch.autocast(bf16), clip_grad_norm_, torch.optim.AdamW and a LambdaLR with the same
        Schedule stepped once per optimizer step; each worker evaluates half of the test rows
        and the sums are all-reduced. (Ours deals the test split in pieces of ~16 MB of the
        source: this one is a single piece, so our rank 0 evaluates every test row while rank
        1 waits, in every mode; the sums, and so the perplexity, are the same.)
  allreduce_fp32
        allreduce with model.precision fp32: against allreduce (bf16), what bf16 autocast does
        to samples/s and to the perplexity after the same epochs on this CPU.

Figures per side (medians over --reps repetitions, with min-max):
  to_target_s        seconds from fit() until the first epoch-end test perplexity at or below the
                     target (start-up included; None: not reached); single: from the model built
  train_to_target_s  the same less start-up (ours: time_to_target_s - startup_s; Ray Train: from its
                     first step; single: as to_target_s)
  final_perplexity   test perplexity after the last epoch
  steady             samples / seconds inside the step loops (distributed sides: the slowest worker's
                     per epoch, summed); whole: samples / seconds of whole epochs
  startup_s          from fit() to the first step (ours, Ray Train)
Ratios (higher is better for ours): <side>_vs_single_* and <side>_vs_raytrain_* as the other's
time / ours and ours' samples/s / the other's; bf16_vs_fp32_steady (allreduce bf16 samples/s /
fp32's), fp32_vs_bf16_perplexity (fp32's final perplexity / bf16's: above 1, bf16 ended lower).
What a ratio leaves out: train_to_target and steady ratios exclude start-up (Ray actors, process
group, data planning, Ray Train's worker group and its reading of the rows); to_target (against
Ray Train only) includes both sides' start-up; the single process has none and reads its rows
before its clock starts, while our replicas read their partitions during the epochs (prefetched
in the background). train_to_target includes the epoch-end evaluations on every side (ours on
one replica here, see ray_train). downpour, easgd and local_sgd are other algorithms than the
references' synchronous step: their time to target measures their convergence as well as their
speed; their steady samples/s compare like with like. Each repetition runs the sides in the
listed order, reversed in odd repetitions (a drift of the machine's speed falls on both ends);
all sides use data.seed 0.

--quick: one repetition of QUICK_EPOCHS (2) epochs, the schedule planned over those epochs, with
the target loosened to QUICK_TARGET (perplexity 10: the YAML's 5.0 takes 4 epochs or more);
about 3.5 minutes here. Without it: --reps (default 3) repetitions of the YAML's stop.epochs (10)
and target, about 2 minutes per side and repetition, so about 45-50 minutes in all.

    python benchmarks/recipe.py [--quick] [--json PATH] [--reps N] [--sides SIDE,...] [--epochs N]
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import traceback
from typing import Any, Optional

from common import REPO, median, parse_args, report

WORKERS = 2
EXAMPLE = os.path.join(REPO, "examples", "tiny_lm.yaml")
MODES = {"allreduce": ["strategy.mode=allreduce"], "downpour": ["strategy.mode=downpour"],
         "easgd": ["strategy.mode=easgd", "strategy.momentum=0"], "local_sgd": ["strategy.mode=local_sgd"]}
SIDES = (*MODES, "single", "ray_train", "allreduce_fp32")
QUICK_EPOCHS, QUICK_TARGET = 2, 10.0


def example() -> dict[str, Any]:
    from orchestrator.config import read_mapping

    return read_mapping(EXAMPLE)


def job_config(raw: dict, source: str, tmp: str, epochs: int, target: float, extra: list[str]):
    from orchestrator.config import JobConfig

    return JobConfig.from_dict(raw, [
        f"data.source={source}", f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db", "tracking.experiment=bench-recipe",
        f"checkpoint.storage={tmp}/ck", "checkpoint.every_epochs=0", f"scaling.replicas={WORKERS}",
        "scaling.cpus_per_replica=1", f"stop.epochs={epochs}", f"stop.target.value={target}", "stop.at_target=false",
        *extra])


def plan(cfg) -> Any:
    """The file source planned as our driver plans it (train partitions, test pieces)."""
    from orchestrator.data.planning import plan_file_dataset
    from policies.rules.tasks import load_task

    return plan_file_dataset(cfg.data, load_task(cfg.task.name), WORKERS)


def epoch_batches(rows: list[int], rank: int, epoch: int, seed: int, batch: int) -> list[tuple[int, Any]]:
    """(partition, row positions in it) of every batch `rank` of WORKERS takes in `epoch` in
    allreduce: its pinned partitions in the ledger's order, each in its lease's shuffled order,
    cut into batches of `batch` rows, the last of each partition short."""
    import numpy as np
    import torch

    from policies.decisions.leases import PartitionLedger

    ledger = PartitionLedger(len(rows), WORKERS, seed, pinned=True)
    ledger.start_epoch(epoch)
    steps = []
    while (lease := ledger.lease(rank)) is not None:
        order = torch.from_numpy(np.random.default_rng(lease.seed).permutation(rows[lease.partition]))
        steps += [(lease.partition, idx) for idx in order.split(batch)]
    return steps


def micro(idx, k: int) -> list:
    """`idx` as k near-equal chunks, as policies.rules.recipe.Recipe.micro_batches cuts a batch."""
    n = len(idx)
    k = min(k, n)
    edges = [round(i * n / k) for i in range(k + 1)]
    return [idx[lo:hi] for lo, hi in zip(edges, edges[1:]) if hi > lo]


def perplexity_sums(model, x, y, batch: int) -> tuple[float, float]:
    """(summed next-token NLL, tokens) over (x, y) in batches of `batch`, as the language_model
    task's evaluate: eval mode, inference_mode, no autocast, the NLL summed in float64."""
    import torch
    import torch.nn.functional as F

    model.eval()
    nll, tokens = 0.0, 0.0
    with torch.inference_mode():
        for lo in range(0, len(y), batch):
            out, t = model(x[lo:lo + batch]), y[lo:lo + batch].reshape(-1)
            nll += float(F.cross_entropy(out.double().reshape(-1, out.shape[-1]), t, ignore_index=-1, reduction="sum"))
            tokens += float((t >= 0).sum())
    model.train()
    return nll, tokens


def read_rows(plan_, ranges) -> tuple[Any, Any]:
    """The decoded rows of a plan's position ranges as (x, y) tensors."""
    import torch

    from actors.partitions.reading import read_range

    parts = [read_range(plan_, lo, hi) for lo, hi in ranges]
    return (torch.cat([torch.from_numpy(p["x"]) for p in parts]), torch.cat([torch.from_numpy(p["y"]) for p in parts]))


def optimizer_kwargs(opt: dict) -> dict:
    kwargs = dict(opt.get("kwargs") or {})
    if isinstance(kwargs.get("betas"), list):
        kwargs["betas"] = tuple(kwargs["betas"])
    kwargs.setdefault("weight_decay", opt.get("weight_decay") or 0.0)
    return kwargs


def ours(side: str, raw: dict, source: str, tmp: str, epochs: int, target: float) -> dict[str, Any]:
    from orchestrator.trainer import ElasticTrainer

    mode = "allreduce" if side == "allreduce_fp32" else side
    extra = MODES[mode] + (["model.precision=fp32"] if side == "allreduce_fp32" else [])
    try:
        r = ElasticTrainer(job_config(raw, source, tmp, epochs, target, extra), show_progress=False).fit()
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}
    t = r.time_to_target_s
    return {"to_target_s": t, "train_to_target_s": None if t is None else t - r.startup_s,
            "final_perplexity": r.final.test_perplexity, "steady": r.steady_samples_per_s, "whole": r.samples_per_s,
            "startup_s": r.startup_s, "epochs": r.epochs, "steps": r.steps, "samples": r.samples,
            "history": [{"epoch": e["epoch"], "perplexity": e.get("test_perplexity"), "t": e["t"]}
                        for e in r.events if e["kind"] == "epoch_end"],
            "precision": "fp32" if side == "allreduce_fp32" else raw["model"].get("precision", "fp32")}


def single(raw: dict, source: str, tmp: str, epochs: int, target: float, threads: int = 2) -> dict[str, Any]:
    """One PyTorch process with `threads` threads (module docstring, `single`)."""
    import torch
    import torch.nn.functional as F

    from policies.rules.factory import build_model
    from policies.rules.recipe import Schedule, planned_steps

    cfg = job_config(raw, source, tmp, epochs, target, [])
    d = plan(cfg)
    data, opt_spec = cfg.data, raw["optimizer"]
    k, batch, seed = data.accumulate, data.batch_size, data.seed
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        parts = [read_rows(d.train_plan, [r]) for r in d.train_plan.ranges]
        tx, ty = read_rows(d.test_plan, d.test_plan.ranges)
        rows = list(d.train_plan.rows)
        plans = [[epoch_batches(rows, r, e, seed, batch * k) for r in range(WORKERS)] for e in range(1, epochs + 1)]
        total = planned_steps(d.train_rows, batch, k, WORKERS, epochs)
        schedule = Schedule(opt_spec.get("schedule"), total)
        lr, clip = float(opt_spec["lr"]), opt_spec.get("clip_grad_norm")
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(raw["model"].get("precision", "fp32"))
        autocast = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype else contextlib.nullcontext
        model = build_model(cfg.model.factory, cfg.model.kwargs, seed)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, **optimizer_kwargs(opt_spec))
        model.train()
        t0 = time.perf_counter()
        history, to_target, samples, train_s, step = [], None, 0, 0.0, 0
        for epoch, per_rank in enumerate(plans, start=1):
            t_loop = time.perf_counter()
            for i in range(max(len(b) for b in per_rank)):
                batches = [b[i] for b in per_rank if i < len(b)]  # a rank with none left adds nothing
                chunks = [[(p, m) for m in micro(idx, k)] for p, idx in batches]
                n = sum(len(idx) for _, idx in batches)
                for j in range(max(len(c) for c in chunks)):
                    pieces = [c[j] for c in chunks if j < len(c)]
                    x = torch.cat([torch.index_select(parts[p][0], 0, m) for p, m in pieces])
                    y = torch.cat([torch.index_select(parts[p][1], 0, m) for p, m in pieces])
                    with autocast():
                        out = model(x)
                        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), ignore_index=-1)
                    (loss.float() * (len(y) / n)).backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                for g in opt.param_groups:
                    g["lr"] = lr * schedule.factor(step)
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                samples += n
            train_s += time.perf_counter() - t_loop
            nll, tokens = perplexity_sums(model, tx, ty, batch)
            elapsed = time.perf_counter() - t0
            ppl = float(torch.tensor(nll / tokens).exp())
            history.append({"epoch": epoch, "perplexity": ppl, "t": elapsed})
            if to_target is None and ppl <= target:
                to_target = elapsed
    finally:
        torch.set_num_threads(saved)
    return {"to_target_s": to_target, "train_to_target_s": to_target, "final_perplexity": history[-1]["perplexity"],
            "steady": samples / train_s, "whole": samples / history[-1]["t"], "startup_s": 0.0, "epochs": len(history),
            "steps": step, "samples": samples, "history": history}


def ray_train_loop(config: dict) -> None:
    """What a Ray Train user writes for the recipe (module docstring, `ray_train`); the batches
    are ours (epoch_batches) and the figures are gathered as our controller gathers them."""
    import ray.train
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from ray.train.torch import prepare_model

    from orchestrator.data.in_memory import eval_slices
    from policies.rules.factory import build_model
    from policies.rules.recipe import Schedule

    t_start = time.time()
    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    train_plan, test_plan, seed = config["train_plan"], config["test_plan"], config["seed"]
    batch, k, epochs, opt_spec = config["batch_size"], config["accumulate"], config["epochs"], config["optimizer"]
    rows = list(train_plan.rows)
    plans = {e: epoch_batches(rows, rank, e, seed, batch * k) for e in range(1, epochs + 1)}
    mine = sorted({p for steps in plans.values() for p, _ in steps})
    parts = {p: read_rows(train_plan, [train_plan.ranges[p]]) for p in mine}
    tx, ty = read_rows(test_plan, test_plan.ranges)
    lo, hi = eval_slices(len(ty), world)[rank]  # this worker's half of the test rows
    tx, ty = tx[lo:hi], ty[lo:hi]
    model = prepare_model(build_model(config["factory"], config["kwargs"], seed))
    opt = torch.optim.AdamW(model.parameters(), lr=float(opt_spec["lr"]), **optimizer_kwargs(opt_spec))
    schedule = Schedule(opt_spec.get("schedule"), config["planned_steps"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule.factor)
    clip = opt_spec.get("clip_grad_norm")
    history, t_first = [], time.time()
    for epoch in range(1, epochs + 1):
        model.train()
        samples = 0
        t0 = time.perf_counter()
        for p, idx in plans[epoch]:
            x, y = parts[p]
            chunks = micro(idx, k)
            for j, m in enumerate(chunks):
                sync = contextlib.nullcontext() if j == len(chunks) - 1 else model.no_sync()
                with sync:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        out = model(torch.index_select(x, 0, m))
                        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), torch.index_select(y, 0, m).reshape(-1))
                    (loss / len(chunks)).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            samples += len(idx)
        train_s = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        nll, tokens = perplexity_sums(model, tx, ty, batch)
        sums = torch.tensor([nll, tokens, samples], dtype=torch.float64)
        dist.all_reduce(sums)  # as our controller sums the replicas' evaluations and samples
        dist.all_reduce(train_s, op=dist.ReduceOp.MAX)  # the slowest worker's step loop, as ours
        ppl = float((sums[0] / sums[1]).exp())
        ray.train.report({"epoch": epoch, "test_perplexity": ppl})
        history.append({"epoch": epoch, "train_s": float(train_s[0]), "samples": int(sums[2]), "perplexity": ppl,
                        "t_end": time.time()})
    if rank == 0:
        with open(config["out"], "w") as f:
            json.dump({"t_start": t_start, "t_first": t_first, "history": history}, f)


def ray_train(raw: dict, source: str, tmp: str, epochs: int, target: float) -> dict[str, Any]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from policies.rules.recipe import planned_steps

    cfg = job_config(raw, source, tmp, epochs, target, [])
    d = plan(cfg)
    batch = cfg.data.batch_size * cfg.data.accumulate
    for epoch in range(1, epochs + 1):  # DDP needs as many backward passes on every worker
        counts = [len(epoch_batches(list(d.train_plan.rows), r, epoch, cfg.data.seed, batch)) for r in range(WORKERS)]
        if len(set(counts)) > 1:
            return {"error": f"epoch {epoch}: the workers take {counts} steps; DDP would hang"}
    out = os.path.join(tmp, f"raytrain-{time.time_ns()}.json")
    loop_config = {"train_plan": d.train_plan, "test_plan": d.test_plan, "seed": cfg.data.seed,
                   "batch_size": cfg.data.batch_size, "accumulate": cfg.data.accumulate, "epochs": epochs,
                   "optimizer": raw["optimizer"], "factory": cfg.model.factory, "kwargs": cfg.model.kwargs,
                   "planned_steps": planned_steps(d.train_rows, cfg.data.batch_size, cfg.data.accumulate, WORKERS,
                                                  epochs),
                   "out": out}
    trainer = TorchTrainer(
        ray_train_loop, train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=tmp, name=f"bench-recipe-{time.time_ns()}"),
    )
    t_call = time.time()
    try:
        trainer.fit()
        h = json.load(open(out))
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}
    hist = h["history"]
    samples = sum(e["samples"] for e in hist)
    hit = next((e for e in hist if e["perplexity"] <= target), None)
    return {"to_target_s": None if hit is None else hit["t_end"] - t_call,
            "train_to_target_s": None if hit is None else hit["t_end"] - h["t_first"],
            "final_perplexity": hist[-1]["perplexity"], "steady": samples / sum(e["train_s"] for e in hist),
            "whole": samples / (hist[-1]["t_end"] - h["t_first"]), "startup_s": h["t_first"] - t_call,
            "epochs": len(hist), "samples": samples,
            "history": [{k: e[k] for k in ("epoch", "perplexity")} for e in hist]}


FIGURES = ("to_target_s", "train_to_target_s", "final_perplexity", "steady", "whole", "startup_s")


def summarise(runs: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {"reps": len(runs), "errors": [r["error"] for r in runs if "error" in r]}
    for key in FIGURES:
        vals = [r[key] for r in runs if r.get(key) is not None]
        out[key] = {"median": median(vals), "min": min(vals), "max": max(vals), "n": len(vals)} if vals else None
    return out


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], extra=[
        ("--reps", {"type": int, "default": None, "help": "repetitions (default 3, 1 with --quick)"}),
        ("--sides", {"default": None, "help": f"sides to run, comma-separated (default all: {','.join(SIDES)})"}),
        ("--epochs", {"type": int, "default": None, "help": "epochs per run (default: the YAML's stop.epochs; "
                                                            f"{QUICK_EPOCHS} with --quick)"})])
    import ray

    from examples.datasets import write_text

    raw = example()
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    epochs = args.epochs or (QUICK_EPOCHS if args.quick else int(raw["stop"]["epochs"]))
    target = QUICK_TARGET if args.quick else float(raw["stop"]["target"]["value"])
    sides = tuple(args.sides.split(",")) if args.sides else SIDES
    unknown = set(sides) - set(SIDES)
    if reps < 1 or unknown:
        raise SystemExit(f"--reps at least 1 (got {reps}); sides are {', '.join(SIDES)} (unknown: {sorted(unknown)})")
    runs: dict[str, list] = {side: [] for side in sides}
    t_bench = time.perf_counter()
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            source = write_text(os.path.join(tmp, "tiny_lm"))
            for rep in range(reps):
                for side in (sides if rep % 2 == 0 else sides[::-1]):
                    if side == "single":
                        r = single(raw, source, tmp, epochs, target)
                    elif side == "ray_train":
                        r = ray_train(raw, source, tmp, epochs, target)
                    else:
                        r = ours(side, raw, source, tmp, epochs, target)
                    runs[side].append(r)
                    print(f"rep {rep + 1}/{reps} {side:<14} " + json.dumps(
                        {k: r.get(k) for k in ("to_target_s", "train_to_target_s", "final_perplexity", "steady",
                                               "startup_s", "epochs", "error")}), flush=True)
    finally:
        ray.shutdown()

    summary = {side: summarise(rs) for side, rs in runs.items()}
    med = {side: {k: (v[k]["median"] if v[k] else None) for k in FIGURES} for side, v in summary.items()}
    ratios: dict[str, float] = {}

    def ratio(name: str, num: Optional[float], den: Optional[float]) -> None:
        if num and den:
            ratios[name] = num / den

    for side in MODES:
        if side not in med:
            continue
        for ref, tag in (("single", "single"), ("ray_train", "raytrain")):
            if ref not in med:
                continue
            ratio(f"{side}_vs_{tag}_train_to_target", med[ref]["train_to_target_s"], med[side]["train_to_target_s"])
            if ref == "ray_train":
                ratio(f"{side}_vs_{tag}_to_target", med[ref]["to_target_s"], med[side]["to_target_s"])
            ratio(f"{side}_vs_{tag}_steady", med[side]["steady"], med[ref]["steady"])
    if "allreduce" in med and "allreduce_fp32" in med:
        ratio("bf16_vs_fp32_steady", med["allreduce"]["steady"], med["allreduce_fp32"]["steady"])
        ratio("fp32_vs_bf16_perplexity", med["allreduce_fp32"]["final_perplexity"],
              med["allreduce"]["final_perplexity"])
    bench_s = time.perf_counter() - t_bench
    print(f"\n{epochs} epochs, target test perplexity <= {target}; median (min-max) over {reps} repetition(s); "
          f"{bench_s:.0f} s in all")
    print(f"  {'side':<14} {'to target s':>22} {'train to target s':>22} {'final ppl':>20} {'steady samples/s':>24}")

    def cell(v: Optional[dict], fmt: str) -> str:
        if v is None:
            return "None"
        return f"{v['median']:{fmt}} ({v['min']:{fmt}}-{v['max']:{fmt}})" if v["n"] > 1 else f"{v['median']:{fmt}}"

    for side, s in summary.items():
        print(f"  {side:<14} {cell(s['to_target_s'], '.2f'):>22} {cell(s['train_to_target_s'], '.2f'):>22} "
              f"{cell(s['final_perplexity'], '.3f'):>20} {cell(s['steady'], ',.0f'):>24}"
              + (f"  errors: {s['errors']}" if s["errors"] else ""))
    results = {"summary": summary, "runs": runs, "seconds": bench_s,
               "config": {"example": "examples/tiny_lm.yaml", "recipe": raw["optimizer"], "model": raw["model"],
                          "data": {k: raw["data"][k] for k in ("batch_size", "accumulate") if k in raw["data"]},
                          "workers": WORKERS, "epochs": epochs, "target_perplexity": target, "repetitions": reps,
                          "sides": list(sides)}}
    report("recipe", args.quick, results, ratios, args.json)


if __name__ == "__main__":
    main()
