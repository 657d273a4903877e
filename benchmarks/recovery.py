"""Recovery from a SIGKILL of 1 of 2 replicas mid-epoch: Ray Train (restart from the last
checkpoint) vs ours (allreduce, downpour, easgd; with 0 or 1 spare replica).

Workload: mnist5k and the CNN of examples/mnist_<mode>.yaml, 2 replicas / workers, 3 epochs
(4 in the full run), never stopping early at the target accuracy. The fault: rank 1's process
is SIGKILLed once training reaches step KILL_STEP (the middle of epoch 2, after the first
per-epoch checkpoint exists). Per case:
  recovery_s  seconds from the kill until every replica is stepping again
  steps_lost  steps of progress thrown away, counted in the replicas' own step numbering
  final_accuracy, wall_s  test accuracy at the end, seconds of the whole fit()
The raw runs (--json) also give steps_taken (Ray Train: the steps rank 0 logged over all its
processes; ours: result.steps, the longest replica's steps per epoch summed) against
steps_planned (epochs x 32): work done again that steps_lost does not count, e.g. partitions
served again whole after a failure.

A. Ray Train: `TorchTrainer` (2 workers, DDP through prepare_model), FailureConfig(max_failures=1),
   rank 0 reports a Checkpoint (model + optimizer + epoch + step) at the end of every epoch; the
   batches are throughput.py's (same partitions, pinned assignment, in-partition order), the
   model, lr and momentum those of examples/mnist_allreduce.yaml. Every worker appends one line
   per step (time.time(), global step, epoch, rank) to its own file; a driver thread watching the
   files SIGKILLs rank 1's process by pid at its first step from KILL_STEP on that lies in the
   second half of an epoch once Ray Train has recorded a checkpoint (it records one at its next
   poll of the workers, every 2 s by default, and an epoch takes about 1 s: the kill can come a
   few steps later than KILL_STEP, or in epoch 3; the results say where it fell). recovery_s =
   first time both ranks' current processes logged a step after the kill - kill time;
   steps_lost = highest step logged before the kill - the step the restarted group resumed
   from. The results show the restart: new pids for both ranks, attempts = 2.
B. Ours: ElasticTrainer(cfg).fit() on examples/mnist_<mode>.yaml with fault_tolerance.spares 0|1,
   the kill by orchestrator.testing.chaos.FaultInjector (Fault kill_replica, target 1, at_step KILL_STEP;
   it fires at the first progress row at or past that step, rows come every
   tracking.log_every_steps steps, so a few steps later). recovery_s = the replica_replaced
   event's stepping_at - the fault's t_wall; steps_lost = that event's steps_lost. Any way a
   run differs from what the case expects (events missing, a spare not used) is listed per run
   under api_problems.
Ratios: recovery_speedup_vs_ray_train[<mode>,spare<n>] = Ray Train's recovery_s / ours.

    python benchmarks/recovery.py [--quick] [--json PATH]
"""
from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
import traceback
from typing import Any, Optional

import common
from common import REPO, LineTail, environment, median, parse_args, ray_train_worker

import throughput
from throughput import BATCH, LR, MOMENTUM, PARTITIONS, SEED, WORKERS, epoch_batches, evaluate

MODES = ("allreduce", "downpour", "easgd")
SPARES = (0, 1)
STEPS_PER_EPOCH = 32  # per worker: 4 pinned partitions of 500 rows, 8 batches of <= 64 each
KILL_STEP = STEPS_PER_EPOCH + STEPS_PER_EPOCH // 2  # the middle of epoch 2
KILLED_RANK = 1


# ---------------------------------------------------------------- A. Ray Train reference

