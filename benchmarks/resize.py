"""Live resize on a simulated cluster: seconds from a node leaving until training goes on at the
smaller size, and from a node joining until it steps at the larger size; ours (allreduce,
scaling.min_replicas 1, max_replicas 2) vs Ray Train elastic (V2, ScalingConfig(num_workers=(1, 2))).

The cluster: `ray.cluster_utils.Cluster`, a 0-CPU head (drivers, Ray Train's controller, our
partition server) and two 1-CPU worker nodes (one replica / worker each), started by this process
with token auth; a fresh cluster for every side of every round. Both sides train the same CNN
(examples.models:mnist_cnn) on mnist5k (the same 8 partitions, leased to the ranks as our
allreduce leases them), batch 64 per worker, SGD lr 0.05 momentum 0.9
(examples/mnist_allreduce.yaml), checkpoint every epoch, and both look at the cluster every
POLL_S seconds: our scaling.poll_s; Ray Train's elastic_resize_monitor_interval_s and, since its
controller considers a resize only when it checks on its workers,
RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by default). Each runs in a subprocess connected to the
cluster (RAY_ADDRESS), so this process can remove and add nodes under it:

  1. once the run has a checkpoint of epoch 2: t_remove = time.time(); cluster.remove_node(worker 2)
     (Ray's default allow_graceful=True: the node's processes get SIGTERM and are waited for);
  2. once the run has gone on at 1 replica for 2 more epochs: cluster.add_node(num_cpus=1);
     t_add = time.time() when add_node returns (Ray reports the node alive);
  3. the run goes on until it has stepped at 2 again.

  shrink_s  t_remove -> the time every replica had stepped at the smaller size
  grow_s    t_add    -> the time every replica had stepped at the larger size
Ours: the `resize` events' `stepping_at` from the CLI's --result-json (the run: `python -m
orchestrator run examples/mnist_allreduce.yaml --set scaling.min_replicas=1 ...`, stop.epochs 8).
Ray Train: its train loop (below) appends one line per step (time.time(), world size, rank,
step, epoch) to a file per worker process; a worker group restarted at a new size resumes from
the latest checkpoint (ray.train.get_checkpoint()), which is how Ray Train resizes.
FailureConfig(max_failures=-1) so a lost worker restarts the group instead of ending the run; the
run is ended by this process (SIGTERM to its process group, then the cluster is shut down) once
the grow is measured.
Ratios: shrink / grow speedup vs Ray Train = Ray Train's seconds / ours.

    python benchmarks/resize.py [--quick] [--json PATH]
"""
from __future__ import annotations

import glob
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Optional

from common import REPO, LineTail, environment, median

RAY_TRAIN_START_TIMEOUT_S: Optional[float] = None  # None: Ray Train's own default (60 s); --ray-train-start-timeout-s

