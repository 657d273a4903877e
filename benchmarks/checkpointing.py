"""What checkpoints cost a run: written on the training path against written in the background.

Workload: mnist5k and the CNN of examples/ (examples/mnist_allreduce.yaml: 2 replicas, 1 CPU each,
batch 64, allreduce), 32 partitions, EPOCHS epochs (~1.5 s each), no target, progress rows every
0.1 s (so a checkpoint inside an epoch is asked for on time), MLflow in a temp sqlite store,
through ElasticTrainer(cfg).fit() (real Ray actors, gloo group, the real checkpoint store on
local disk). Three cases, interleaved in each repetition:

    none        checkpoint.every_epochs 0: no checkpoint until the final one
    background  a checkpoint every EVERY_S seconds (checkpoint.every_s, every_epochs 0: inside an
                epoch, or at an epoch end when one comes first), stored on the background thread
                (checkpoint.background true, the default)
    sync        the same checkpoints, each stored before training goes on (checkpoint.background false)
    in_memory   background's checkpoints, each also handed to the run's keeper before it is stored
                (checkpoint.in_memory: a detached actor, started at the first checkpoint, holding the
                newest one in memory; beside the driver on this one-node cluster)

Figure per run: train_s, seconds from the `started` event to the last `epoch_end` event (every
epoch's training, evaluation and logging, and every checkpoint but the final one). Ratios:
<case>_vs_none = median train_s of the case / median train_s of `none` (1.0: checkpoints cost
nothing; the aim is <= 1.05 with a checkpoint every 10 s). Beside them: seconds per checkpoint
((train_s - none's median) / checkpoints) and, from the `checkpoint` events, checkpoints per
run, the bytes of one, `seconds` (on the training path: the state taken from a replica and
handed on), `write_s` (storing it: MLflow's flush, serialization, in_memory's hand-over to the keeper, the
write; on the path only in `sync`) and, inside an epoch, `pause_s` (from the pause asked until every replica paused:
they train meanwhile until a partition boundary). Left out: start-up (not in train_s) and the
final checkpoint (every case writes it once). On local disk a write takes milliseconds, so
`sync` and `background` differ little here; a remote store's upload is where they part.

    python benchmarks/checkpointing.py [--quick] [--json PATH]

--quick: one repetition of 8 epochs; else three of 16.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
from typing import Any

from common import REPO, median, parse_args, report

EVERY_S = 10.0  # checkpoint.every_s
CASES = {"none": ["checkpoint.every_epochs=0"],
         "background": ["checkpoint.every_epochs=0", f"checkpoint.every_s={EVERY_S}", "checkpoint.background=true"],
         "sync": ["checkpoint.every_epochs=0", f"checkpoint.every_s={EVERY_S}", "checkpoint.background=false"],
         "in_memory": ["checkpoint.every_epochs=0", f"checkpoint.every_s={EVERY_S}", "checkpoint.background=true",
                       "checkpoint.in_memory=true"]}
TIMED = tuple(c for c in CASES if c != "none")


def one_run(case: str, epochs: int) -> dict[str, Any]:
    from orchestrator.config import JobConfig
    from orchestrator.trainer import ElasticTrainer

    with tempfile.TemporaryDirectory(prefix=f"bench-ckpt-{case}-") as tmp:
        cfg = JobConfig.from_yaml(os.path.join(REPO, "examples", "mnist_allreduce.yaml"), [
            f"stop.epochs={epochs}", "stop.target_accuracy=null", "data.partitions=32",
            f"checkpoint.storage={tmp}/ck", f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db",
            "tracking.experiment=bench-checkpointing", "tracking.progress_interval_s=0.1", *CASES[case]])
        result = ElasticTrainer(cfg, show_progress=False).fit()
        events = result.events
        started = next(e["t_wall"] for e in events if e["kind"] == "started")
        last_end = [e["t_wall"] for e in events if e["kind"] == "epoch_end"][-1]
        ckpts = [e for e in events if e["kind"] == "checkpoint" and not e["path"].endswith("model.pt")]  # not the final
        sizes = []
        for e in ckpts:
            sidecar = (e.get("stored") or e["path"]) + ".json"
            if os.path.exists(sidecar):
                with open(sidecar, encoding="utf-8") as f:
                    sizes.append(json.load(f)["bytes"])
        pauses = [e["in_epoch"]["pause_s"] for e in ckpts if e.get("in_epoch")]
        failed = [e for e in events if e["kind"] == "checkpoint_failed"]
    mean = lambda xs: statistics.mean(xs) if xs else None  # noqa: E731
    return {"train_s": last_end - started, "epochs": result.epochs, "checkpoints": len(ckpts),
            "inside_epoch": len(pauses), "superseded_or_failed": len(failed), "bytes": mean(sizes),
            "seconds_on_path": mean([e["seconds"] for e in ckpts if e.get("seconds") is not None]),
            "write_s": mean([e["write_s"] for e in ckpts if e.get("write_s") is not None]),
            "pause_s": mean(pauses)}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    reps, epochs = (1, 8) if args.quick else (3, 16)
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
    for rep in range(reps):
        for case in CASES:
            r = one_run(case, epochs)
            runs[case].append(r)
            print(f"[{rep + 1}/{reps}] {case}: " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                                                              for k, v in r.items()}), flush=True)
    results: dict[str, Any] = {"config": {"example": "examples/mnist_allreduce.yaml", "epochs": epochs,
                                          "every_s": EVERY_S, "partitions": 32, "repetitions": reps},
                               "runs": runs}
    summary = {}
    for case, rs in runs.items():
        t = [r["train_s"] for r in rs]
        summary[case] = {"train_s": {"median": median(t), "min": min(t), "max": max(t)},
                         **{k: median([r[k] for r in rs if r[k] is not None]) if any(r[k] is not None for r in rs)
                            else None for k in ("checkpoints", "bytes", "seconds_on_path", "write_s", "pause_s")}}
    results["summary"] = summary
    base = summary["none"]["train_s"]["median"]
    ratios = {f"{case}_vs_none": summary[case]["train_s"]["median"] / base for case in TIMED}
    for case in TIMED:
        n = summary[case]["checkpoints"]
        summary[case]["seconds_per_checkpoint"] = (summary[case]["train_s"]["median"] - base) / n if n else None
    for case, s in summary.items():
        t = s["train_s"]
        print(f"  {case:<10} train_s {t['median']:.2f} ({t['min']:.2f}-{t['max']:.2f})  checkpoints {s['checkpoints']}  "
              f"bytes {s['bytes']}  on path {s['seconds_on_path']}  write_s {s['write_s']}  pause_s {s['pause_s']}  "
              f"per checkpoint {s.get('seconds_per_checkpoint')}")
    report("checkpointing", args.quick, results, ratios, args.json)


if __name__ == "__main__":
    main()