def ray_train_loop(config: dict) -> None:
    """A Ray Train user's loop with per-epoch checkpoints and resume; one log line per step."""
    import ray.train
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from ray.train import Checkpoint

    w = ray_train_worker(PARTITIONS, SEED, LR, MOMENTUM, config["log_dir"])
    rank, tensors, sizes, tx, ty, net, model, opt = w.rank, w.tensors, w.sizes, w.tx, w.ty, w.net, w.model, w.opt
    done_epochs, step, log = w.done_epochs, w.step, w.log
    for epoch in range(done_epochs + 1, config["epochs"] + 1):
        model.train()
        for p, idx in epoch_batches(sizes, rank, epoch):
            x, y = tensors[p]
            opt.zero_grad()
            F.cross_entropy(model(torch.index_select(x, 0, idx)), torch.index_select(y, 0, idx)).backward()
            opt.step()
            step += 1
            log.write(f"{time.time():.6f} {step} {epoch} {rank}\n")  # line-buffered: one write per step
        correct, loss_sum, rows = evaluate(model, tx, ty)
        sums = torch.tensor([correct, loss_sum, rows], dtype=torch.float64)
        dist.all_reduce(sums)
        metrics = {"epoch": epoch, "step": step, "test_accuracy": float(sums[0] / sums[2]),
                   "test_loss": float(sums[1] / sums[2])}
        if rank == 0:
            with tempfile.TemporaryDirectory() as tmp:
                torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                            "step": step}, os.path.join(tmp, "state.pt"))
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))
        else:
            ray.train.report(metrics)
    log.close()


class StepLogs:
    """Reads the workers' step files as they grow: per process its header and (t, step, epoch)."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, dict] = {}  # file -> {"pid", "rank", "t_start", "resume_step", "steps": [...]}
        self._tail = LineTail(log_dir)

    def poll(self) -> None:
        for path, line in self._tail.new_lines():
            if line.startswith("{"):
                self.procs[path] = {**json.loads(line), "steps": []}
            else:
                t, step, epoch, _ = line.split()
                self.procs[path]["steps"].append((float(t), int(step), int(epoch)))

    def latest(self, rank: int) -> tuple[int, int]:
        """(step, epoch) of the newest step `rank` logged; (0, 1) before the first."""
        return max(((p["steps"][-1][1], p["steps"][-1][2]) for p in self.procs.values()
                    if p["rank"] == rank and p["steps"]), default=(0, 1))

    def pid_of(self, rank: int) -> Optional[int]:
        """The pid of `rank`'s newest process."""
        procs = [p for p in self.procs.values() if p["rank"] == rank]
        return max(procs, key=lambda p: p["t_start"])["pid"] if procs else None


def checkpoint_recorded(experiment_dir: str) -> bool:
    """Whether Ray Train's checkpoint manager has recorded a checkpoint (its snapshot file names
    one): a restart before that would start from scratch, not from epoch 1's checkpoint."""
    path = os.path.join(experiment_dir, "checkpoint_manager_snapshot.json")
    try:
        with open(path, encoding="utf-8") as f:
            snap = json.load(f)
    except (OSError, ValueError):
        return False
    if isinstance(snap, str):  # stored as the JSON of a JSON string
        try:
            snap = json.loads(snap)
        except ValueError:
            return False
    return bool(snap.get("latest_checkpoint_result"))