# Ray reads its auth token once per process; the clusters this process starts and the
# subprocesses connected to them share it.
os.environ.setdefault("RAY_AUTH_MODE", "token")
if os.environ["RAY_AUTH_MODE"] == "token" and not os.environ.get("RAY_AUTH_TOKEN"):
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
os.environ.pop("RAY_ADDRESS", None)
os.environ["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "benchmarks")]
                                           + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

BATCH, LR, MOMENTUM, SEED, PARTITIONS = 64, 0.05, 0.9, 0, 8
POLL_S = 1.0
MIN_WORKERS, MAX_WORKERS = 1, 2
REMOVE_AFTER_EPOCH = 2  # the epoch whose checkpoint must exist before the node is removed
EPOCHS_AT_SMALL = 2  # epochs trained at 1 replica before the node is added back
OURS_EPOCHS = 10  # the grow (after epoch 4 + the wait for an epoch boundary) lands well before the end
WAIT_S = 180  # the longest wait for any one stage before the round is given up


# ---------------------------------------------------------------- Ray Train (V2), in a subprocess

def ray_train_loop(config: dict) -> None:
    """A Ray Train user's elastic loop: DDP via prepare_model, a checkpoint every epoch, resume
    from ray.train.get_checkpoint(); one line per step with the world size."""
    import ray.train
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from ray.train import Checkpoint

    from common import ray_train_worker
    from throughput import epoch_batches, evaluate

    w = ray_train_worker(PARTITIONS, SEED, LR, MOMENTUM, config["log_dir"], world=ray.train.get_context().get_world_size())
    rank, world, tensors, sizes, tx, ty, net, model, opt = w.rank, w.world, w.tensors, w.sizes, w.tx, w.ty, w.net, w.model, w.opt
    done_epochs, step, log = w.done_epochs, w.step, w.log
    for epoch in range(done_epochs + 1, config["epochs"] + 1):
        model.train()
        for p, idx in epoch_batches(sizes, rank, epoch, world):
            x, y = tensors[p]
            opt.zero_grad()
            F.cross_entropy(model(torch.index_select(x, 0, idx)), torch.index_select(y, 0, idx)).backward()
            opt.step()
            step += 1
            log.write(f"{time.time():.6f} {world} {rank} {step} {epoch}\n")  # line-buffered
        correct, loss_sum, rows = evaluate(model, tx, ty)
        sums = torch.tensor([correct, loss_sum, rows], dtype=torch.float64)
        dist.all_reduce(sums)
        metrics = {"epoch": epoch, "step": step, "world": world, "test_accuracy": float(sums[0] / sums[2])}
        log.write(f"E {time.time():.6f} {world} {rank} {step} {epoch} {metrics['test_accuracy']:.4f}\n")
        if rank == 0:
            with tempfile.TemporaryDirectory() as tmp:
                torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                            "step": step}, os.path.join(tmp, "state.pt"))
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))
        else:
            ray.train.report(metrics)
    log.close()


