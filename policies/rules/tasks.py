"""Tasks: what a run learns and how it is judged (config `task:`; docs/tasks.md).

A task is three small functions over a batch's model outputs and targets:
- `loss(outputs, targets)`: the mean loss of the batch, the scalar the optimizer minimises;
- `evaluate(outputs, targets)`: evaluation statistics of the batch as *sums* (a float or a
  numpy array per name): sums add up across batches and replicas, so a distributed evaluation
  equals a single-process one exactly, not an average of averages;
- `finish(sums)`: the named metrics from the sums over the whole test split.
plus `metrics` (the names `finish` returns) and `goals` (for each, "max" or "min": which way is
better). Every mode's update rule and every replica calls the task; nothing else in
`policies/` or `actors/` knows what is being learned.

The mean loss of a batch of n rows is weighted by n where batches meet (allreduce sums
loss x n and gradients across replicas and divides by the rows of the step), so the update is
the one a single process makes on the union of the replicas' batches.

Builtins: `classification` (cross-entropy; test_loss, test_accuracy), `regression` (mean
squared error; test_loss, test_mse, test_mae, test_r2), `language_model` (next-token
cross-entropy; test_loss, test_perplexity). `task.name: "module:function"` loads the user's
own: the function takes `task.kwargs` and returns a `Task`.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from policies.rules.imports import import_function

Stats = dict[str, Union[float, np.ndarray]]
GOALS = ("max", "min")


class Task:
    """Base class of a task (subclass it, or write any object with the same members).

    `input_dtype` / `target_dtype`: what the builtin decoder makes of numeric columns for this
    task (a user's `data.decode` chooses its own dtypes)."""

    name: str = "task"
    metrics: tuple[str, ...] = ()
    goals: Mapping[str, str] = {}
    primary: Optional[str] = None  # the metric shown first (progress lines, plots); default metrics[0]
    input_dtype: str = "float32"
    target_dtype: str = "int64"

    def loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """The mean loss of the batch (a scalar tensor with a gradient)."""
        raise NotImplementedError

    def evaluate(self, outputs: Any, targets: Any) -> Stats:
        """Sums over the batch's rows, one float or numpy array per name."""
        raise NotImplementedError

    def finish(self, sums: Stats) -> dict[str, float]:
        """The metrics (every name in `metrics`) from the sums over the whole test split."""
        raise NotImplementedError


def add_stats(total: Stats, part: Stats) -> Stats:
    """`total` + `part`, name by name (float64, so summing many batches loses nothing)."""
    out = dict(total)
    for k, v in part.items():
        v = np.asarray(v, dtype=np.float64) if not isinstance(v, float) else v
        out[k] = out[k] + v if k in out else v
    return out


def sum_stats(parts: list[Stats]) -> Stats:
    total: Stats = {}
    for p in parts:
        total = add_stats(total, p)
    return total


def _f(t: torch.Tensor) -> float:
    """A sum as a Python float (evaluation sums are taken in float64: many batches and replicas
    add up without losing digits)."""
    return float(t.detach().double().sum())


class Classification(Task):
    """Cross-entropy over class logits [n, classes] and integer class ids [n].
    test_loss = sum of -log p(y) / n; test_accuracy = rows whose largest logit is y / n."""

    name = "classification"
    metrics = ("test_loss", "test_accuracy")
    goals = {"test_loss": "min", "test_accuracy": "max"}
    primary = "test_accuracy"
    target_dtype = "int64"

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    def evaluate(self, outputs: torch.Tensor, targets: torch.Tensor) -> Stats:
        return {"loss_sum": _f(F.cross_entropy(outputs.double(), targets, reduction="sum")),
                "correct": float((outputs.argmax(1) == targets).sum()), "rows": float(len(targets))}

    def finish(self, sums: Stats) -> dict[str, float]:
        n = float(sums["rows"])
        return {"test_loss": float(sums["loss_sum"]) / n, "test_accuracy": float(sums["correct"]) / n}


class Regression(Task):
    """Mean squared error over float outputs and targets of the same shape ([n] or [n, k]).
    With e = output - target over the n x k values: test_mse = sum e^2 / (n k), test_loss =
    test_mse, test_mae = sum |e| / (n k); test_r2 = mean over the k target columns of
    1 - SSE_j / SST_j, SST_j = sum y_j^2 - (sum y_j)^2 / n (scikit-learn's r2_score,
    uniform average)."""

    name = "regression"
    metrics = ("test_loss", "test_mse", "test_mae", "test_r2")
    goals = {"test_loss": "min", "test_mse": "min", "test_mae": "min", "test_r2": "max"}
    primary = "test_r2"
    target_dtype = "float32"

    @staticmethod
    def _match(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if outputs.shape != targets.shape and outputs.numel() == targets.numel():
            outputs = outputs.reshape(targets.shape)  # [n, 1] outputs for [n] targets and the like
        if outputs.shape != targets.shape:
            raise ValueError(f"regression: the model gives outputs of shape {list(outputs.shape)} for targets of "
                             f"shape {list(targets.shape)}")
        return outputs, targets.to(outputs.dtype)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(*self._match(outputs, targets))

    def evaluate(self, outputs: torch.Tensor, targets: torch.Tensor) -> Stats:
        out, y = self._match(outputs, targets)
        out, y = out.double().reshape(len(y), -1), y.double().reshape(len(y), -1)
        e = out - y
        return {"sse": (e * e).sum(0).numpy(), "sae": float(e.abs().sum()), "rows": float(len(y)),
                "sum_y": y.sum(0).numpy(), "sum_y2": (y * y).sum(0).numpy()}

    def finish(self, sums: Stats) -> dict[str, float]:
        n = float(sums["rows"])
        sse = np.asarray(sums["sse"], dtype=np.float64)
        values = n * sse.size
        sst = np.asarray(sums["sum_y2"]) - np.asarray(sums["sum_y"]) ** 2 / n
        r2 = np.where(sst > 0, 1.0 - sse / np.where(sst > 0, sst, 1.0), 0.0)
        mse = float(sse.sum()) / values
        return {"test_loss": mse, "test_mse": mse, "test_mae": float(sums["sae"]) / values, "test_r2": float(r2.mean())}


class LanguageModel(Task):
    """Next-token cross-entropy: outputs are logits [n, T, vocab] for inputs of T tokens,
    targets the next token at each position [n, T] (ids < 0 are padding and not counted).
    test_loss = sum of -log p(next token) / tokens; test_perplexity = exp(test_loss)."""

    name = "language_model"
    metrics = ("test_loss", "test_perplexity")
    goals = {"test_loss": "min", "test_perplexity": "min"}
    primary = "test_perplexity"
    input_dtype = "int64"
    target_dtype = "int64"

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1), ignore_index=-1)

    def evaluate(self, outputs: torch.Tensor, targets: torch.Tensor) -> Stats:
        flat = targets.reshape(-1)
        nll = F.cross_entropy(outputs.double().reshape(-1, outputs.shape[-1]), flat, ignore_index=-1, reduction="sum")
        return {"nll": _f(nll), "tokens": float((flat >= 0).sum())}

    def finish(self, sums: Stats) -> dict[str, float]:
        loss = float(sums["nll"]) / max(float(sums["tokens"]), 1.0)
        return {"test_loss": loss, "test_perplexity": math.exp(min(loss, 700.0))}


