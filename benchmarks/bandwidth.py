"""Where the link bounds the step: allreduce, fp16-compressed allreduce and local SGD on an
emulated slower network, against the cost model's prediction.

Workload: the main example's CNN (421,642 parameters: 1.69 MB of float32 gradients a step) on
mnist5k, 2 replicas, batch 64 each, sgd lr 0.05 momentum 0.9, through ElasticTrainer(cfg).fit()
on real Ray actors and gloo groups, until 97% test accuracy (at most 15 epochs). The link:
`faults.link_gbps` (actors/replica/reducer.py EmulatedLink): each collective of N bytes takes at least
2 (p - 1) / p x N x 8 / link bits on each replica, queued one after another on the link, the
gloo transfer itself included. Links: the machine's own loopback (none), 1 and 0.1 Gbit/s.

Sides (each the main example with):
  allreduce   nothing else
  fp16        strategy.compression=fp16 (half the bytes)
  powersgd    strategy.compression=powersgd, rank 2 (1.9% of the bytes, two all-reduces a step,
              after the backward pass)
  local_sgd   strategy.mode=local_sgd, strategy.period=8 (the model once per 8 steps)
Figures per run: steady samples/s (the result's steady_samples_per_s: samples over the slowest
replica's step-loop seconds), train seconds to 97% (time_to_target_s - startup_s) and the
epochs it took. Predicted samples/s: policies/decisions/cost_model.py with this machine's calibration
(`orchestrator simulate`'s: 30 steps of one replica's compute, a gloo ring between two
processes) and, for a set link, beta = 8 / link bits per second (alpha 0); the model counts no
overlap of communication with the backward pass.
Ratios (medians over repetitions): <link>:<side>_vs_allreduce (samples/s, above 1: faster),
<link>:<side>_predicted_vs_measured.

    python benchmarks/bandwidth.py [--quick] [--json PATH]

--quick: one repetition at 0.1 Gbit/s; without it three (data.seed 0, 1, 2) at every link.
"""
from __future__ import annotations

import os
import tempfile
import traceback
from typing import Any, Optional

from common import median, parse_args, report

TARGET, EPOCHS = 0.97, 15
SIDES = {"allreduce": [], "fp16": ["strategy.compression=fp16"],
         "powersgd": ["strategy.compression=powersgd", "strategy.powersgd_rank=2"],
         "local_sgd": ["strategy.mode=local_sgd", "strategy.period=8"]}
LINKS = {"loopback": None, "1gbps": 1.0, "0.1gbps": 0.1}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(side: str, gbps: Optional[float], seed: int, tmp: str) -> dict[str, Any]:
    from orchestrator import ElasticTrainer, JobConfig

    overrides = [f"data.seed={seed}", f"stop.epochs={EPOCHS}", f"stop.target_accuracy={TARGET}",
                 "checkpoint.every_epochs=0", f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db",
                 f"checkpoint.storage={tmp}/ck", "tracking.experiment=bench-bandwidth", *SIDES[side]]
    if gbps is not None:
        overrides.append(f"faults.link_gbps={gbps}")
    try:
        r = ElasticTrainer(JobConfig.from_yaml(os.path.join(REPO, "examples", "mnist_allreduce.yaml"), overrides),
                           show_progress=False).fit()
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}
    t = r.time_to_target_s
    return {"samples_per_s": r.steady_samples_per_s, "train_to_target_s": None if t is None else t - r.startup_s,
            "epochs": r.epochs, "final_accuracy": r.final.test_accuracy}


