"""The cost model (policies/cost_model.py) against measured samples/s on this machine.

The model is calibrated here exactly as `python -m orchestrator simulate` does it (30 steps of
the CNN on one real batch with one replica's threads; a gloo all-reduce between two local
processes), with `cores` = this machine's CPU count (more replicas than cores share them). Then
the main example's CNN on mnist5k runs for a few epochs in allreduce, downpour and easgd (the
examples' settings) at 1, 2 and 4 replicas (cpus_per_replica 0.5, as many replicas fit as the
test suite runs), each run's steady samples/s (samples / the slowest replica's step-loop
seconds) measured. Ratio per mode and size: predicted / measured samples/s (1.0 = exact; the aim
is within 0.75-1.25). Also the model's predictions at 1,000 replicas for a 10 Gbit/s, 50 us link
(the figures docs/benchmarks.md quotes with their assumptions).

    python benchmarks/cost_model.py [--quick] [--json PATH]
"""
from __future__ import annotations

import os
import tempfile

from common import parse_args, report

SIZES = (1, 2, 4)
MODES = ("allreduce", "downpour", "easgd")


def measured(mode: str, replicas: int, epochs: int, storage: str) -> float:
    from orchestrator import ElasticTrainer, JobConfig

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = JobConfig.from_yaml(os.path.join(repo, "examples", f"mnist_{mode}.yaml"), [
        f"stop.epochs={epochs}", "stop.target_accuracy=null", f"scaling.replicas={replicas}",
        "scaling.cpus_per_replica=0.5", "checkpoint.every_epochs=0",
        f"tracking.tracking_uri=sqlite:///{storage}/mlflow.db", f"checkpoint.storage={storage}/ck"])
    return ElasticTrainer(cfg, show_progress=False).fit().steady_samples_per_s


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import ray

    from orchestrator import JobConfig
    from orchestrator.simulate import calibration
    from policies.cost_model import Calibration, ModeShape, predict

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    epochs = 2 if args.quick else 4
    results: dict = {"predicted": {}, "measured": {}, "calibration": {}, "at_1000": {}}
    ratios: dict[str, float] = {}
    cores = float(os.cpu_count() or 1)
    cals = {}
    for mode in MODES:
        cfg = JobConfig.from_yaml(os.path.join(repo, "examples", f"mnist_{mode}.yaml"),
                                  ["scaling.cpus_per_replica=0.5"])
        cal = calibration(cfg, cores=cores)
        shape = ModeShape(period=cfg.strategy.tau, shards=cfg.scaling.shards, n_push=cfg.strategy.n_push,
                          n_fetch=cfg.strategy.n_fetch)
        cals[mode] = (cal, shape)
        results["calibration"][mode] = {"compute_s": cal.compute_s, "alpha_s": cal.alpha_s,
                                        "beta_s_per_byte": cal.beta_s_per_byte, "params": cal.params}
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for mode in MODES:
                cal, shape = cals[mode]
                for n in SIZES:
                    key = f"{mode}_{n}"
                    results["measured"][key] = measured(mode, n, epochs, tmp)
                    results["predicted"][key] = predict(mode, n, cal, shape=shape).samples_per_s
                    ratios[f"predicted_vs_measured_{key}"] = results["predicted"][key] / results["measured"][key]
                    print(f"{key}: measured {results['measured'][key]:.0f} samples/s, predicted "
                          f"{results['predicted'][key]:.0f}", flush=True)
    finally:
        ray.shutdown()
    for mode in MODES:  # at scale: a 10 Gbit/s, 50 us link, every replica on its own cores
        cal, shape = cals[mode]
        far = Calibration(cal.params, cal.batch, cal.compute_s, 50e-6, 8 / 10e9, None, "10 Gbit/s, 50 us")
        p = predict(mode, 1000, far, shape=shape)
        results["at_1000"][mode] = p.row()
    within = [0.75 <= r <= 1.25 for r in ratios.values()]
    results["within_25_percent"] = f"{sum(within)} of {len(within)}"
    print(f"within 25%: {results['within_25_percent']}")
    report("cost_model", args.quick, results, ratios, args.json)


if __name__ == "__main__":
    main()