def ray_train_child(spec_path: str) -> None:
    """The Ray Train driver: connects to the cluster in RAY_ADDRESS and fits (RAY_TRAIN_V2_ENABLED=1)."""
    import ray
    from ray.cloudpickle import register_pickle_by_value
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.api.config import ScalingConfig

    import throughput

    spec = json.load(open(spec_path))
    register_pickle_by_value(throughput)  # workers import it by name too (PYTHONPATH), by value is safer
    ray.init(logging_level="ERROR")
    trainer = TorchTrainer(
        ray_train_loop, train_loop_config={"epochs": spec["epochs"], "log_dir": spec["log_dir"]},
        scaling_config=ScalingConfig(num_workers=(MIN_WORKERS, MAX_WORKERS), use_gpu=False,
                                     resources_per_worker={"CPU": 1},
                                     elastic_resize_monitor_interval_s=POLL_S),
        run_config=RunConfig(storage_path=spec["storage"], name=spec["name"],
                             failure_config=FailureConfig(max_failures=-1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    trainer.fit()


class StepLog:
    """Reads the Ray Train workers' step files as they grow."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.headers: list[dict] = []
        self.steps: list[tuple[float, int, int, int, int]] = []  # (t, world, rank, step, epoch)
        self.epoch_ends: list[tuple[float, int, int, int, int]] = []  # (t, world, rank, step, epoch)
        self._tail = LineTail(log_dir)

    def poll(self) -> None:
        for _, line in self._tail.new_lines():
            if line.startswith("{"):
                self.headers.append(json.loads(line))
            elif line.startswith("E "):
                t, world, rank, step, epoch, _ = line[2:].split()
                self.epoch_ends.append((float(t), int(world), int(rank), int(step), int(epoch)))
            else:
                t, world, rank, step, epoch = line.split()
                self.steps.append((float(t), int(world), int(rank), int(step), int(epoch)))

    def all_stepped_at(self, world: int, after: float) -> Optional[float]:
        """When every rank of a `world`-sized group had logged a step after `after` (the
        latest of the ranks' first such steps), or None."""
        firsts: dict[int, float] = {}
        for t, w, r, _, _ in self.steps:
            if w == world and t > after and r not in firsts:
                firsts[r] = t
        return max(firsts.values()) if len(firsts) == world else None

    def first_step_at(self, world: int, after: float) -> Optional[float]:
        return min((t for t, w, *_ in self.steps if w == world and t > after), default=None)


def checkpoint_recorded(experiment_dir: str, epoch: int) -> bool:
    """Whether Ray Train's checkpoint manager has recorded a checkpoint of `epoch` or later."""
    try:
        with open(os.path.join(experiment_dir, "checkpoint_manager_snapshot.json"), encoding="utf-8") as f:
            snap = json.load(f)
        if isinstance(snap, str):
            snap = json.loads(snap)
    except (OSError, ValueError):
        return False
    latest = snap.get("latest_checkpoint_result") if isinstance(snap, dict) else None
    metrics = latest.get("metrics") if isinstance(latest, dict) else None
    return isinstance(metrics, dict) and int(metrics.get("epoch", 0)) >= epoch


# ---------------------------------------------------------------- the cluster and the stages

def new_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=1) for _ in range(MAX_WORKERS)]
    cluster.wait_for_nodes()
    return cluster, workers


def wait_until(cond, proc: subprocess.Popen, what: str, timeout_s: float = WAIT_S) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        if cond():
            return time.time()
        if proc.poll() is not None:
            raise RuntimeError(f"the run exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(0.05)


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=15)


class TimedLog(threading.Thread):
    """Copies a process's output to a file, each line prefixed with the time.time() it was read,
    and keeps Ray Train's controller lines (its decisions) with their times."""

    KEEP = ("TrainController", "WorkerGroup", "Error", "error")

    def __init__(self, stream, path: str) -> None:
        super().__init__(daemon=True)
        self.stream, self.path = stream, path
        self.kept: list[tuple[float, str]] = []

    def run(self) -> None:
        with open(self.path, "w", encoding="utf-8") as f:
            for line in iter(self.stream.readline, ""):
                t = time.time()
                f.write(f"{t:.3f} {line}")
                f.flush()
                if any(k in line for k in self.KEEP) and "PlacementGroupCleaner" not in line:
                    self.kept.append((t, line.rstrip()[:300]))


def tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def ours_round(tmp: str) -> dict:
    out: dict[str, Any] = {"side": "ours"}
    ck, result_path, log_path = os.path.join(tmp, "ck"), os.path.join(tmp, "result.json"), os.path.join(tmp, "run.log")
    cluster, workers = new_cluster()
    proc = None
    try:
        env = dict(os.environ, RAY_ADDRESS=cluster.address)
        env.pop("MLFLOW_TRACKING_URI", None)
        sets = [f"scaling.min_replicas={MIN_WORKERS}", f"scaling.max_replicas={MAX_WORKERS}",
                f"scaling.poll_s={POLL_S}", "scaling.grow_after=1", f"stop.epochs={OURS_EPOCHS}",
                "stop.at_target=false", "checkpoint.every_epochs=1", f"checkpoint.storage={ck}",
                f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db"]
        out["overrides"] = sets
        cmd = [sys.executable, "-m", "orchestrator", "run", os.path.join(REPO, "examples", "mnist_allreduce.yaml"),
               "--result-json", result_path, "--no-progress"] + [a for s in sets for a in ("--set", s)]
        log = open(log_path, "w")
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def ckpt(epoch: int):
            return lambda: bool(glob.glob(f"{ck}/*/ckpt-*-epoch_{epoch:04d}.pt.json"))

        wait_until(ckpt(REMOVE_AFTER_EPOCH), proc, f"the epoch-{REMOVE_AFTER_EPOCH} checkpoint")
        out["t_remove"] = time.time()
        cluster.remove_node(workers[1])
        out["remove_call_s"] = time.time() - out["t_remove"]
        wait_until(ckpt(REMOVE_AFTER_EPOCH + EPOCHS_AT_SMALL), proc,
                   f"the epoch-{REMOVE_AFTER_EPOCH + EPOCHS_AT_SMALL} checkpoint")
        t_call = time.time()
        cluster.add_node(num_cpus=1)
        out["t_add"] = time.time()
        out["add_call_s"] = out["t_add"] - t_call
        proc.wait(timeout=WAIT_S)
        out["wall_s"] = time.time() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"the run exited with {proc.returncode}: {tail(log_path)}")
        result = json.load(open(result_path))
    except Exception as exc:  # noqa: BLE001 -- reported in the results
        return out | {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6),
                      "log_tail": tail(log_path)}
    finally:
        if proc is not None:
            stop_process(proc)
        cluster.shutdown()
    resizes = [e for e in result["events"] if e.get("kind") == "resize"]
    out["resizes"] = resizes
    out["final_accuracy"] = (result.get("final") or {}).get("test_accuracy")
    out["replicas_per_epoch"] = [e.get("replicas") for e in result["events"] if e.get("kind") == "epoch_end"]
    shrink = next((e for e in resizes if e["direction"] == "shrink" and e.get("t_wall", 0) > out["t_remove"]), None)
    grow = next((e for e in resizes if e["direction"] == "grow" and e.get("t_wall", 0) > out["t_add"]), None)
    problems = []
    if shrink is None or shrink.get("stepping_at") is None:
        problems.append("no shrink event with stepping_at after the removal")
    else:
        out["shrink_s"] = shrink["stepping_at"] - out["t_remove"]
        out["shrink_event_resize_s"] = shrink.get("resize_s")
    if grow is None or grow.get("stepping_at") is None:
        problems.append("no grow event with stepping_at after the add")
    else:
        out["grow_s"] = grow["stepping_at"] - out["t_add"]
        out["grow_event"] = {k: grow.get(k) for k in ("resize_s", "since_room_seen_s", "reconfigure_s", "epoch", "at_step")}
    if [(e["direction"], e["old_size"], e["new_size"]) for e in resizes] != [("shrink", 2, 1), ("grow", 1, 2)]:
        problems.append(f"resizes: {[(e['direction'], e['old_size'], e['new_size']) for e in resizes]}")
    out["problems"] = problems
    return out


def ray_train_round(tmp: str) -> dict:
    out: dict[str, Any] = {"side": "ray_train"}
    log_dir, storage, name = os.path.join(tmp, "steps"), os.path.join(tmp, "storage"), f"resize-{time.time_ns()}"
    os.makedirs(log_dir)
    os.makedirs(storage)
    spec = os.path.join(tmp, "spec.json")
    json.dump({"epochs": 500, "log_dir": log_dir, "storage": storage, "name": name}, open(spec, "w"))
    child_log = os.path.join(tmp, "driver.log")
    logs = StepLog(log_dir)
    cluster, workers = new_cluster()
    proc, driver_log, t0 = None, None, time.time()
    try:
        # its controller checks the workers (and so considers a resize) every health-check
        # interval, 2 s by default: at POLL_S it looks as often as ours does
        env = dict(os.environ, RAY_ADDRESS=cluster.address, RAY_TRAIN_V2_ENABLED="1",
                   RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=str(POLL_S))
        if RAY_TRAIN_START_TIMEOUT_S is not None:  # how long its new worker group may take to start (60 s by default)
            env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(RAY_TRAIN_START_TIMEOUT_S)
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--ray-train-child", spec], cwd=tmp,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        driver_log = TimedLog(proc.stdout, child_log)
        driver_log.start()
        exp_dir = os.path.join(storage, name)

        def polled(cond):
            def f():
                logs.poll()
                return cond()
            return f

        wait_until(polled(lambda: checkpoint_recorded(exp_dir, REMOVE_AFTER_EPOCH)), proc,
                   f"Ray Train's epoch-{REMOVE_AFTER_EPOCH} checkpoint")
        out["t_first_step"] = min(t for t, *_ in logs.steps)
        out["startup_s"] = out["t_first_step"] - t0
        out["t_remove"] = time.time()
        cluster.remove_node(workers[1])
        out["remove_call_s"] = time.time() - out["t_remove"]
        t_shrunk = wait_until(polled(lambda: logs.all_stepped_at(1, out["t_remove"]) is not None), proc,
                              "a step at world size 1 after the removal")
        out["shrink_s"] = logs.all_stepped_at(1, out["t_remove"]) - out["t_remove"]
        # go on at 1 worker for EPOCHS_AT_SMALL epochs, as ours does, before adding the node back
        wait_until(polled(lambda: sum(1 for t, w, *_ in logs.epoch_ends if w == 1 and t > t_shrunk - 1)
                          >= EPOCHS_AT_SMALL), proc, f"{EPOCHS_AT_SMALL} epochs at world size 1")
        t_call = time.time()
        cluster.add_node(num_cpus=1)
        out["t_add"] = time.time()
        out["add_call_s"] = out["t_add"] - t_call
        wait_until(polled(lambda: logs.all_stepped_at(2, out["t_add"]) is not None), proc,
                   "every worker stepping at world size 2 after the add")
        out["grow_s"] = logs.all_stepped_at(2, out["t_add"]) - out["t_add"]
        out["grow_first_worker_s"] = logs.first_step_at(2, out["t_add"]) - out["t_add"]
        out["shrink_first_worker_s"] = logs.first_step_at(1, out["t_remove"]) - out["t_remove"]
        out["wall_s"] = time.time() - t0
    except Exception as exc:  # noqa: BLE001 -- reported in the results
        out |= {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6),
                "log_tail": tail(child_log)}
    finally:
        if proc is not None:
            stop_process(proc)
        cluster.shutdown()
    if driver_log is not None:
        driver_log.join(timeout=10)
        # Ray Train's own account of what it did, seconds from the removal
        t_ref = out.get("t_remove", t0)
        out["controller_log"] = [f"{t - t_ref:+8.2f} {line}" for t, line in driver_log.kept]
    logs.poll()
    # the worker processes Ray Train started (each group restart starts new ones) and where they resumed
    out["worker_processes"] = [{k: h[k] for k in ("pid", "rank", "world", "resume_epoch", "resume_step")}
                               | {"t_start": h["t_start"] - out.get("t_remove", h["t_start"])} for h in logs.headers]
    out["epochs_logged"] = [(w, r, e) for _, w, r, _, e in logs.epoch_ends if r == 0]
    if "t_remove" in out:
        before = [s for t, _, _, s, _ in logs.steps if t < out["t_remove"]]
        resumed = [h["resume_step"] for h in logs.headers if h["t_start"] > out["t_remove"] and h["world"] == 1]
        if before and resumed:
            out["steps_lost_at_shrink"] = max(before) - resumed[0]
    return out