def predicted(links: dict[str, Optional[float]]) -> dict[str, dict[str, float]]:
    """Each side's samples/s by the cost model at each link, from one calibration here."""
    from dataclasses import replace

    from orchestrator import JobConfig
    from orchestrator.cli.calibration import allreduce_bytes_per_param, calibration
    from policies.decisions.cost_model import ModeShape, predict

    cfg = JobConfig.from_yaml(os.path.join(REPO, "examples", "mnist_allreduce.yaml"))
    here = calibration(cfg, cores=float(os.cpu_count() or 1))
    low_rank = allreduce_bytes_per_param(JobConfig.from_yaml(
        os.path.join(REPO, "examples", "mnist_allreduce.yaml"), SIDES["powersgd"]))
    out = {}
    for link, gbps in links.items():
        cal = here if gbps is None else replace(here, alpha_s=0.0, beta_s_per_byte=8 / (gbps * 1e9),
                                                source=f"{here.source}; link {gbps} Gbit/s")
        out[link] = {"allreduce": predict("allreduce", 2, cal).samples_per_s,
                     "fp16": predict("allreduce", 2, replace(cal, allreduce_bytes_per_param=2)).samples_per_s,
                     "powersgd": predict("allreduce", 2, replace(cal, allreduce_bytes_per_param=low_rank)).samples_per_s,
                     "local_sgd": predict("local_sgd", 2, cal, shape=ModeShape(period=8)).samples_per_s}
    return out


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import ray

    reps = 1 if args.quick else 3
    links = {"0.1gbps": 0.1} if args.quick else LINKS
    results: dict[str, Any] = {link: {side: [] for side in SIDES} for link in links}
    results["predicted"] = predicted(links)
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(reps):
                for link, gbps in links.items():
                    for side in SIDES:
                        r = run(side, gbps, rep, tmp)
                        results[link][side].append(r)
                        print(f"rep {rep + 1}/{reps} {link:<8} {side:<9} " + ", ".join(
                            f"{k} {r.get(k):.2f}" if isinstance(r.get(k), float) else f"{k} {r.get(k)}"
                            for k in ("samples_per_s", "train_to_target_s", "epochs", "error")), flush=True)
    finally:
        ray.shutdown()
    ratios: dict[str, float] = {}
    summary: dict[str, Any] = {}
    for link in links:
        med = {}
        for side, rs in results[link].items():
            ok = [r for r in rs if "error" not in r]
            rate = [r["samples_per_s"] for r in ok]
            tta = [r["train_to_target_s"] for r in ok if r["train_to_target_s"] is not None]
            summary[f"{link}:{side}"] = {
                "samples_per_s": {"median": median(rate), "min": min(rate), "max": max(rate)} if rate else None,
                "train_to_target_s": {"median": median(tta), "min": min(tta), "max": max(tta), "n": len(tta),
                                      "of": len(rs)} if tta else None,
                "epochs": [r["epochs"] for r in ok], "predicted_samples_per_s": results["predicted"][link][side]}
            if rate:
                med[side] = median(rate)
                ratios[f"{link}:{side}_predicted_vs_measured"] = results["predicted"][link][side] / med[side]
        for side in ("fp16", "powersgd", "local_sgd"):
            if side in med and "allreduce" in med:
                ratios[f"{link}:{side}_vs_allreduce"] = med[side] / med["allreduce"]
    results["summary"] = summary
    results["config"] = {"model": "examples.models:mnist_cnn", "params": 421642, "replicas": 2, "batch": 64,
                         "links_gbps": links, "target": TARGET, "repetitions": reps, "seeds": list(range(reps))}
    print("\nsteady samples/s (median, min-max) | train s to 97% | predicted samples/s:")
    for key, v in summary.items():
        rate, tta = v["samples_per_s"], v["train_to_target_s"]
        print(f"  {key:<20} " + (f"{rate['median']:.0f} ({rate['min']:.0f}-{rate['max']:.0f})" if rate else "-")
              + " | " + (f"{tta['median']:.2f} ({tta['min']:.2f}-{tta['max']:.2f})" if tta else "not reached")
              + f" | {v['predicted_samples_per_s']:.0f}")
    report("bandwidth", args.quick, results, ratios, args.json)


if __name__ == "__main__":
    main()
