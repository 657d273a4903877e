"""MLflow tracking from one place (the driver): one run per job, through MlflowClient so a
job never disturbs the caller's active fluent run."""
from __future__ import annotations

import json
import os
import platform
import time
from typing import Any, Optional

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

MAX_BATCH = 900  # MLflow accepts up to 1000 metrics per log_batch


class Tracker:
    def __init__(self, tracking_uri: Optional[str], experiment: str, run_name: Optional[str]) -> None:
        self.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        self.client = MlflowClient(self.tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(self.experiment_id, run_name=run_name).info.run_id
        self.events: list[dict[str, Any]] = []

    def log_params(self, params: dict[str, Any]) -> None:
        items = [Param(k, json.dumps(v) if isinstance(v, (list, dict)) else str(v)) for k, v in params.items()]
        for i in range(0, len(items), 90):
            self.client.log_batch(self.run_id, params=items[i : i + 90])

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_metrics(self, rows: list[tuple[str, float, int]]) -> None:
        """(key, value, step) rows, batched."""
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(s)) for k, v, s in rows]
        for i in range(0, len(metrics), MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + MAX_BATCH])

    def event(self, kind: str, t0: float, **fields: Any) -> dict[str, Any]:
        """Record an event (kept for events.jsonl and the result) with seconds since fit()."""
        ev = {"t": round(time.perf_counter() - t0, 3), "kind": kind, **fields}
        self.events.append(ev)
        return ev

    def log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def log_file(self, path: str) -> None:
        self.client.log_artifact(self.run_id, path)

    def finish(self, status: str) -> None:
        self.log_text("".join(json.dumps(e) + "\n" for e in self.events), "events.jsonl")
        self.client.set_terminated(self.run_id, status)

    def where(self) -> str:
        return f"MLflow run {self.run_id} (experiment {self.experiment_id}) at {self.tracking_uri}"


def environment_tags() -> dict[str, str]:
    import ray
    import torch

    return {"ray_version": ray.__version__, "torch_version": torch.__version__,
            "python_version": platform.python_version(), "host_cpus": str(os.cpu_count())}