BUILTIN_TASKS = {"classification": Classification, "regression": Regression, "language_model": LanguageModel}


def load_task(name: str, kwargs: Optional[dict[str, Any]] = None) -> Task:
    """A builtin task by name, or the user's: 'module:function' called with `kwargs`. Raises
    ValueError (unknown name, not importable, not a task) in one line."""
    kwargs = kwargs or {}
    if name in BUILTIN_TASKS:
        make = BUILTIN_TASKS[name]
    elif ":" not in name:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(BUILTIN_TASKS)} or give 'module:function'")
    else:
        make = import_function(name)  # NotImportable (a ValueError) names what is missing
    try:
        task = make(**kwargs)
    except Exception as exc:  # kwargs the task does not take, or its constructor's own complaint
        raise ValueError(f"{name}(**task.kwargs) failed ({type(exc).__name__}: {' '.join(str(exc).split())})") from None
    if name not in BUILTIN_TASKS:
        check_task(task, name)
    return task


def split_metric(name: str, split: str) -> str:
    """A task metric's name when it was measured on `split`: the task's own name ("test_...")
    on the test split; "val_" + the rest on the validation split (test_accuracy -> val_accuracy,
    a custom task's "bleu" -> "val_bleu")."""
    return name if split == "test" else "val_" + name.removeprefix("test_")


def primary_metric(task: Any) -> str:
    """The metric a run of `task` is summarised by when no target names one."""
    return getattr(task, "primary", None) or tuple(task.metrics)[0]


def check_task(task: Any, name: str) -> None:
    """The members every task needs, and metric names with a goal each."""
    for member in ("loss", "evaluate", "finish"):
        if not callable(getattr(task, member, None)):
            raise ValueError(f"{name} returned {type(task).__name__}, which has no {member}() (see docs/tasks.md)")
    metrics = tuple(getattr(task, "metrics", ()) or ())
    if not metrics:
        raise ValueError(f"{name}: the task names no metrics (its `metrics` attribute is empty)")
    goals = dict(getattr(task, "goals", {}) or {})
    for m in metrics:
        if not isinstance(m, str) or not m.isidentifier():
            raise ValueError(f"{name}: metric name {m!r} is not an identifier")
        if goals.get(m) not in GOALS:
            raise ValueError(f"{name}: metric {m!r} needs a goal, 'max' or 'min' (task.goals), got {goals.get(m)!r}")
