"""Preemption notices: from a node's drain to its replica stepping again elsewhere.

Workload: mnist5k and the CNN of examples/ (examples/mnist_<mode>.yaml, or mnist_allreduce.yaml
with strategy.mode set for a mode without one of its own; 2 replicas, 1 CPU each),
each replica slowed by 0.04 s a step (faults.slow_replicas) so an epoch lasts several seconds and
the drain lands inside one, no target, a checkpoint every epoch, MLflow in a temp sqlite store,
through ElasticTrainer(cfg).fit() on a `ray.cluster_utils.Cluster` this process starts for each
run (a 0-CPU head for the driver, the partition server and the shards; three 1-CPU worker nodes:
two replicas and a free node). Once epoch 1's checkpoint exists, replica 1's node is drained as a
spot preemption is (`DRAIN_NODE_REASON_PREEMPTION`, a DEADLINE_S deadline: the GCS call the
autoscaler makes), and removed at the deadline.

Figures per run, from the run's events: `evacuate_s` (from the notice seen by the run until the
moved replica stepped again on another node), `deadline_left_s` (seconds left to the deadline
when the move was made), replica failures (the aim: 0) and `steps_lost` (0). Per mode: the median
of evacuate_s with its range. What it leaves out: the notice's own delay (Ray shows a drain within
~1.5 s; the run looks every second), and the cluster's start-up.

    python benchmarks/preemption.py [--quick] [--json PATH] [--modes MODE,...]

--quick: one run each of allreduce and Downpour (~2.5 min); else three of every mode (allreduce,
downpour, easgd, local_sgd, hogwild, gossip, fsdp, sandblaster), the modes interleaved (~30 min
on 2 cores). --modes: these modes instead.
"""
from __future__ import annotations

import json
import tempfile
import threading
import time
from typing import Any

from common import MODE_EXAMPLES as MODES, example_text, median, mode_example, parse_args, report

DEADLINE_S = 20
QUICK_MODES = ("allreduce", "downpour")


def drain(address: str, node_hex: str, seconds: int) -> None:
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=address)
    accepted, why = gcs.drain_node(node_hex, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   "spot preemption notice (benchmark)", int(time.time() * 1000) + seconds * 1000)
    if not accepted:
        raise RuntimeError(f"the drain was refused: {why}")


def one_run(mode: str) -> dict[str, Any]:
    import glob

    import ray
    from ray.cluster_utils import Cluster

    from orchestrator.config import JobConfig
    from orchestrator.trainer import ElasticTrainer

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(3):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR")
        with tempfile.TemporaryDirectory(prefix=f"bench-preempt-{mode}-") as tmp:
            example, sets = mode_example(mode)
            cfg = JobConfig.from_yaml(example, [*sets,
                "stop.epochs=10", "stop.target_accuracy=null", "checkpoint.every_epochs=1",
                f"checkpoint.storage={tmp}/ck", "faults.slow_replicas={0: 0.04, 1: 0.04}",
                "tracking.progress_interval_s=0", f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db",
                "tracking.experiment=bench-preemption"])
            trainer = ElasticTrainer(cfg, show_progress=False)
            out: dict[str, Any] = {}
            thread = threading.Thread(target=lambda: out.update(result=trainer.fit()), daemon=True)
            thread.start()
            deadline = time.monotonic() + 300
            while not glob.glob(f"{tmp}/ck/*/ckpt-*-epoch_0001.pt.json"):
                if time.monotonic() > deadline or not thread.is_alive():
                    raise RuntimeError("no epoch-1 checkpoint")
                time.sleep(0.1)
            node = trainer.controller.group.nodes[1]
            drain(cluster.address, node, DEADLINE_S)
            time.sleep(DEADLINE_S)
            [victim] = [n for n in cluster.worker_nodes if n.node_id == node]
            cluster.remove_node(victim)
            thread.join(timeout=600)
            result = out["result"]
    finally:
        ray.shutdown()
        cluster.shutdown()
    events = result.events
    moved = [e for e in events if e["kind"] == "replica_evacuated"]
    failed = [e for e in events if e["kind"] == "replica_failed"]
    return {"evacuate_s": moved[0].get("evacuate_s") if moved else None,
            "deadline_left_s": moved[0]["deadline_left_s"].get("1") if moved else None,
            "evacuations": len(moved), "replica_failures": len(failed),
            "steps_lost": sum(e.get("steps_lost", 0) for e in moved), "epochs": result.epochs}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], (
        ("--modes", {"default": None, "help": f"modes to run, comma-separated, of {', '.join(MODES)}"}),))
    modes = tuple(args.modes.split(",")) if args.modes else QUICK_MODES if args.quick else tuple(MODES)
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; modes are {', '.join(MODES)}")
    reps = 1 if args.quick else 3
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for rep in range(reps):
        for mode in modes:
            r = one_run(mode)
            runs[mode].append(r)
            print(f"[{rep + 1}/{reps}] {mode}: {json.dumps(r)}", flush=True)
    summary, ratios = {}, {}
    for mode, rs in runs.items():
        s = [r["evacuate_s"] for r in rs if r["evacuate_s"] is not None]
        summary[mode] = {"evacuate_s": {"median": median(s), "min": min(s), "max": max(s)} if s else None,
                         "replica_failures": sum(r["replica_failures"] for r in rs),
                         "steps_lost": sum(r["steps_lost"] for r in rs),
                         "moved_before_deadline": sum(1 for r in rs if (r["deadline_left_s"] or 0) > 0)}
        if s:
            ratios[f"evacuate_s_{mode}"] = median(s)
        print(f"  {mode:<10} evacuate_s {summary[mode]['evacuate_s']}  failures {summary[mode]['replica_failures']}  "
              f"steps lost {summary[mode]['steps_lost']}  moved before the deadline {summary[mode]['moved_before_deadline']}"
              f" of {len(rs)}")
    results = {"config": {"examples": {m: example_text(m) for m in modes},
                          "deadline_s": DEADLINE_S,
                          "cluster": "0-CPU head, three 1-CPU workers", "slow_replicas_s": 0.04, "repetitions": reps},
               "runs": runs, "summary": summary}
    report("preemption", args.quick, results, ratios, args.json)


if __name__ == "__main__":
    main()
