"""Time to 97% test accuracy on mnist5k for every mode, in four situations, against Ray Train
(DDP) and single-process PyTorch.

Workload: the CNN of examples/, mnist5k in 32 partitions, batch 64 per replica, sgd lr 0.05
momentum 0.9 (each example's own optimizer settings for ours), through ElasticTrainer(cfg).fit()
(real Ray actors, shards, gloo groups; MLflow in a temp sqlite store), a progress row every 2
steps sent every 0.25 s, stop at 97% (at most 30 epochs). Each repetition r uses data.seed r on
every side.

Sides:
  allreduce   examples/mnist_allreduce.yaml
  balanced    examples/mnist_allreduce.yaml with strategy.balance true (batch shares by speed)
  downpour    examples/mnist_downpour.yaml
  easgd       examples/mnist_easgd.yaml
  hogwild     examples/mnist_hogwild.yaml (the replicas write one shared-memory vector in place;
              all on this one node)
  backup      examples/mnist_allreduce.yaml with strategy.backup_replicas 1 (each step the first
              replicas - 1 gradients; the last one's dropped)
  local_sgd   examples/mnist_local_sgd.yaml (local steps, models averaged every 8 steps)
  local_bal   examples/mnist_local_sgd.yaml with strategy.balance true (periods by speed)
  gossip      examples/mnist_local_sgd.yaml with strategy.mode gossip, period 1 (each replica
              averages its model with its two ring neighbours' after every step; with 2
              replicas both neighbours are the other one)
  batch16     examples/mnist_allreduce.yaml with data.batch_size 16 (lr 0.05 as it is); only with --sides
  adaptive_batch  the same from 16 rows a replica with data.adaptive_batch {max: 128} (the batch
              grows with the measured gradient noise, the rate with the batch:
              docs/modes-allreduce-options.md "Adaptive batch size"); only with --sides
  adaptive    examples/mnist_adaptive.yaml (local SGD with balanced periods; easgd only for a
              straggler the balance cannot absorb); its own straggler window replaced by the
              situation's
  adaptive_allreduce  the same with strategy.adaptive.sync_mode allreduce (balanced batch shares
              instead; the example's synchronous mode before 2026-11-25)
  adaptive_backup  adaptive_allreduce with strategy.adaptive.async_mode backup (allreduce with one
              backup replica, not easgd, for a straggler the balance cannot absorb)
  adaptive_spread  the same with allreduce unbalanced as its synchronous mode and easgd for a
              replica computing at least 1.5x as long per step as the other (back at 1.2x)
  adaptive_lspread  the example with local SGD unbalanced as its synchronous mode and easgd for
              a replica computing at least 1.5x as long per step as the other (back at 1.2x);
              only with --sides (measured and ruled out: benchmarks/results/HISTORY.md)
  adaptive_h4  the example with strategy.period 4 (the models averaged twice as often); only
              with --sides (measured and ruled out: benchmarks/results/HISTORY.md)
  ray_train   Ray Train TorchTrainer, DDP, the same partitions, order, batches and evaluation
              as our allreduce (benchmarks/throughput.py ray_train_loop), the same straggler
  single      one PyTorch process (2 threads) on the global batches, no straggler: the
              reference of what the data and model allow (once per replica count)
Situations (the straggler: faults.slow_replicas factor F: after each step the replica sleeps
F - 1 times that step's compute, as a device F times slower would take):
  none        2 replicas, no straggler
  window      2 replicas, replica 1 3x slower from T0/3 to 2*T0/3 seconds of training (T0:
              allreduce's time in `none` in the same repetition)
  hetero      2 replicas, replica 1 2x slower for the whole run (a heterogeneous cluster)
  four        4 replicas, replica 3 3x slower for the whole run
  extreme     2 replicas, replica 1 20x slower for the whole run (past what balancing absorbs:
              the adaptive sides switch); only with --only extreme
Workload `--workload regression` (the same situations and figures): examples/regression.yaml
(an MLP on scikit-learn's Friedman #1, 20,000 rows written to a temp Parquet directory, 32
partitions), target test R^2 0.9, the example's settings with only the mode changed:
  allreduce, downpour, fsdp, hogwild, sandblaster  strategy.mode=<side>
  easgd       strategy.mode easgd, strategy.momentum 0.9 (EAMSGD)
  gossip      strategy.mode gossip, period 1
  adaptive_batch  data.batch_size 16 with data.adaptive_batch {max: 128}
(no Ray Train or single-process side: their loops are mnist's).
Figure: train_to_target_s (training seconds until the first epoch-end evaluation at or above
97%: time_to_target_s - startup_s for ours; from the first step for Ray Train and single), and
s_per_epoch = train_to_target_s / the epochs it took (speed without the luck of which epoch
first crosses 97%: the accuracy plateaus near it, so the epoch count moves with the data order).
Ratios (medians over repetitions; above 1: the first side is faster):
  <situation>:allreduce_vs_<adaptive side>, <situation>:best_fixed_vs_<adaptive side> (best of
  the fixed sides run), <situation>:allreduce_vs_<local_sgd | local_bal | backup | gossip |
  adaptive_batch | batch16>, <situation>:batch16_vs_adaptive_batch, <situation>:downpour_vs_hogwild,
  <situation>:ray_train_vs_<side>.

    python benchmarks/time_to_accuracy.py [--quick] [--json PATH] [--only SITUATION,...] [--sides SIDE,...] [--reps N]
                                          [--first-seed S] [--workload mnist5k|regression]

--quick: one repetition (seed 0) of `none` and `window`; without it three (seeds 0, 1, 2) of all four.
--reps N: N repetitions (seeds 0 .. N-1) instead. --first-seed S: seeds S .. S+N-1 (more
repetitions on seeds not run before).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

from common import median, parse_args, report

TARGET, PARTITIONS, EPOCHS = 0.97, 32, 30
OURS = {"allreduce": ("mnist_allreduce.yaml", []), "balanced": ("mnist_allreduce.yaml", ["strategy.balance=true"]),
        "backup": ("mnist_allreduce.yaml", ["strategy.backup_replicas=1"]),
        "downpour": ("mnist_downpour.yaml", []), "easgd": ("mnist_easgd.yaml", []),
        "hogwild": ("mnist_hogwild.yaml", []),
        "local_sgd": ("mnist_local_sgd.yaml", []), "local_bal": ("mnist_local_sgd.yaml", ["strategy.balance=true"]),
        "gossip": ("mnist_local_sgd.yaml", ["strategy.mode=gossip", "strategy.period=1"]),
        "batch16": ("mnist_allreduce.yaml", ["data.batch_size=16"]),
        "adaptive_batch": ("mnist_allreduce.yaml", ["data.batch_size=16", "data.adaptive_batch={max: 128}"]),
        "adaptive": ("mnist_adaptive.yaml", []),
        "adaptive_allreduce": ("mnist_adaptive.yaml", ["strategy.adaptive.sync_mode=allreduce"]),
        "adaptive_backup": ("mnist_adaptive.yaml", ["strategy.adaptive.sync_mode=allreduce",
                                                    "strategy.adaptive.async_mode=backup",
                                                    "strategy.momentum=0"]),  # no easgd phase
        "adaptive_spread": ("mnist_adaptive.yaml", ["strategy.adaptive.sync_mode=allreduce",
                                                    "strategy.adaptive.balance=false",
                                                    "strategy.adaptive.slow_ratio=1.5",
                                                    "strategy.adaptive.recover_ratio=1.2"]),
        "adaptive_lspread": ("mnist_adaptive.yaml", ["strategy.adaptive.balance=false",
                                                     "strategy.adaptive.slow_ratio=1.5",
                                                     "strategy.adaptive.recover_ratio=1.2"]),
        "adaptive_h4": ("mnist_adaptive.yaml", ["strategy.period=4"])}
REGRESSION = {"allreduce": [], **{m: [f"strategy.mode={m}"] for m in ("fsdp", "hogwild", "sandblaster")},
              # EAMSGD: plain SGD's local steps stall near R^2 0.78 (examples/regression.yaml)
              "easgd": ["strategy.mode=easgd", "strategy.momentum=0.9"],
              # as examples/mnist_downpour.yaml: stale gradients compound with the shards' momentum
              # (at the example's 0.9, four replicas stayed at R^2 ~0 for 30 epochs in each of 3 runs)
              "downpour": ["strategy.mode=downpour", "optimizer.momentum=0.5"],
              "gossip": ["strategy.mode=gossip", "strategy.period=1"],
              "adaptive_batch": ["data.batch_size=16", "data.adaptive_batch={max: 128}"]}
R2_TARGET = 0.9
ADAPTIVE = ("adaptive", "adaptive_allreduce", "adaptive_backup", "adaptive_spread", "adaptive_lspread", "adaptive_h4")
OPT_IN = ("adaptive_lspread", "adaptive_h4", "batch16", "adaptive_batch")  # run only when --sides names them
FIXED = ("allreduce", "balanced", "backup", "downpour", "easgd", "hogwild", "local_sgd", "local_bal", "gossip")
SITUATIONS = {"none": (2, None), "window": (2, (1, 3.0)), "hetero": (2, (1, 2.0)), "four": (4, (3, 3.0)),
              "extreme": (2, (1, 20.0))}
DEFAULT = ("none", "window", "hetero", "four")


def ours(side: str, tmp: str, replicas: int, seed: int, slow: Optional[dict],
         regression: Optional[str] = None) -> dict[str, Any]:
    """One run of our side; `regression`: the Parquet directory of the regression workload."""
    from orchestrator.trainer import ElasticTrainer
    from switching import config  # the same base overrides (temp MLflow store, progress rows, 32 partitions)

    if regression:
        example, extra = "regression.yaml", [f"data.source={regression}", f"stop.target.value={R2_TARGET}",
                                             *REGRESSION[side]]
    else:
        example, extra = OURS[side][0], [f"stop.target_accuracy={TARGET}", *OURS[side][1]]
    overrides = ["tracking.experiment=bench-time-to-accuracy", f"data.partitions={PARTITIONS}", f"data.seed={seed}",
                 f"scaling.replicas={replicas}", f"stop.epochs={EPOCHS}",
                 "stop.at_target=true", f"faults.slow_replicas={json.dumps([slow] if slow else [])}", *extra]
    try:
        r = ElasticTrainer(config(example, tmp, overrides), show_progress=False).fit()
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}
    t = r.time_to_target_s
    return {"train_to_target_s": None if t is None else t - r.startup_s, "epochs": r.epochs,
            "final_accuracy": r.final.get("test_r2" if regression else "test_accuracy"), "phases": r.phases,
            "switches": [{k: e.get(k) for k in ("from", "to", "rule", "at_step")}
                         for e in r.events if e["kind"] == "mode_switch"],
            "rebalances": sum(1 for e in r.events if e["kind"] == "batch_rebalanced"),
            "dropped_rows": sum(e["dropped_rows"] for e in r.events if e["kind"] == "backup_drops"),
            "batch_changes": [[e["epoch"], e["batch_to"]] for e in r.events if e["kind"] == "batch_size_changed"]}


def ray_train(tmp: str, replicas: int, seed: int, slow: Optional[dict]) -> dict[str, Any]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from throughput import ray_train_loop

    out = os.path.join(tmp, f"raytrain-{time.time_ns()}.json")
    trainer = TorchTrainer(
        ray_train_loop, train_loop_config={"epochs": EPOCHS, "out": out, "partitions": PARTITIONS, "seed": seed,
                                           "slow": slow, "stop_at": TARGET},
        scaling_config=ScalingConfig(num_workers=replicas, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=tmp, name=f"tta-{time.time_ns()}"),
    )
    try:
        trainer.fit()
        h = json.load(open(out))
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}
    hist = h["history"]
    t = next((e["t_end"] - h["t_first"] for e in hist if e["acc"] >= TARGET), None)
    return {"train_to_target_s": t, "epochs": len(hist), "final_accuracy": hist[-1]["acc"]}


def single(replicas: int, seed: int) -> dict[str, Any]:
    from throughput import single_process_to_target

    r = single_process_to_target(2, EPOCHS, world=replicas, partitions=PARTITIONS, seed=seed)
    return {"train_to_target_s": r["t97"], "epochs": r["epochs"], "final_accuracy": r["history"][-1]["acc"]}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], extra=[
        ("--only", {"default": None, "help": "situations to run, comma-separated"}),
        ("--sides", {"default": None, "help": "sides to run, comma-separated (default: all)"}),
        ("--reps", {"type": int, "default": None, "help": "repetitions (data.seed 0 .. N-1; default 3, 1 with --quick)"}),
        ("--first-seed", {"type": int, "default": 0, "help": "the first repetition's data.seed (default 0)"}),
        ("--workload", {"default": "mnist5k", "choices": ["mnist5k", "regression"],
                        "help": "mnist5k to 97%% accuracy (default) or the regression example to R^2 0.9"})])
    import ray

    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    if reps < 1:
        raise SystemExit(f"--reps: at least 1, got {reps}")
    if args.first_seed < 0:
        raise SystemExit(f"--first-seed: at least 0, got {args.first_seed}")
    wanted = args.only.split(",") if args.only else (["none", "window"] if args.quick else list(DEFAULT))
    regression = args.workload == "regression"
    known = tuple(REGRESSION) if regression else (*OURS, "ray_train", "single")
    default = tuple(REGRESSION) if regression else (*(s for s in OURS if s not in OPT_IN), "ray_train", "single")
    sides = tuple(args.sides.split(",")) if args.sides else default
    unknown = set(sides) - set(known)
    if unknown:
        raise SystemExit(f"--sides: unknown {sorted(unknown)}; {args.workload}'s sides are {', '.join(known)}")
    results: dict[str, Any] = {s: {side: [] for side in sides} for s in wanted}
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            data = None
            if regression:
                from examples.datasets import write_regression

                data = write_regression(os.path.join(tmp, "regression"))
            for rep in range(reps):
                seed = args.first_seed + rep
                t0 = None
                for situation in wanted:
                    replicas, straggler = SITUATIONS[situation]
                    slow = None
                    if straggler is not None:
                        rank, factor = straggler
                        slow = {"rank": rank, "factor": factor}
                        if situation == "window":
                            base = t0 or 9.0  # `none` not run: a typical T0 on this machine
                            slow.update({"from_s": round(base / 3, 3), "to_s": round(2 * base / 3, 3)})
                    for side in sides:
                        if side == "single" and situation not in ("none", "four"):
                            continue  # no straggler in one process: once per replica count
                        if side == "single":
                            r = single(replicas, seed)
                        elif side == "ray_train":
                            r = ray_train(tmp, replicas, seed, slow)
                        else:
                            r = ours(side, tmp, replicas, seed, slow, data)
                        r["slow"] = slow
                        results[situation][side].append(r)
                        if situation == "none" and side == "allreduce":
                            t0 = r.get("train_to_target_s")
                        print(f"rep {rep + 1}/{reps} {situation:<7} {side:<10} " + json.dumps(
                            {k: r.get(k) for k in ("train_to_target_s", "epochs", "final_accuracy", "error")}),
                              flush=True)
    finally:
        ray.shutdown()

    summary: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    for situation, by_side in results.items():
        t = {side: [r["train_to_target_s"] for r in rs if r.get("train_to_target_s")] for side, rs in by_side.items()}
        summary[situation] = {side: {"median": median(v), "min": min(v), "max": max(v), "n": len(v),
                                     "of": len(by_side[side])} if v else None for side, v in t.items()}
        per_epoch = {side: [r["train_to_target_s"] / r["epochs"] for r in rs if r.get("train_to_target_s")]
                     for side, rs in by_side.items()}
        summary[f"{situation}:s_per_epoch"] = {side: {"median": median(v), "min": min(v), "max": max(v)} if v else None
                                               for side, v in per_epoch.items()}
        med = {side: median(v) for side, v in t.items() if v}
        for adaptive in ADAPTIVE:
            if adaptive not in med:
                continue
            if "allreduce" in med:
                ratios[f"{situation}:allreduce_vs_{adaptive}"] = med["allreduce"] / med[adaptive]
            fixed = [med[s] for s in FIXED if s in med]
            if fixed:
                ratios[f"{situation}:best_fixed_vs_{adaptive}"] = min(fixed) / med[adaptive]
        if "downpour" in med and "hogwild" in med:
            ratios[f"{situation}:downpour_vs_hogwild"] = med["downpour"] / med["hogwild"]
        if "batch16" in med and "adaptive_batch" in med:
            ratios[f"{situation}:batch16_vs_adaptive_batch"] = med["batch16"] / med["adaptive_batch"]
        for side in (REGRESSION if regression else ("local_sgd", "local_bal", "backup", "gossip", "adaptive_batch", "batch16")):
            if side in med and "allreduce" in med and side != "allreduce":
                ratios[f"{situation}:allreduce_vs_{side}"] = med["allreduce"] / med[side]
        if "ray_train" in med:
            for side in (*OURS,):
                if side in med:
                    ratios[f"{situation}:ray_train_vs_{side}"] = med["ray_train"] / med[side]
    results["summary"] = summary
    results["config"] = {"workload": args.workload, "partitions": PARTITIONS,
                         **({"data": "scikit-learn Friedman #1, 20,000 rows (examples/datasets.py)",
                             "model": "examples.models:regression_mlp", "target": {"test_r2": R2_TARGET}} if regression else
                            {"data": "builtin:mnist5k", "model": "examples.models:mnist_cnn", "target": TARGET}),
                         "situations": {k: {"replicas": v[0], "straggler": v[1]}
                                                          for k, v in SITUATIONS.items() if k in wanted},
                         "window": "T0/3 .. 2*T0/3 training seconds, T0 = allreduce's time in `none`",
                         "repetitions": reps, "seeds": list(range(args.first_seed, args.first_seed + reps))}
    print(f"\ntrain seconds to {'R^2 0.9' if regression else '97%'} (median, min-max, reached/runs):")
    for situation, by_side in summary.items():
        if ":" in situation:
            continue
        for side, v in by_side.items():
            if not results[situation][side]:
                continue  # not run in this situation (single: once per replica count)
            e = summary[f"{situation}:s_per_epoch"].get(side)
            print(f"  {situation:<7} {side:<10} " + (f"{v['median']:.2f}  ({v['min']:.2f}-{v['max']:.2f}, "
                                                     f"{v['n']}/{v['of']}); {e['median']:.2f} s/epoch" if v else
                                                     "not reached"))
    report("time_to_accuracy" if not regression else "time_to_accuracy_regression", args.quick, results, ratios, args.json)


if __name__ == "__main__":
    sys.exit(main())