# ---------------------------------------------------------------- driver

def summary(values: list[Optional[float]]) -> dict:
    vals = [v for v in values if v is not None]
    return {"median": median(vals) if vals else None, "min": min(vals) if vals else None,
            "max": max(vals) if vals else None, "runs": vals}


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one round each side (about 3-5 minutes on 2 cores)")
    p.add_argument("--json", metavar="PATH", help="write results (BENCHMARKS.md contract) to PATH")
    p.add_argument("--ray-train-start-timeout-s", type=float, metavar="S",
                   help="Ray Train's worker-group start timeout (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S; its "
                        "default, 60 s, is most of its shrink: a group asked for 2 workers on 1 node waits it out)")
    args = p.parse_args()
    if args.ray_train_start_timeout_s is not None and not args.ray_train_start_timeout_s > 0:
        p.error("--ray-train-start-timeout-s: give seconds above 0")
    global RAY_TRAIN_START_TIMEOUT_S
    RAY_TRAIN_START_TIMEOUT_S = args.ray_train_start_timeout_s
    rounds = 1 if args.quick else 3
    runs: dict[str, list] = {"ours": [], "ray_train": []}
    for rnd in range(rounds):
        for side, fn in (("ours", ours_round), ("ray_train", ray_train_round)):
            with tempfile.TemporaryDirectory(prefix=f"resize-{side}-") as tmp:
                r = fn(tmp)
            runs[side].append(r)
            print(f"round {rnd + 1}/{rounds} {side}: " + json.dumps(
                {k: r.get(k) for k in ("shrink_s", "grow_s", "wall_s", "error", "problems") if k in r}), flush=True)
    cases = {side: {k: summary([r.get(k) for r in rs]) for k in ("shrink_s", "grow_s")}
             | {"errors": [r["error"] for r in rs if r.get("error")]} for side, rs in runs.items()}
    ratios: dict[str, float] = {}
    for key in ("shrink_s", "grow_s"):
        o, t = cases["ours"][key]["median"], cases["ray_train"][key]["median"]
        if o and t:
            ratios[f"{key[:-2]}_speedup_vs_ray_train"] = t / o
    aims = {"grow_under_5s": cases["ours"]["grow_s"]["median"] is not None and cases["ours"]["grow_s"]["median"] < 5,
            "shrink_under_3s": cases["ours"]["shrink_s"]["median"] is not None
            and cases["ours"]["shrink_s"]["median"] < 3}
    config = {"cluster": "ray.cluster_utils.Cluster: head num_cpus=0, 2 worker nodes num_cpus=1; a fresh cluster "
                         "per side per round; remove_node(worker 2) (default, graceful), then add_node(num_cpus=1)",
              "data": "builtin:mnist5k", "model": "examples.models:mnist_cnn", "batch_per_worker": BATCH, "lr": LR,
              "momentum": MOMENTUM, "min_workers": MIN_WORKERS, "max_workers": MAX_WORKERS, "poll_s": POLL_S,
              "remove_after_checkpoint_of_epoch": REMOVE_AFTER_EPOCH, "epochs_at_1_before_add": EPOCHS_AT_SMALL,
              "rounds": rounds,
              "ours": {"cli": "python -m orchestrator run examples/mnist_allreduce.yaml",
                       "overrides": runs["ours"][0].get("overrides")},
              "ray_train": {"v2": True, "scaling_config": f"num_workers=({MIN_WORKERS}, {MAX_WORKERS}), "
                                                          f"elastic_resize_monitor_interval_s={POLL_S}",
                            "failure_config.max_failures": -1, "checkpoint": "every epoch (rank 0)",
                            "env": {"RAY_TRAIN_V2_ENABLED": "1", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(POLL_S)},
                            "worker_group_start_timeout_s": 60.0 if RAY_TRAIN_START_TIMEOUT_S is None else RAY_TRAIN_START_TIMEOUT_S}}
    print(f"\nresize ({'quick' if args.quick else 'full'}; {rounds} round(s) per side; poll {POLL_S} s)")
    print(f"  {'side':<10} {'shrink_s':>24} {'grow_s':>24}")
    for side, c in cases.items():
        cells = []
        for key in ("shrink_s", "grow_s"):
            s = c[key]
            cells.append("-" if s["median"] is None else f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})")
        print(f"  {side:<10} {cells[0]:>24} {cells[1]:>24}  {'; '.join(c['errors'])[:100]}")
    for key, value in ratios.items():
        print(f"  {key:<28} {value:6.2f}x")
    print(f"  aims (ours): grow < 5 s {aims['grow_under_5s']}, shrink < 3 s {aims['shrink_under_3s']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"benchmark": "resize", "quick": args.quick, "env": environment(), "config": config,
                       "cases": cases, "aims": aims, "results": {"runs": runs}, "ratios": ratios}, f,
                      indent=2, default=str)
        print(f"  wrote {args.json}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--ray-train-child":
        ray_train_child(sys.argv[2])
    else:
        main()
