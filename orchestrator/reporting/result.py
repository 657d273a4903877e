"""What a run returns (ElasticTrainer.fit) and writes (--result-json)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional


class FinalMetrics(dict):
    """Every metric of the run's last evaluation by name (the task's, e.g. test_accuracy and
    test_loss, or test_r2, ...) and train_loss; readable as attributes too (final.test_r2)."""

    def __getattr__(self, name: str) -> float:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no metric {name!r}; this run has {', '.join(self)}") from None


@dataclass
class TrainResult:
    mlflow_run_id: str
    mode: str
    replicas: int
    epochs: int
    steps: int
    samples: int
    wall_s: float  # from fit() to the end, startup included
    samples_per_s: float  # samples / seconds of whole epochs (training + evaluation + logging)
    steady_samples_per_s: float  # samples / seconds inside the replicas' step loops
    startup_s: float  # from fit() to the first step (Ray actors, process group, data)
    time_to_target_s: Optional[float]  # from fit() until the stop.target metric first reached its value
    final: FinalMetrics
    stop_reason: str
    checkpoint: Optional[str]
    tracking_uri: str
    experiment_id: str
    rows_per_epoch: list[int] = field(default_factory=list)  # train rows stepped on in each epoch (all replicas)
    # which mode ran when: {phase, mode, start_step, end_step, start_s, end_s (training seconds), start_epoch,
    # <metric>_at_start, <metric>_at_end (the headline metric, e.g. test_accuracy_at_start), ended_by}
    phases: list[dict[str, Any]] = field(default_factory=list)
    # the driver's seconds in each state of its loop: starting, running, repair, switch, grow,
    # evacuation, finishing (earlier drivers' of a resumed run included); wall_s less their sum
    # is fit()'s own time around the loop (connecting, MLflow, the final plot)
    state_s: dict[str, float] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)

    def headline(self, metric: str) -> str:
        """Why the run stopped and its headline `metric`: the first line of every summary."""
        line = f"done: {self.stop_reason}; {metric} {self.final.get(metric, float('nan')):.4f}"
        test = "test_" + metric.removeprefix("val_")  # a run judged on a validation split: its one test figure too
        if metric.startswith("val_") and test in self.final:
            line += f"; {test} {self.final[test]:.4f}"
        return line

    def final_line(self, metric: str) -> str:
        """The one line `--no-progress` prints: the headline and the MLflow run."""
        return f"{self.headline(metric)}; MLflow run {self.mlflow_run_id}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
