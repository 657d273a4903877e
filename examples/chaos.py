"""Watch a run survive failures: train an example config while replicas (and, in the sharded
modes, a parameter shard) are killed, then print what happened.

    python examples/chaos.py                       # allreduce, two SIGKILLs of replica 1
    python examples/chaos.py --mode easgd --spares 1 --hang

Uses the public API (ElasticTrainer) and the project's fault injector (orchestrator.testing.chaos);
tracks to MLflow in ./mlruns-chaos (sqlite) unless --tracking-uri is given.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from orchestrator.testing.chaos import Fault, FaultInjector  # noqa: E402
from orchestrator.config import JobConfig  # noqa: E402
from orchestrator.trainer import ElasticTrainer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("allreduce", "downpour", "easgd"), default="allreduce")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--spares", type=int, default=0, help="fault_tolerance.spares (idle pre-started replicas)")
    p.add_argument("--hang", action="store_true", help="also freeze (SIGSTOP) replica 2 once; hang_timeout_s is 5")
    p.add_argument("--tracking-uri", default="sqlite:///mlruns-chaos.db")
    args = p.parse_args()
    overrides = [f"scaling.replicas={args.replicas}", "scaling.cpus_per_replica=0.5",
                 f"fault_tolerance.spares={args.spares}", "fault_tolerance.hang_timeout_s=5",
                 "tracking.progress_interval_s=0", "tracking.log_every_steps=2",
                 f"tracking.tracking_uri={args.tracking_uri}"]
    cfg = JobConfig.from_yaml(os.path.join(HERE, f"mnist_{args.mode}.yaml"), overrides)
    faults = [Fault("kill_replica", 1, at_step=30), Fault("kill_replica", 1, at_step=90)]
    if args.mode != "allreduce":
        faults.insert(1, Fault("kill_shard", 0, at_step=60))
    if args.hang and args.replicas > 2:
        faults.append(Fault("hang_replica", 2, at_step=120))
    trainer = ElasticTrainer(cfg)
    with FaultInjector(lambda: trainer.controller, faults) as injector:
        result = trainer.fit()
    print(f"\nfaults fired: {[(f['kind'], f['target'], f.get('step')) for f in injector.fired]}")
    for e in result.events:
        if e["kind"] in ("replica_failed", "replica_replaced", "replica_dropped", "shard_rebuilt"):
            keep = ("rank", "ranks", "cause", "how", "recovery_s", "steps_lost", "shard", "lost_updates",
                    "replayed_updates")
            print(f"  {e['kind']:<17} " + ", ".join(f"{k}={e[k]}" for k in keep if k in e))
    print(f"final test accuracy {result.final.test_accuracy:.4f} after {result.epochs} epochs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
