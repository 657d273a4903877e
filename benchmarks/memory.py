"""Memory of a streamed file source: does a dataset bigger than the driver's budget train?

Data: a Parquet directory written by a child process (so the driver's peak is not the
writer's): ROWS rows of 1024 float32 features (a fixed-size-list column; 10 Gaussian blobs)
and an int64 label, in FILES files with row groups of ~20k rows: ~1.5 GB (quick: a quarter).
One epoch of allreduce with 2 replicas through `ElasticTrainer` (a linear model, MLflow in a
temp sqlite store), on a local Ray started here with a 1 GB object store: smaller than the data.

A sampler thread reads /proc/PID/status every 0.2 s for the driver, each replica and every
other Ray worker process (the read tasks' workers among them): VmHWM (the kernel's peak RSS),
and the largest RssAnon (private heap) and RssShmem (object-store pages mapped) seen; and the
object store's use (Ray's memory summary) once a second.

The reference is the budget the design sets: driver peak RSS < 700 MB, each replica < 1.5 GB.
Ratios (higher is better): budget / measured peak, and the data's size / the driver's peak
(> 1: the driver never held the data).

    python benchmarks/memory.py [--quick] [--json PATH]
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time

from common import REPO, parse_args, report

DIM, CLASSES, ROW_GROUP = 1024, 10, 20_000
DRIVER_BUDGET_MB, REPLICA_BUDGET_MB = 700, 1500
SAMPLE_S, STORE_EVERY_S = 0.2, 1.0


def write_data(directory: str, rows: int, files: int) -> None:
    """Blobs written a row group at a time (the writer's memory stays ~one row group)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    centers = rng.normal(0, 1, size=(CLASSES, DIM)).astype(np.float32)
    per_file = rows // files
    for f in range(files):
        with pq.ParquetWriter(os.path.join(directory, f"part-{f:02d}.parquet"),
                              pa.schema([("features", pa.list_(pa.float32(), DIM)), ("label", pa.int64())])) as w:
            for lo in range(0, per_file, ROW_GROUP):
                n = min(ROW_GROUP, per_file - lo)
                y = rng.integers(0, CLASSES, n)
                x = centers[y] + rng.normal(0, 2, size=(n, DIM)).astype(np.float32)
                w.write_table(pa.table({"features": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), DIM),
                                        "label": y}), row_group_size=ROW_GROUP)


def status_mb(pid: int) -> dict[str, float]:
    """VmHWM, RssAnon, RssShmem of a process in MB ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "RssAnon", "RssShmem"):
                    out[key] = int(rest.split()[0]) / 1024
    except OSError:
        return {}
    return out


def ray_workers() -> dict[int, str]:
    """pid -> process title of this machine's Ray worker processes ("ray::...")."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    title = f.read().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if title.startswith("ray::"):
                found[int(name)] = title
    return found


class Sampler:
    """Peaks per process, and the object store's largest use, until stopped."""

    def __init__(self, trainer) -> None:
        self.trainer, self.stop = trainer, threading.Event()
        self.peaks: dict[int, dict[str, float]] = {}
        self.titles: dict[int, set[str]] = {}
        self.replica_pids: set[int] = set()
        self.store_mb, self.store_objects = 0.0, 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        last_store = 0.0
        while not self.stop.is_set():
            ctl = self.trainer.controller
            if ctl is not None:
                self.replica_pids.update(ctl.group.pids.values())
            pids = {os.getpid(): "driver", **ray_workers()}
            for pid, title in pids.items():
                self.titles.setdefault(pid, set()).add(title)
                now, peak = status_mb(pid), self.peaks.setdefault(pid, {})
                for k, v in now.items():
                    peak[k] = max(peak.get(k, 0.0), v)
            if time.monotonic() - last_store >= STORE_EVERY_S:
                last_store = time.monotonic()
                self.sample_store()
            self.stop.wait(SAMPLE_S)

    def sample_store(self) -> None:
        from ray._private.internal_api import memory_summary

        try:
            text = memory_summary(stats_only=True)
        except Exception:
            return
        m = re.search(r"Plasma memory usage ([\d.]+) MiB, (\d+) objects", text)
        if m:
            self.store_mb = max(self.store_mb, float(m.group(1)))
            self.store_objects = max(self.store_objects, int(m.group(2)))


