"""fsdp against allreduce: what a replica holds, its peak memory, and its speed, at 1, 2, 4 replicas.

Workload: the wide MLP (`examples.models:wide_mlp`, 4 layers of 4096 -> 50.5M parameters,
202 MB fp32; quick: 2048 wide, 12.7M, 51 MB) on 1,024 rows of Gaussian blobs (32 features, 4
classes), AdamW (two moments: a whole replica holds 4 x the parameters' bytes of parameters,
gradients and state), 2 epochs of 64 rows a replica a step, through `ElasticTrainer` on a local
Ray started here. Both modes take the same steps on the same rows (fsdp's update is allreduce's).

Per run: `replica_state_mb` (fsdp: each replica's parameters, gradients and optimizer state as
the tensors it holds, measured on them; allreduce: the same sum computed from the model, every
replica holding all of it), and the replicas' peak RSS (VmHWM from /proc, sampled every 0.2 s
for every `ray::ModelReplica` process; it includes torch itself, ~the same in both modes: the
largest replica's and the median replica's; an fsdp replica builds the model whole once before
sharding it, and gives the run's final checkpoint only its own slices), and
the seconds of the second epoch's step loop (the slowest replica's).

Ratios (higher is better for fsdp): allreduce's state / fsdp's, allreduce's peak RSS / fsdp's,
at each replica count; and allreduce's epoch seconds / fsdp's (below 1: fsdp's extra
collectives cost time; each unit's parameters are gathered before its forward and again before
its backward, its gradients reduce-scattered after it).

    python benchmarks/fsdp_memory.py [--quick] [--json PATH]
"""
from __future__ import annotations

import os
import tempfile
import threading
import time

from common import median, parse_args, report

SAMPLE_S = 0.2


def model_pids() -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if b"ray::ModelReplica" in f.read():
                        pids.append(int(name))
            except OSError:
                pass
    return pids


def vm_hwm_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class PeakSampler(threading.Thread):
    """The largest VmHWM each replica process reached while the run went on."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peaks: dict[int, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for pid in model_pids():
                self.peaks[pid] = max(self.peaks.get(pid, 0.0), vm_hwm_mb(pid))
            time.sleep(SAMPLE_S)


def blobs(rows: int = 1024, dim: int = 32, classes: int = 4):
    import numpy as np

    rng = np.random.default_rng(0)
    y = rng.integers(0, classes, size=rows)
    x = rng.normal(0, 3, size=(classes, dim))[y] + rng.normal(0, 1, size=(rows, dim))
    return x.astype(np.float32), y.astype(np.int64)


def one_run(mode: str, replicas: int, hidden: int, tmp: str) -> dict:
    from orchestrator.config import JobConfig
    from orchestrator.models import build_model
    from orchestrator.trainer import ElasticTrainer
    from policies.rules.fsdp import estimate_bytes

    raw = {"model": {"factory": "examples.models:wide_mlp", "kwargs": {"hidden": hidden, "depth": 4}},
           "data": {"batch_size": 64},
           "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.0},
           "strategy": {"mode": mode, "timeout_s": 120},
           "scaling": {"replicas": replicas, "cpus_per_replica": 0.5},
           "stop": {"epochs": 2}, "checkpoint": {"every_epochs": 0, "storage": os.path.join(tmp, "ck")},
           "tracking": {"tracking_uri": f"sqlite:///{tmp}/mlflow.db"}}
    cfg = JobConfig.from_dict(raw)
    sampler = PeakSampler()
    sampler.start()
    try:
        result = ElasticTrainer(cfg, show_progress=False, data=blobs()).fit()
    finally:
        sampler.done.set()
        sampler.join()
    ends = [e for e in result.events if e["kind"] == "epoch_end"]
    model = build_model(cfg.model.factory, cfg.model.kwargs, cfg.data.seed)
    whole = estimate_bytes(model, raw["optimizer"] | {"momentum": 0.0}, replicas, split=False) / 1e6
    state = ends[-1].get("replica_state_mb", whole)
    return {"mode": mode, "replicas": replicas, "state_mb": round(state, 3),
            "peak_rss_mb": round(max(sampler.peaks.values(), default=0.0), 1),
            "peak_rss_median_mb": round(median(list(sampler.peaks.values())) if sampler.peaks else 0.0, 1),
            "epoch_s": max(ends[-1]["train_s_by_rank"]), "accuracy": result.final.test_accuracy}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], (("--reps", {"type": int, "default": None}),))
    hidden = 2048 if args.quick else 4096
    reps = args.reps or (1 if args.quick else 3)
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    runs = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(reps):
                for replicas in (1, 2, 4):
                    for mode in ("allreduce", "fsdp"):  # interleaved: the machine's drift falls on both
                        run = one_run(mode, replicas, hidden, os.path.join(tmp, f"{mode}-{replicas}-{rep}"))
                        runs.append(run)
                        print(run, flush=True)
    finally:
        ray.shutdown()
    ratios, table = {}, {}
    for replicas in (1, 2, 4):
        side = {m: [r for r in runs if r["mode"] == m and r["replicas"] == replicas] for m in ("allreduce", "fsdp")}
        fig = {m: {k: median([r[k] for r in rs]) for k in ("state_mb", "peak_rss_mb", "peak_rss_median_mb", "epoch_s")}
               for m, rs in side.items()}
        table[replicas] = fig
        ratios[f"state_allreduce_vs_fsdp_{replicas}"] = fig["allreduce"]["state_mb"] / fig["fsdp"]["state_mb"]
        ratios[f"peak_rss_allreduce_vs_fsdp_{replicas}"] = fig["allreduce"]["peak_rss_mb"] / fig["fsdp"]["peak_rss_mb"]
        ratios[f"median_replica_rss_allreduce_vs_fsdp_{replicas}"] = (fig["allreduce"]["peak_rss_median_mb"]
                                                                     / fig["fsdp"]["peak_rss_median_mb"])
        ratios[f"epoch_s_allreduce_vs_fsdp_{replicas}"] = fig["allreduce"]["epoch_s"] / fig["fsdp"]["epoch_s"]
    print("\nreplicas  mode       state MB  peak RSS MB (largest, median replica)  epoch s (medians)")
    for replicas, fig in table.items():
        for mode, f in fig.items():
            print(f"{replicas:>8}  {mode:<9}  {f['state_mb']:8.2f}  {f['peak_rss_mb']:8.1f} {f['peak_rss_median_mb']:8.1f}"
                  f"  {f['epoch_s']:7.2f}")
    report("fsdp_memory", args.quick, {"hidden": hidden, "reps": reps, "runs": runs, "medians": table}, ratios, args.json)


if __name__ == "__main__":
    main()