class Killer(threading.Thread):
    """Watches the step files; SIGKILLs rank KILLED_RANK's process at its first step from
    KILL_STEP on that lies in the second half of an epoch (not its last step) once Ray Train has
    recorded a checkpoint. Ray Train records a reported checkpoint when its controller next polls
    the workers (every 2 s by default) and an epoch here takes about 1 s, so the kill can fall
    in epoch 3; `fired` says where it fell."""

    def __init__(self, logs: StepLogs, experiment_dir: str, timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.logs, self.experiment_dir, self.timeout_s = logs, experiment_dir, timeout_s
        self.stop = threading.Event()
        self.fired: Optional[dict] = None
        self.error: Optional[str] = None

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        waited_for_checkpoint = False
        try:
            while not self.stop.is_set() and time.monotonic() < deadline:
                self.logs.poll()
                step, epoch = self.logs.latest(KILLED_RANK)
                in_epoch = step - (epoch - 1) * STEPS_PER_EPOCH
                if step >= KILL_STEP and STEPS_PER_EPOCH // 2 <= in_epoch < STEPS_PER_EPOCH - 1:
                    if not checkpoint_recorded(self.experiment_dir):
                        waited_for_checkpoint = True
                    else:
                        pid = self.logs.pid_of(KILLED_RANK)
                        os.kill(pid, signal.SIGKILL)
                        t_kill = time.time()
                        self.logs.poll()
                        self.fired = {"pid": pid, "rank": KILLED_RANK, "t_wall": t_kill,
                                      "step_at_kill": self.logs.latest(KILLED_RANK)[0],
                                      "epoch_at_kill": self.logs.latest(KILLED_RANK)[1],
                                      "waited_for_checkpoint": waited_for_checkpoint}
                        return
                time.sleep(0.005)
            self.error = f"rank {KILLED_RANK} never reached step {KILL_STEP} with a checkpoint recorded"
        except Exception as exc:  # noqa: BLE001 -- reported in the results
            self.error = f"{type(exc).__name__}: {exc}"


def ray_train_case(epochs: int, storage: str) -> dict:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    name = f"recovery-{time.time_ns()}"
    log_dir = os.path.join(storage, f"{name}-steps")
    os.makedirs(log_dir)
    logs = StepLogs(log_dir)
    killer = Killer(logs, os.path.join(storage, name), timeout_s=300)
    trainer = TorchTrainer(
        ray_train_loop, train_loop_config={"epochs": epochs, "log_dir": log_dir},
        scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=storage, name=name, failure_config=FailureConfig(max_failures=1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    killer.start()
    t0 = time.time()
    try:
        result = trainer.fit()
    finally:
        killer.stop.set()
        killer.join(timeout=5)
    wall = time.time() - t0
    logs.poll()
    out: dict[str, Any] = {"wall_s": wall, "final_accuracy": (result.metrics or {}).get("test_accuracy"),
                           "final_step": (result.metrics or {}).get("step"), "fired": killer.fired,
                           "error": killer.error or (repr(result.error) if result.error else None)}
    procs = sorted(logs.procs.values(), key=lambda p: p["t_start"])
    out["processes"] = [{k: p[k] for k in ("pid", "rank", "t_start", "resume_step", "resume_epoch")}
                        | {"steps_logged": len(p["steps"]), "last_step": p["steps"][-1][1] if p["steps"] else None}
                        for p in procs]
    out["steps_taken"] = sum(len(p["steps"]) for p in procs if p["rank"] == 0)
    out["steps_planned"] = epochs * STEPS_PER_EPOCH
    out["attempts"] = max(sum(1 for p in procs if p["rank"] == r) for r in range(WORKERS)) if procs else 0
    if not killer.fired:
        return out | {"recovery_s": None, "steps_lost": None, "restarted": False}
    t_kill = killer.fired["t_wall"]
    out["kill_step"], out["how"] = killer.fired["step_at_kill"], "restart from checkpoint"
    before = [s[1] for p in procs for s in p["steps"] if s[0] <= t_kill]
    newest = {r: max((p for p in procs if p["rank"] == r), key=lambda p: p["t_start"]) for r in range(WORKERS)}
    first_after = {r: next((s[0] for s in newest[r]["steps"] if s[0] > t_kill), None) for r in range(WORKERS)}
    restarted = all(newest[r]["t_start"] > t_kill for r in range(WORKERS)) and \
        newest[KILLED_RANK]["pid"] != killer.fired["pid"]
    resumed = {newest[r]["resume_step"] for r in range(WORKERS)}
    out.update({
        "restarted": restarted,
        "new_pids": {r: newest[r]["pid"] for r in range(WORKERS)},
        "highest_step_before_kill": max(before) if before else None,
        "resumed_from_step": min(resumed),
        "recovery_s": (max(first_after.values()) - t_kill) if None not in first_after.values() else None,
        "restart_started_s": min(newest[r]["t_start"] for r in range(WORKERS)) - t_kill,
    })
    out["steps_lost"] = out["highest_step_before_kill"] - out["resumed_from_step"] if before else None
    if len(resumed) != 1:
        out["error"] = f"the restarted workers resumed from different steps {sorted(resumed)}"
    return out


# ---------------------------------------------------------------- B. ours

def ours_case(mode: str, spares: int, epochs: int, storage: str) -> dict:
    """One fit() of examples/mnist_<mode>.yaml with `spares` spare replicas, rank 1 killed at
    KILL_STEP by the project's chaos helper."""
    try:
        from orchestrator.testing.chaos import Fault, FaultInjector
    except ImportError as exc:
        return {"error": f"orchestrator.testing.chaos is missing ({exc}): case not run"}
    from orchestrator.config import JobConfig
    from orchestrator.trainer import ElasticTrainer

    tag = f"{mode}-spare{spares}-{time.time_ns()}"
    overrides = [f"fault_tolerance.spares={spares}", "tracking.progress_interval_s=0",
                 f"tracking.tracking_uri=sqlite:///{storage}/mlflow.db", "tracking.experiment=bench-recovery",
                 f"stop.epochs={epochs}", "stop.at_target=false", f"checkpoint.storage={storage}/ck-{tag}"]
    out: dict[str, Any] = {"overrides": overrides}
    try:
        cfg = JobConfig.from_yaml(os.path.join(REPO, "examples", f"mnist_{mode}.yaml"), overrides)
        trainer = ElasticTrainer(cfg, show_progress=False)
        fault = Fault(kind="kill_replica", target=KILLED_RANK, at_step=KILL_STEP)
        t0 = time.time()
        with FaultInjector(lambda: trainer.controller, [fault]) as inj:
            result = trainer.fit()
        out["wall_s"] = time.time() - t0
    except Exception as exc:  # noqa: BLE001 -- one case failing must not lose the others
        return out | {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
    events = list(result.events)
    fired = list(getattr(inj, "fired", []) or [])
    failed = [e for e in events if e.get("kind") == "replica_failed"]
    replaced = [e for e in events if e.get("kind") == "replica_replaced"]
    out.update({"final_accuracy": result.final.test_accuracy, "epochs": result.epochs, "steps": result.steps,
                "stop_reason": result.stop_reason, "fired": fired, "replica_failed": failed,
                "replica_replaced": replaced,
                "steps_taken": result.steps, "steps_planned": epochs * STEPS_PER_EPOCH,
                "other_fault_events": [e for e in events if e.get("kind") in
                                       ("replica_dropped", "failure_decision", "replica_lost", "shard_rebuilt")]})
    problems = []
    if len(fired) != 1:
        problems.append(f"FaultInjector.fired has {len(fired)} entries, expected 1")
    elif "t_wall" not in fired[0]:
        problems.append(f"FaultInjector.fired[0] has no t_wall: {sorted(fired[0])}")
    need_failed = ("rank", "cause", "detected_by", "t_wall")
    need_replaced = ("ranks", "how", "recovery_s", "stepping_at", "steps_lost")
    if not failed:
        problems.append("no replica_failed event")
    for e in failed:
        missing = [k for k in need_failed if k not in e]
        if missing:
            problems.append(f"replica_failed event lacks {missing}: {e}")
    if not replaced:
        problems.append("no replica_replaced event")
    hows = []
    for e in replaced:
        missing = [k for k in need_replaced if k not in e]
        if missing:
            problems.append(f"replica_replaced event lacks {missing}: {e}")
        how = (e.get("how") or {}).get(str(KILLED_RANK))  # {rank: "spare" | "new_actor"}
        if how not in ("spare", "new_actor"):
            problems.append(f"replica_replaced.how for rank {KILLED_RANK} is {how!r}, expected 'spare' or 'new_actor'")
        if spares == 0 and how == "spare":
            problems.append("replica_replaced.how is 'spare' in a run without spares")
        if spares > 0 and how == "new_actor":
            problems.append(f"replica_replaced.how is 'new_actor' with {spares} spare(s) configured")
        hows.append(how)
    out["how"] = hows[0] if hows else None
    out["kill_step"] = fired[0].get("step") if fired else None
    if fired and "t_wall" in fired[0] and replaced and replaced[0].get("stepping_at") is not None:
        t_kill = fired[0]["t_wall"]
        out["recovery_s"] = replaced[0]["stepping_at"] - t_kill
        out["steps_lost"] = replaced[0].get("steps_lost")
        out["reported_recovery_s"] = replaced[0].get("recovery_s")
        if failed and failed[0].get("t_wall") is not None:
            out["detection_s"] = failed[0]["t_wall"] - t_kill
        if out["recovery_s"] < 0:
            problems.append(f"stepping_at {replaced[0]['stepping_at']} is before the kill {t_kill}")
    else:
        out["recovery_s"], out["steps_lost"] = None, None
    if result.epochs != epochs:
        problems.append(f"the run ended after {result.epochs} epochs ({result.stop_reason}), expected {epochs}")
    out["api_problems"] = problems
    return out


# ---------------------------------------------------------------- driver

CASE_KEYS = ("recovery_s", "steps_lost", "final_accuracy", "wall_s")


def summarise(runs: list[dict]) -> dict:
    """Medians over a case's repetitions (None where no run measured the figure)."""
    out = {}
    for key in CASE_KEYS:
        vals = [r[key] for r in runs if r.get(key) is not None]
        out[key] = median(vals) if vals else None
    errors = [r["error"] for r in runs if r.get("error")]
    out["errors"] = errors
    out["kill_steps"] = [r.get("kill_step") for r in runs]
    out["how"] = [r.get("how") for r in runs]
    out["repetitions"] = len(runs)
    return out


def fmt(value: Any, spec: str) -> str:
    return format("-", ">" + spec.split(".")[0].rstrip("fd")) if value is None else format(value, spec)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import ray
    from ray.cloudpickle import register_pickle_by_value

    register_pickle_by_value(throughput)  # the workers cannot import benchmarks/throughput.py or common.py
    register_pickle_by_value(common)  # by name: their functions travel by value
    reps, epochs = (1, 3) if args.quick else (3, 4)
    names = ["ray_train"] + [f"ours[{m},spare{s}]" for m in MODES for s in SPARES]
    runs: dict[str, list] = {n: [] for n in names}
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(reps):
                for name in names:
                    if name == "ray_train":
                        try:
                            r = ray_train_case(epochs, tmp)
                        except Exception as exc:  # noqa: BLE001
                            r = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
                    else:
                        mode, spares = name[5:-1].split(",")
                        r = ours_case(mode, int(spares[len("spare"):]), epochs, tmp)
                    runs[name].append(r)
                    print(f"rep {rep + 1}/{reps} {name}: " + json.dumps(
                        {k: r.get(k) for k in (*CASE_KEYS, "how", "error", "api_problems") if k in r}), flush=True)
    finally:
        ray.shutdown()

    cases = {n: summarise(rs) for n, rs in runs.items()}
    ratios: dict[str, float] = {}
    ref = cases["ray_train"]["recovery_s"]
    for m in MODES:
        for s in SPARES:
            ours = cases[f"ours[{m},spare{s}]"]["recovery_s"]
            if ref and ours:
                ratios[f"recovery_speedup_vs_ray_train[{m},spare{s}]"] = ref / ours
    config = {"data": "builtin:mnist5k", "model": "examples.models:mnist_cnn", "workers": WORKERS, "batch": BATCH,
              "epochs": epochs, "kill_rank": KILLED_RANK, "kill_at_step": KILL_STEP,
              "steps_per_epoch_per_worker": STEPS_PER_EPOCH, "repetitions": reps,
              "ray_train": {"lr": LR, "momentum": MOMENTUM, "failure_config.max_failures": 1,
                            "checkpoint": "every epoch (rank 0)",
                            "train_v2": os.environ.get("RAY_TRAIN_V2_ENABLED", "1") != "0"},
              "ours": {"configs": "examples/mnist_<mode>.yaml", "spares": list(SPARES),
                       "overrides": ["fault_tolerance.spares", "tracking.progress_interval_s=0", "stop.epochs",
                                     "stop.at_target=false", "tracking.tracking_uri (temp sqlite)",
                                     "checkpoint.storage (temp)"]}}

    print(f"\nrecovery ({'quick' if args.quick else 'full'}; SIGKILL of rank {KILLED_RANK} at step {KILL_STEP}, "
          f"{epochs} epochs; medians of {reps})")
    print(f"  {'case':<24} {'recovery_s':>10} {'steps_lost':>10} {'final_acc':>9} {'wall_s':>7} {'killed at':>9}"
          f"  {'how':<24} note")
    for n, c in cases.items():
        note = "; ".join(c["errors"])[:80]
        if n != "ray_train":
            problems = sorted({p for r in runs[n] for p in r.get("api_problems", [])})
            note = "; ".join([note] * bool(note) + problems)[:120]
        print(f"  {n:<24} {fmt(c['recovery_s'], '10.3f')} {fmt(c['steps_lost'], '10.1f')} "
              f"{fmt(c['final_accuracy'], '9.4f')} {fmt(c['wall_s'], '7.1f')} "
              f"{','.join(str(k) for k in c['kill_steps']):>9}  {','.join(str(h) for h in c['how']):<24} {note}")
    width = max((len(k) for k in ratios), default=10)
    for key, value in ratios.items():
        print(f"  {key:<{width}}  {value:6.3f}x")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"benchmark": "recovery", "quick": args.quick, "env": environment(), "config": config,
                       "cases": cases, "results": {"runs": runs}, "ratios": ratios}, f, indent=2, default=str)
        print(f"  wrote {args.json}")


if __name__ == "__main__":
    main()
