"""Live mode switching: (a) how long each kind of switch takes, (b) time to 97% on mnist5k with
a straggler window: the adaptive policy against each fixed mode, in the same run.

Workload: mnist5k and the CNN of examples/, 2 replicas (1 CPU each), batch 64, through
ElasticTrainer(cfg).fit() (real Ray actors, shards, gloo groups; MLflow in a temp sqlite store).

(a) One run per repetition whose phases cycle through every kind of switch, each phase lasting
    `until: {seconds: PHASE_S}` (decided mid-epoch; carried out at the next partition boundary, or
    at the epoch's end when the epoch runs out first: each event's `mid_epoch` says which):
    allreduce -> downpour -> easgd -> allreduce -> easgd -> downpour -> allreduce.
    Per switch, from its `mode_switch` event: switch_s (from the decision until every replica
    has stepped in the new mode: pausing at partition boundaries, consolidation, the two
    evaluations before/after, the new group, resuming) and reconfigure_s (the driver's part, per step in reconfigure_parts_s).
    Ratio: switch_budget_vs_switch_s[<from>-><to>] = 1 s (the aim) / median switch_s: above 1 is
    under the aim.
(b) First T0: allreduce's training seconds to 97% with no straggler (examples/mnist_allreduce.yaml).
    Then replica 1 is slowed 3x (faults.slow_replicas factor 3: after each step it sleeps twice
    that step's compute; before commit 44c106b, twice its whole duration, waiting included) from T0/3 to 2*T0/3 seconds after training starts, the middle third of a
    straggler-free run, in each of:
      allreduce  examples/mnist_allreduce.yaml
      downpour   examples/mnist_downpour.yaml
      easgd      examples/mnist_easgd.yaml
      adaptive   examples/mnist_adaptive.yaml (local SGD with balanced periods since the commit
                 that made it so, balanced allreduce from 44c106b; easgd only for a straggler
                 balancing cannot absorb; before 44c106b, allreduce <-> easgd on the compute
                 spread; its own straggler window replaced by this one)
    each with its own example's optimizer settings, the same data, model, batch, replicas, 32
    partitions, a progress row every 2 steps sent every 0.25 s (tracking.log_every_steps,
    progress_interval_s) for all, stop at 97% (stop.epochs 30, stop.at_target true). Figure: train_to_target_s =
    time_to_target_s - startup_s (training seconds until the first epoch-end evaluation at or
    above 97%; every case evaluates at the same points: each epoch's end, on the same test set).
    Ratios: adaptive_vs_<mode> = that mode's train_to_target_s / adaptive's (median over the
    repetitions; above 1: adaptive was faster).

    python benchmarks/switching.py [--quick] [--json PATH]

--quick runs (a) and (b) once; without it, three times (the same runs, tighter medians).
"""
from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from typing import Any, Optional

from common import REPO, median, parse_args, report

PHASE_S = 1.5
CYCLE = ["allreduce", "downpour", "easgd", "allreduce", "easgd", "downpour", "allreduce"]
FIXED = ("allreduce", "downpour", "easgd")
TARGET = 0.97
FACTOR = 3.0


def config(example: str, tmp: str, overrides: list[str], phases: Optional[list] = None):
    from orchestrator.config import JobConfig, read_mapping

    raw = read_mapping(os.path.join(REPO, "examples", example))
    if phases is not None:
        raw["strategy"]["phases"] = phases
    base = [f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db", f"checkpoint.storage={tmp}/ck",
            "tracking.experiment=bench-switching", "tracking.progress_interval_s=0.25", "tracking.log_every_steps=2",
            "data.partitions=32"]
    return JobConfig.from_dict(raw, base + overrides)


def fit(cfg) -> Any:
    from orchestrator.trainer import ElasticTrainer

    return ElasticTrainer(cfg, show_progress=False).fit()


def switch_cycle(tmp: str) -> dict[str, Any]:
    phases = [{"mode": m, **({"until": {"seconds": PHASE_S}} if i < len(CYCLE) - 1 else {})}
              for i, m in enumerate(CYCLE)]
    for p in phases:
        if p["mode"] == "downpour":
            p["optimizer"] = {"momentum": 0.5}  # as in examples/mnist_phases.yaml
    cfg = config("mnist_phases.yaml", tmp, ["stop.epochs=30", "stop.target_accuracy=null",
                                            f"stop.max_wall_s={PHASE_S * len(CYCLE) + 2}",
                                            "strategy.rollback_margin=null"], phases)  # switch costs, not the guard
    t0 = time.perf_counter()
    result = fit(cfg)
    switches = [e for e in result.events if e["kind"] == "mode_switch"]
    return {"wall_s": time.perf_counter() - t0, "phases": result.phases,
            "switches": [{k: e.get(k) for k in ("from", "to", "switch_s", "reconfigure_s", "reconfigure_parts_s",
                                                "mid_epoch", "test_accuracy_before", "test_accuracy_after")}
                         for e in switches]}


