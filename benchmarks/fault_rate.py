"""Efficiency at a fault rate: what a replica SIGKILLed every T seconds costs a run.

Workload: mnist5k and the CNN of examples/ (2 replicas, 1 CPU each, batch 64), 32 partitions, no
target, `stop.max_wall_s` DURATION seconds of training, MLflow in a temp sqlite store, through
ElasticTrainer(cfg).fit() (real Ray actors, gloo groups, shards). For each mode (its example's
settings; a mode without an example of its own: allreduce's with strategy.mode set) and each
`fault_tolerance.spares` (0: a new actor replaces the killed one; 1: a pre-started spare takes
its place), a run with a replica's process SIGKILLed every T seconds
(orchestrator/testing/chaos.py: Fault kill_replica at_s T/2, 3T/2, ..., ranks 0 and 1 in turn;
max_replica_restarts high enough that every kill is replaced) and a fault-free run of the same
length and the same spares, interleaved (a spare's own start is the price of the spare, not of
the faults). Figures per run, from its events:

    epochs_per_s     completed epochs (each one every training row once) / seconds from the
                     `started` event to the last `epoch_end`
    efficiency       epochs_per_s with faults / the fault-free run's (useful work done, the
                     rows redone after a kill and the time to recover counted as lost)
    recovery_s       each replacement's seconds from the kill seen to every replica stepping
                     (its event's recovery_s; median over the run's faults)
    predicted        1 - recovery_s / T: the efficiency if a fault cost only its recovery
    predicted_busy   predicted - spare_cpu_s / (T * cores): the efficiency if, besides its
                     recovery, each kill's new spare took its start's CPU seconds from the
                     training, on a machine of `cores` cores (os.cpu_count()) all of them
                     training (no idle core, as on the 2-core machine with 2 replicas)
    steps_lost       per fault (its event's steps_lost: steps the survivors redo, lock-step modes)
    spare_cpu_s      per new spare (its `spare_ready` event's cpu_s, median): the CPU seconds a
                     spare's start takes (imports, model, rehearsal); a spare put to use is replaced
                     at once, so on a node short of cores each kill takes about this much CPU from
                     the training beside it, which `predicted` leaves out

Beside them, torchft's published anchor (its Fault Tolerant Llama run: 30 replica groups, a
failure every 60 s, 82.3% of steps committed, 81.2% efficiency; about 30.2% at a failure every
~15 s); a different workload and scale, quoted as the figure its users know, not a like-for-like
comparison. Left out: start-up (not in the seconds), the final checkpoint and evaluation.

    python benchmarks/fault_rate.py [--quick] [--json PATH] [--modes MODE,...] [--spares N,...] [--every T,...]
                                    [--reps N] [--replicas N]

--quick: T 15 s, allreduce and downpour, 45 s runs (3 kills each), three repetitions (~30 minutes
on 2 cores); else T 15 and 60 s, every mode, 4T runs, three repetitions (hours). --modes (of
allreduce, downpour, easgd, local_sgd, hogwild, gossip, fsdp, sandblaster), --spares (of 0, 1),
--every (of the form's T values) and --reps run a part of either; --replicas N trains N replicas
instead of the example's 2 (one replica of 1 CPU leaves this 2-core machine an idle core for the
new spare's start).
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
from typing import Any, Optional

from common import MODE_EXAMPLES, example_text, median, mode_example, parse_args, report


TORCHFT = {"failure_every_s": {"60": {"efficiency": 0.812, "steps_committed": 0.823}, "15": {"efficiency": 0.302}},
           "setup": "torchft Fault Tolerant Llama: 30 replica groups (published figures)"}


def one_run(mode: str, spares: int, every_s: Optional[float], duration_s: float,
            replicas: Optional[int] = None) -> dict[str, Any]:
    from orchestrator.config import JobConfig
    from orchestrator.testing.chaos import Fault, FaultInjector
    from orchestrator.trainer import ElasticTrainer

    with tempfile.TemporaryDirectory(prefix=f"bench-faults-{mode}-") as tmp:
        example, sets = mode_example(mode)
        cfg = JobConfig.from_yaml(example, [*sets,
            "stop.epochs=100000", "stop.target_accuracy=null", f"stop.max_wall_s={duration_s}", "data.partitions=32",
            f"fault_tolerance.spares={spares}", "fault_tolerance.max_replica_restarts=1000",
            f"checkpoint.storage={tmp}/ck", f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db",
            "tracking.experiment=bench-fault-rate"] + ([f"scaling.replicas={replicas}"] if replicas else []))
        trainer = ElasticTrainer(cfg, show_progress=False)
        # one kill in the middle of each T-second window (T/2, 3T/2, ...): a kill every T seconds whose
        # recovery lies inside the run, none in its last moments (where it would stretch the last epoch only)
        n = cfg.scaling.replicas
        faults = ([Fault("kill_replica", target=i % n, at_s=every_s * (i + 0.5)) for i in range(int(duration_s // every_s))]
                  if every_s else [])
        with FaultInjector(lambda: trainer.controller, faults) as inj:
            result = trainer.fit()
        fired = len(inj.fired)
    events = result.events
    started = next(e["t_wall"] for e in events if e["kind"] == "started")
    ends = [e for e in events if e["kind"] == "epoch_end"]
    seconds = ends[-1]["t_wall"] - started
    replaced = [e for e in events if e["kind"] == "replica_replaced"]
    recoveries = [e["recovery_s"] for e in replaced if e.get("recovery_s") is not None]
    spare_cpu = [e["cpu_s"] for e in events if e["kind"] == "spare_ready"]
    return {"epochs": len(ends), "seconds": seconds, "epochs_per_s": len(ends) / seconds, "faults": fired,
            "replaced": len(replaced), "dropped": sum(1 for e in events if e["kind"] in ("replica_dropped", "resize")),
            "recovery_s": statistics.median(recoveries) if recoveries else None,
            "steps_lost": statistics.mean(e.get("steps_lost", 0) for e in replaced) if replaced else None,
            "spare_cpu_s": statistics.median(spare_cpu) if spare_cpu else None,
            "how": sorted({h for e in replaced for h in e.get("how", {}).values()})}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], extra=[
        ("--modes", {"default": None, "help": f"modes to run, comma-separated, of {', '.join(MODE_EXAMPLES)}"}),
        ("--spares", {"default": "0,1", "help": "fault_tolerance.spares values to run, comma-separated (default 0,1)"}),
        ("--reps", {"type": int, "default": 3, "help": "repetitions (default 3)"}),
        ("--replicas", {"type": int, "default": None, "help": "replicas to train (default: the example's, 2)"}),
        ("--every", {"default": None, "help": "T values (seconds) to run, comma-separated, of the form's own "
                                              "(--quick: 15; else 15,60)"})])
    if args.quick:
        modes, periods, length = ("allreduce", "downpour"), (15.0,), lambda t: 45.0
    else:
        modes, periods, length = tuple(MODE_EXAMPLES), (15.0, 60.0), lambda t: 4 * t
    if args.every:
        try:
            chosen = tuple(float(t) for t in args.every.split(","))
        except ValueError:
            raise SystemExit(f"--every: seconds, comma-separated, got {args.every!r}") from None
        if not chosen or set(chosen) - set(periods):
            raise SystemExit(f"--every: of {', '.join(f'{t:g}' for t in periods)} in this form, got {args.every!r}")
        periods = chosen
    if args.modes:
        modes = tuple(args.modes.split(","))
        unknown = sorted(set(modes) - set(MODE_EXAMPLES))
        if unknown:
            raise SystemExit(f"--modes: unknown {unknown}; modes are {', '.join(MODE_EXAMPLES)}")
    try:
        spare_counts = tuple(int(n) for n in args.spares.split(","))
    except ValueError:
        raise SystemExit(f"--spares: whole numbers, comma-separated, got {args.spares!r}") from None
    if not spare_counts or any(n < 0 for n in spare_counts):
        raise SystemExit(f"--spares: at least one count, none negative, got {args.spares!r}")
    reps = args.reps
    if reps < 1:
        raise SystemExit(f"--reps: at least 1, got {reps}")
    if args.replicas is not None and args.replicas < 1:
        raise SystemExit(f"--replicas: at least 1, got {args.replicas}")
    cores = os.cpu_count() or 1
    cases: dict[str, dict[str, Any]] = {}
    for rep in range(reps):
        for every_s in periods:
            for mode in modes:
                for spares in spare_counts:
                    free = one_run(mode, spares, None, length(every_s), args.replicas)
                    print(f"[{rep + 1}/{reps}] {mode} T={every_s:g} spares={spares} fault-free: {json.dumps(free)}", flush=True)
                    r = one_run(mode, spares, every_s, length(every_s), args.replicas)
                    r["efficiency"] = r["epochs_per_s"] / free["epochs_per_s"]
                    r["predicted"] = 1 - r["recovery_s"] / every_s if r["recovery_s"] is not None else None
                    r["predicted_busy"] = (r["predicted"] - (r["spare_cpu_s"] or 0.0) / (every_s * cores)
                                           if r["predicted"] is not None else None)
                    key = f"{mode}_T{every_s:g}_spares{spares}" + (f"_replicas{args.replicas}" if args.replicas else "")
                    cases.setdefault(key, {"runs": [], "fault_free": []})
                    cases[key]["runs"].append(r)
                    cases[key]["fault_free"].append(free)
                    print(f"[{rep + 1}/{reps}] {key}: {json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})}",
                          flush=True)
    ratios: dict[str, float] = {}
    print(f"\n  {'case':<28} {'efficiency':>22} {'predicted':>10} {'pred_busy':>10} {'recovery_s':>10} {'steps_lost':>10}"
          f" {'spare_cpu_s':>11}")
    for key, c in cases.items():
        eff = [r["efficiency"] for r in c["runs"]]
        c["efficiency"] = {"median": median(eff), "min": min(eff), "max": max(eff), "n": len(eff)}
        for k in ("predicted", "predicted_busy", "recovery_s", "steps_lost", "spare_cpu_s"):
            vals = [r[k] for r in c["runs"] if r[k] is not None]
            c[k] = median(vals) if vals else None
        ratios[f"efficiency_{key}"] = c["efficiency"]["median"]
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"  {key:<28} {c['efficiency']['median']:.3f} ({c['efficiency']['min']:.3f}-{c['efficiency']['max']:.3f})"
              f"{'':>4} {fmt(c['predicted']):>10} {fmt(c['predicted_busy']):>10} {fmt(c['recovery_s']):>10} {fmt(c['steps_lost']):>10} {fmt(c['spare_cpu_s']):>11}")
    print(f"  torchft (published): {TORCHFT['failure_every_s']}")
    results = {"config": {"modes": list(modes),
                          "examples": {m: example_text(m) for m in modes},
                          "spares": list(spare_counts), "periods_s": list(periods), "repetitions": reps,
                          "replicas": args.replicas, "cores": cores,
                          "run_s": {f"{t:g}": length(t) for t in periods}, "partitions": 32},
               "cases": cases, "torchft": TORCHFT}
    report("fault_rate", args.quick, results, ratios, args.json)


if __name__ == "__main__":
    main()
