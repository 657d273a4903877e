"""Watch Ray's autoscaler grow a run: start a local autoscaling cluster (a 0-CPU head and no
worker node; the autoscaler launches 1-CPU "nodes", raylets on this machine, on demand and
terminates them once idle), train the main example (examples/mnist_allreduce.yaml: the small
CNN on mnist5k) from 1 replica with room to grow, then print what the autoscaler and the run did.

    python examples/autoscaling.py                      # 1 replica, may grow to 2
    python examples/autoscaling.py --max-replicas 3     # on a machine with 3+ cores

The run finds no room, asks the autoscaler and waits (scaling.wait_for_room_s); once a node is
up it starts with 1 replica, asks for room for max-replicas, and grows when the new nodes are
up. The cluster is always shut down at the end (its head's process group, then any raylet of it
left, by pid). Tracks to MLflow in ./mlruns-autoscaling.db (sqlite) unless --tracking-uri is given.
"""
from __future__ import annotations

import argparse
import os
import secrets
import sys
import time

# Ray reads its auth token once per process: fix it before anything imports ray.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
os.environ.pop("RAY_ADDRESS", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from orchestrator.config import JobConfig  # noqa: E402
from orchestrator.testing.local_autoscaler import LocalAutoscalingCluster  # noqa: E402
from orchestrator.trainer import ElasticTrainer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-replicas", type=int, default=2, help="scaling.max_replicas (and the most worker nodes)")
    p.add_argument("--epochs", type=int, default=12, help="stop.epochs (the run stops at 97%% test accuracy too)")
    p.add_argument("--idle-timeout-minutes", type=float, default=0.2,
                   help="how long a node stays idle before the autoscaler terminates it")
    p.add_argument("--tracking-uri", default="sqlite:///mlruns-autoscaling.db")
    args = p.parse_args()

    cpu_node = {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 0, "max_workers": args.max_replicas}
    cluster = LocalAutoscalingCluster({"CPU": 0}, {"cpu_node": cpu_node},
                                      idle_timeout_minutes=args.idle_timeout_minutes, max_workers=args.max_replicas)
    cfg = JobConfig.from_yaml(os.path.join(HERE, "mnist_allreduce.yaml"), [
        "scaling.replicas=1", f"scaling.max_replicas={args.max_replicas}", "scaling.cpus_per_replica=1",
        "scaling.poll_s=1", "scaling.wait_for_room_s=240", f"stop.epochs={args.epochs}",
        f"tracking.tracking_uri={args.tracking_uri}"])
    try:
        cluster.start()
        print(f"autoscaling cluster at {cluster.address}: 0-CPU head, {cluster.worker_nodes()} worker nodes "
              f"(logs: {cluster.temp_dir})", flush=True)
        os.environ["RAY_ADDRESS"] = cluster.address  # the run joins it
        result = ElasticTrainer(cfg, show_progress=False).fit()
        t_end = time.time()
        report(result)
        print("waiting for the autoscaler to terminate the idle nodes ...", flush=True)
        while cluster.worker_nodes() > 0 and time.time() - t_end < 60 * args.idle_timeout_minutes + 60:
            time.sleep(1)
        print(f"{cluster.worker_nodes()} worker nodes alive {time.time() - t_end:.1f}s after the run")
        for line in cluster.autoscaler_log():
            print("  " + line.split(" -- ", 1)[-1])
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        left = cluster.shutdown()
        if left:
            print(f"killed {len(left)} leftover processes of the cluster by pid: {left}")
    return 0


def report(result) -> None:
    events = result.events
    asks = [e for e in events if e["kind"] == "autoscaler_request"]
    grows = [e for e in events if e["kind"] == "resize" and e["direction"] == "grow"]
    sizes = [e["replicas"] for e in events if e["kind"] == "epoch_end"]
    print(f"\nfinished: {result.epochs} epochs, test accuracy {result.final.test_accuracy:.4f} "
          f"({result.stop_reason}); replicas per epoch: {sizes}")
    for a in asks:
        what = "withdrawn" if a["withdrawn"] else f"{a['bundles']} x {a['bundle']}"
        print(f"  autoscaler request at +{a['t']:.1f}s: {what} ({a['why']})")
    for g in grows:
        print(f"  grew {g['old_size']} -> {g['new_size']} at epoch {g['epoch']}: room seen -> joined "
              f"{g['since_room_seen_s']:.1f}s, join {g['reconfigure_s']:.2f}s, decided -> every replica stepping "
              f"{g['resize_s']:.2f}s")
    first_ask = next((a for a in asks if not a["withdrawn"]), None)
    if first_ask and grows:
        print(f"  request -> every replica stepping at {grows[-1]['new_size']}: "
              f"{grows[-1]['stepping_at'] - first_ask['t_wall']:.1f}s")


if __name__ == "__main__":
    sys.exit(main())