def to_target(example: str, tmp: str, window: Optional[tuple[float, float]]) -> dict[str, Any]:
    overrides = ["stop.epochs=30", f"stop.target_accuracy={TARGET}", "stop.at_target=true"]
    slow = [{"rank": 1, "factor": FACTOR, "from_s": round(window[0], 3), "to_s": round(window[1], 3)}] if window else []
    overrides.append(f"faults.slow_replicas={json.dumps(slow)}")
    try:
        result = fit(config(example, tmp, overrides))
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}
    t = result.time_to_target_s
    return {"train_to_target_s": None if t is None else t - result.startup_s, "time_to_target_s": t,
            "startup_s": result.startup_s, "epochs": result.epochs, "final_accuracy": result.final.test_accuracy,
            "phases": result.phases,
            "switches": [{k: e.get(k) for k in ("from", "to", "rule", "numbers", "switch_s", "at_step")}
                         for e in result.events if e["kind"] == "mode_switch"]}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import ray

    reps = 1 if args.quick else 3
    results: dict[str, Any] = {"cycle": [], "baseline": [], "straggler": {m: [] for m in (*FIXED, "adaptive")}}
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(reps):
                cyc = switch_cycle(tmp)
                results["cycle"].append(cyc)
                print(f"rep {rep + 1}/{reps} cycle: " + ", ".join(f"{s['from']}->{s['to']} {s['switch_s']}s"
                                                                  for s in cyc["switches"]), flush=True)
                base = to_target("mnist_allreduce.yaml", tmp, None)
                results["baseline"].append(base)
                t0 = base.get("train_to_target_s")
                print(f"rep {rep + 1}/{reps} baseline allreduce: T0 = {t0}", flush=True)
                if not t0:
                    continue
                window = (t0 / 3, 2 * t0 / 3)
                for m in (*FIXED, "adaptive"):
                    r = to_target(f"mnist_{m}.yaml", tmp, window)
                    r["window_s"] = [round(w, 3) for w in window]
                    results["straggler"][m].append(r)
                    print(f"rep {rep + 1}/{reps} {m}: " + json.dumps(
                        {k: r.get(k) for k in ("train_to_target_s", "epochs", "final_accuracy", "error")}), flush=True)
    finally:
        ray.shutdown()

    ratios: dict[str, float] = {}
    kinds: dict[str, list[float]] = {}
    for cyc in results["cycle"]:
        for s in cyc["switches"]:
            if s["switch_s"] is not None:
                kinds.setdefault(f"{s['from']}->{s['to']}", []).append(s["switch_s"])
    summary: dict[str, Any] = {"switch_s": {k: {"median": median(v), "min": min(v), "max": max(v), "n": len(v)}
                                            for k, v in kinds.items()}}
    for k, v in kinds.items():
        ratios[f"switch_budget_vs_switch_s[{k}]"] = 1.0 / median(v)
    t = {m: [r["train_to_target_s"] for r in rs if r.get("train_to_target_s")] for m, rs in results["straggler"].items()}
    summary["train_to_target_s"] = {m: {"median": median(v), "min": min(v), "max": max(v), "n": len(v)} if v else None
                                    for m, v in t.items()}
    if t["adaptive"]:
        for m in FIXED:
            if t[m]:
                ratios[f"adaptive_vs_{m}"] = median(t[m]) / median(t["adaptive"])
    results["summary"] = summary
    results["config"] = {"data": "builtin:mnist5k", "model": "examples.models:mnist_cnn", "replicas": 2,
                         "phase_s": PHASE_S, "cycle": CYCLE, "target": TARGET, "straggler": {"rank": 1, "factor": FACTOR,
                         "window": "T0/3 .. 2*T0/3 training seconds"}, "repetitions": reps,
                         "overrides": ["tracking.progress_interval_s=0.25", "tracking.log_every_steps=2", "data.partitions=32",
                                       "stop.epochs=30", "stop.at_target=true", "tracking (temp sqlite)"]}
    print("\nswitch_s by kind (median, min-max):")
    for k, v in summary["switch_s"].items():
        print(f"  {k:<22} {v['median']:.3f}  ({v['min']:.3f}-{v['max']:.3f}, n={v['n']})")
    print("train seconds to 97% with the straggler window:")
    for m, v in summary["train_to_target_s"].items():
        print(f"  {m:<10} " + (f"{v['median']:.2f}  ({v['min']:.2f}-{v['max']:.2f}, n={v['n']})" if v else "not reached"))
    report("switching", args.quick, results, ratios, args.json)


if __name__ == "__main__":
    main()
