"""What a run returns (ElasticTrainer.fit) and writes (--result-json)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass
class FinalMetrics:
    test_accuracy: float
    test_loss: float
    train_loss: float


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
    time_to_target_s: Optional[float]  # from fit() until test accuracy first reached the target
    final: FinalMetrics
    stop_reason: str
    checkpoint: Optional[str]
    tracking_uri: str
    experiment_id: str
    rows_per_epoch: list[int] = field(default_factory=list)  # train rows stepped on in each epoch (all replicas)
    # which mode ran when: {phase, mode, start_step, end_step, start_s, end_s (training seconds), start_epoch,
    # test_accuracy_at_start, test_accuracy_at_end, ended_by}
    phases: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
