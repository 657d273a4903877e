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
cross-entropy; test_loss, test_perplexity), `model_loss` (the model's own loss from the labels
it is given, Hugging Face's convention: policies/rules/outputs.py). `task.name:
"module:function"` loads the user's own: the function takes `task.kwargs` and returns a `Task`.

A task sees the model's predictions (the tensor, a tuple's first element, a dict's or
ModelOutput's `logits`: policies/rules/outputs.py), unless it sets `labels_to_model`: then the
model gets the targets as `labels=` and the task its output whole.
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
    labels_to_model: bool = False  # the model gets the targets as labels= and the task its output whole

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


IGNORE_INDEX = -100  # Hugging Face's label for a position not scored (padding, a prompt)


class ModelLoss(Task):
    """The model's own loss (Hugging Face's convention): the batch's targets go to the model as
    `labels=` and the loss is the `loss` it returns (it shifts and masks its labels itself), the
    scalar the optimizer minimises. Evaluation reads the output's `logits` against the labels
    (positions labelled -100 not counted), summed in float64 so replicas add up exactly:
    - `causal: true` (the default; a causal language model): logits at t score the label at t+1;
      test_loss = summed next-token cross-entropy / tokens scored; test_perplexity = exp of it.
    - `causal: false` (a classifier, per row or per token): logits score the label at the same
      place; test_loss = summed cross-entropy / labels scored; test_accuracy = labels whose
      largest logit is right / labels scored.
    The checks before a run compare the model's own loss with the one read from its logits on
    a sample: a model that does not shift (or does) as `causal` says is refused in one line.
    Where batches meet, each batch's loss is weighted by its rows (docs/tasks.md): exact when
    every row scores as many labels (fixed-length windows), a weighting by rows otherwise."""

    name = "model_loss"
    target_dtype = "int64"
    input_dtype = "int64"
    labels_to_model = True

    def __init__(self, causal: bool = True) -> None:
        if not isinstance(causal, bool):
            raise ValueError(f"task.kwargs.causal must be true or false, got {causal!r}")
        self.causal = causal
        self.metrics = ("test_loss", "test_perplexity") if causal else ("test_loss", "test_accuracy")
        self.goals = {"test_loss": "min", "test_perplexity": "min", "test_accuracy": "max"}
        self.primary = self.metrics[1]

    def loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        from policies.rules.outputs import own_loss

        return own_loss(outputs)

    def scored(self, outputs: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [m, vocab], labels [m]) of the places scored (the shift applied when causal)."""
        from policies.rules.outputs import predictions

        logits = predictions(outputs, with_loss=True)
        if isinstance(targets, dict) or targets.dtype.is_floating_point:
            raise ValueError("model_loss evaluates integer labels (one tensor); write a task for other targets "
                             "(docs/tasks.md)")
        if self.causal:
            if targets.ndim < 2:
                raise ValueError(f"model_loss: causal labels are a sequence a row; these are of shape "
                                 f"{list(targets.shape)} (task.kwargs.causal: false for one label a row)")
            logits, targets = logits[:, :-1], targets[:, 1:]
        if tuple(logits.shape[:-1]) != tuple(targets.shape):
            raise ValueError(f"model_loss: logits of shape {list(logits.shape)} do not score labels of shape "
                             f"{list(targets.shape)}{' (shifted by one: causal)' if self.causal else ''}")
        return logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)

    def evaluate(self, outputs: Any, targets: Any) -> Stats:
        logits, labels = self.scored(outputs, targets)
        keep = labels != IGNORE_INDEX
        nll = F.cross_entropy(logits.double(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
        stats = {"nll": _f(nll), "scored": float(keep.sum())}
        if not self.causal:
            stats["correct"] = float(((logits.argmax(-1) == labels) & keep).sum())
        return stats

    def finish(self, sums: Stats) -> dict[str, float]:
        n = max(float(sums["scored"]), 1.0)
        loss = float(sums["nll"]) / n
        if self.causal:
            return {"test_loss": loss, "test_perplexity": math.exp(min(loss, 700.0))}
        return {"test_loss": loss, "test_accuracy": float(sums["correct"]) / n}


BUILTIN_TASKS = {"classification": Classification, "regression": Regression, "language_model": LanguageModel,
                 "model_loss": ModelLoss}


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
