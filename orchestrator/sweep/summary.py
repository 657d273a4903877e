"""After the trials: every trial's figures read back from MLflow, the comparison table (markdown,
CSV) and the plot of the metric against wall-clock seconds, and the sweep's result."""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from orchestrator.config import JobConfig
from orchestrator.sweep.schema import SWEEP_PREFIX, SweepPlan, with_values

READ_TIMEOUT_S = 60.0  # reading a trial's result back from MLflow


@dataclass
class SweepResult:
    parent_run_id: str
    tracking_uri: str
    experiment_id: str
    metric: str
    goal: str
    best_run_id: Optional[str]
    best_trial: Optional[str]
    best_value: Optional[float]
    best_params: dict[str, Any]
    best_config: Optional[dict[str, Any]]
    rows: list[dict[str, Any]] = field(default_factory=list)  # the comparison table, one row per trial
    wall_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)




def collect(grid: Any, plan: SweepPlan, tracker: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One table row per trial, from Tune's results and each finished child run's result.json;
    and each trial's (seconds, the sweep's metric) history for the plot."""
    from orchestrator.checks import bounded
    from orchestrator.trainer import run_mode

    rows, histories = [], {}
    for res in grid:
        params = {k: res.config.get(k) for k in plan.sweep.search}
        last = res.metrics or {}
        trial_id = last.get("trial_id") or (os.path.basename(res.path) if res.path else "?")
        run_id = last.get("mlflow_run_id") or None
        df = res.metrics_dataframe
        if df is not None and "t_s" in df:
            histories[trial_id] = (list(df["t_s"]), list(df.get(plan.sweep.metric, [])), params)
        summary: dict[str, Any] = {}
        if run_id:
            try:
                summary = bounded(lambda r=run_id: _run_summary(tracker.client, r), READ_TIMEOUT_S, f"run {run_id}")
            except Exception:
                summary = {}
        cfg = JobConfig.from_dict(with_values(plan.base_raw, params))
        status = ("failed" if res.error is not None else "finished" if summary.get("status") == "FINISHED"
                  else "stopped_early" if summary.get("stopped_early") else summary.get("status", "unknown").lower())
        rows.append({
            "trial": trial_id, "run_id": run_id, "status": status, "mode": run_mode(cfg),
            "params": params, "epochs": last.get("epoch"),
            "time_to_target_s": summary.get("time_to_target_s"),
            "final": {k: last[k] for k in cfg.metric_goals() if last.get(k) is not None},
            "metric": last.get(plan.sweep.metric),
            "samples_per_s": summary.get("samples_per_s"),
            "wall_s": summary.get("wall_s"),
            "error": " ".join(str(res.error).split())[:300] if res.error is not None else None,
        })
    rows.sort(key=lambda r: r["trial"])
    return rows, histories


def _run_summary(client: Any, run_id: str) -> dict[str, Any]:
    run = client.get_run(run_id)
    out: dict[str, Any] = {"status": run.info.status,
                           "stopped_early": run.data.tags.get(f"{SWEEP_PREFIX}stopped_early") == "true"}
    if run.info.status == "FINISHED":
        with tempfile.TemporaryDirectory() as tmp:
            try:
                with open(client.download_artifacts(run_id, "result.json", tmp), encoding="utf-8") as f:
                    result = json.load(f)
                out.update(time_to_target_s=result.get("time_to_target_s"), samples_per_s=result.get("samples_per_s"),
                           wall_s=result.get("wall_s"))
            except Exception:
                pass
    return out


def summarise(plan: SweepPlan, tracker: Any, rows: list[dict[str, Any]], histories: dict[str, Any],
               wall_s: float) -> SweepResult:
    spec = plan.sweep
    ranked = [r for r in rows if r["metric"] is not None and r["status"] != "failed"]
    best = (max if spec.goal == "max" else min)(ranked, key=lambda r: r["metric"]) if ranked else None
    best_config = JobConfig.from_dict(with_values(plan.base_raw, best["params"])).model_dump(mode="json") \
        if best else None
    result = SweepResult(
        parent_run_id=tracker.run_id, tracking_uri=tracker.tracking_uri, experiment_id=tracker.experiment_id,
        metric=spec.metric, goal=spec.goal or "max", best_run_id=best["run_id"] if best else None,
        best_trial=best["trial"] if best else None, best_value=best["metric"] if best else None,
        best_params=best["params"] if best else {}, best_config=best_config, rows=rows, wall_s=wall_s)
    tracker.log_text(comparison_csv(rows), "comparison.csv")
    tracker.log_text(comparison_markdown(rows, spec.metric), "comparison.md")
    tracker.log_text(result.to_json(), "sweep_result.json")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "metric_vs_time.png")
        plot_metric(histories, path, spec.metric)
        tracker.log_file(path)
    if best:
        tracker.set_tags({f"{SWEEP_PREFIX}best_run_id": best["run_id"], f"{SWEEP_PREFIX}best_trial": best["trial"]})
        tracker.log_metrics([(f"best_{spec.metric}", best["metric"], 0)])
    return result


COLUMNS = ("trial", "status", "mode", "params", "metric", "time_to_target_s", "final", "samples_per_s", "epochs",
           "run_id")


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, dict):
        return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def comparison_csv(rows: list[dict[str, Any]]) -> str:
    import csv
    import io

    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(COLUMNS)
    for r in rows:
        writer.writerow([_cell(r.get(c)) for c in COLUMNS])
    return buf.getvalue()


def comparison_markdown(rows: list[dict[str, Any]], metric: str) -> str:
    lines = [f"# Sweep: trials compared (ranked by {metric})", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot_metric(histories: dict[str, tuple[list[float], list[float], dict[str, Any]]], path: str,
                metric: str = "test_accuracy") -> None:
    """The sweep's metric against the trial's wall-clock seconds, one line per trial (Agg
    backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for trial, (secs, acc, params) in sorted(histories.items()):
        if secs and acc:
            ax.plot(secs, acc, marker="o", label=f"{trial}: {_cell(params)}")
    ax.set_xlabel("wall-clock seconds since the trial started")
    label = metric.replace("_", " ")
    ax.set_ylabel(label)
    ax.set_title(f"Sweep: {label} per trial")
    ax.grid(alpha=0.3)
    if histories:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
