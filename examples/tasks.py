"""A task of your own (`task: {name: examples.tasks:margin_task}`): the loss, the evaluation
sums and the metrics, written as docs/tasks.md describes.

Multi-class hinge loss (a support-vector machine's loss on the model's class scores) judged by
top-2 accuracy: a row counts when its true class is among the two highest scores. Every figure
`evaluate` returns is a sum over rows, so the orchestrator can add them across batches and
replicas before `finish` divides once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from orchestrator import Task


class MarginTask(Task):
    name = "margin"
    metrics = ("test_loss", "test_top2_accuracy", "test_accuracy")
    goals = {"test_loss": "min", "test_top2_accuracy": "max", "test_accuracy": "max"}
    primary = "test_top2_accuracy"  # what progress lines and training.png show first
    target_dtype = "int64"  # the builtin decoder's dtype for the label column: class ids

    def __init__(self, margin: float = 1.0) -> None:
        self.margin = margin

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.multi_margin_loss(outputs, targets, margin=self.margin)

    def evaluate(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        top2 = outputs.topk(2, dim=1).indices
        return {"hinge_sum": float(F.multi_margin_loss(outputs, targets, margin=self.margin, reduction="sum")),
                "top2": float((top2 == targets[:, None]).any(1).sum()),
                "top1": float((top2[:, 0] == targets).sum()),
                "rows": float(len(targets))}

    def finish(self, sums: dict[str, float]) -> dict[str, float]:
        n = sums["rows"]
        return {"test_loss": sums["hinge_sum"] / n, "test_top2_accuracy": sums["top2"] / n,
                "test_accuracy": sums["top1"] / n}


def margin_task(margin: float = 1.0) -> MarginTask:
    """The factory `task.name` points at; `task.kwargs` are its arguments."""
    return MarginTask(margin)