def train(source: str, tmp: str):
    from orchestrator.config import JobConfig
    from orchestrator.trainer import ElasticTrainer

    cfg = JobConfig.from_dict({
        "model": {"factory": "examples.models:linear", "kwargs": {"in_features": DIM, "num_classes": CLASSES}},
        "data": {"source": source, "batch_size": 512, "prefetch_partitions": 2},
        "optimizer": {"lr": 0.01}, "strategy": {"mode": "allreduce", "timeout_s": 120},
        "scaling": {"replicas": 2, "cpus_per_replica": 1}, "stop": {"epochs": 1},
        "tracking": {"tracking_uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "memory"},
        "checkpoint": {"storage": os.path.join(tmp, "checkpoints")},
    })
    trainer = ElasticTrainer(cfg, show_progress=False)
    sampler = Sampler(trainer)
    sampler.thread.start()
    t0 = time.perf_counter()
    result = trainer.fit()
    wall = time.perf_counter() - t0
    sampler.stop.set()
    sampler.thread.join(timeout=10)
    return trainer, sampler, result, wall


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rows, files = (95_000, 2) if args.quick else (380_000, 5)
    import ray

    with tempfile.TemporaryDirectory(prefix="eo-memory-") as tmp:
        data = os.path.join(tmp, "data")
        os.makedirs(data)
        t = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": REPO}
        subprocess.run([sys.executable, __file__, "--write", data, str(rows), str(files)], check=True, env=env,
                       timeout=1800)
        write_s = time.perf_counter() - t
        data_mb = sum(os.path.getsize(os.path.join(data, f)) for f in os.listdir(data)) / 2**20
        os.environ["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
        ray.init(address="local", num_cpus=2, object_store_memory=1 << 30, include_dashboard=False,
                 logging_level="ERROR")
        try:
            trainer, sampler, result, wall = train(data, tmp)
        finally:
            ray.shutdown()
    driver = sampler.peaks[os.getpid()]
    replicas = {pid: sampler.peaks.get(pid, {}) for pid in sorted(sampler.replica_pids)}
    readers = {pid: p for pid, p in sampler.peaks.items()
               if any("read_partition_task" in t for t in sampler.titles.get(pid, ()))}
    plan = trainer.check().train_plan
    results = {
        "rows": rows, "files": files, "row_group": ROW_GROUP, "data_mb_on_disk": round(data_mb, 1),
        "data_mb_decoded": round(rows * (DIM * 4 + 8) / 2**20, 1), "partitions": len(plan.ranges),
        "rows_per_partition": [min(plan.rows), max(plan.rows)], "write_s": round(write_s, 1),
        "fit_wall_s": round(wall, 1), "epoch_rows": result.rows_per_epoch,
        "test_accuracy": round(result.final.test_accuracy, 4),
        "driver_mb": {k: round(v, 1) for k, v in driver.items()},
        "replica_mb": [{k: round(v, 1) for k, v in p.items()} for p in replicas.values()],
        "read_worker_mb": [{k: round(v, 1) for k, v in p.items()} for p in readers.values()],
        "object_store_capacity_mb": 1024, "object_store_peak_mb": round(sampler.store_mb, 1),
        "object_store_peak_objects": sampler.store_objects,
        "budget_mb": {"driver": DRIVER_BUDGET_MB, "replica": REPLICA_BUDGET_MB},
    }
    worst_replica = max((p.get("VmHWM", 0.0) for p in replicas.values()), default=float("nan"))
    ratios = {"driver_budget_vs_peak_rss": DRIVER_BUDGET_MB / driver["VmHWM"],
              "replica_budget_vs_peak_rss": REPLICA_BUDGET_MB / worst_replica,
              "data_size_vs_driver_peak_rss": data_mb / driver["VmHWM"]}
    print(f"data {data_mb:.0f} MB on disk, {results['partitions']} partitions; fit {wall:.1f}s; "
          f"test_accuracy {result.final.test_accuracy:.4f}")
    print(f"driver   VmHWM {driver['VmHWM']:7.1f} MB  RssAnon {driver.get('RssAnon', 0):7.1f}  "
          f"RssShmem {driver.get('RssShmem', 0):7.1f}")
    for pid, p in replicas.items():
        print(f"replica  VmHWM {p.get('VmHWM', 0):7.1f} MB  RssAnon {p.get('RssAnon', 0):7.1f}  "
              f"RssShmem {p.get('RssShmem', 0):7.1f}  (pid {pid})")
    for pid, p in readers.items():
        print(f"reader   VmHWM {p.get('VmHWM', 0):7.1f} MB  RssAnon {p.get('RssAnon', 0):7.1f}  "
              f"RssShmem {p.get('RssShmem', 0):7.1f}  (pid {pid})")
    print(f"object store peak {sampler.store_mb:.0f} MB of 1024 MB ({sampler.store_objects} objects)")
    report("memory", args.quick, results, ratios, args.json)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--write":
        write_data(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
