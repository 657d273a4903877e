"""What a model's `forward` returns, as the task sees it (docs/tasks.md "Model outputs").

A model may return a tensor, a tuple or list (its first element the predictions), a dict, or a
Hugging Face `ModelOutput` (a dict whose keys are the fields the model filled in). Every caller
that runs the model for a task (each mode's step, evaluation, a spare's rehearsal, calibration,
the checks before a run, MLflow logging) goes through `run_model`, so a task sees one thing:
- an ordinary task (`classification`, `regression`, `language_model`, the user's own) gets the
  predictions: the tensor, the tuple's first element, or the dict's `logits`;
- a task with `labels_to_model` (`model_loss`) gives the batch's targets to the model as well
  (`labels=targets`, or the targets' names when they are a dict) and gets the output whole,
  so the model computes its own loss (Hugging Face's convention: the model shifts and masks
  its labels itself).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from policies.rules.batches import Tree, forward


def predictions(outputs: Any, with_loss: bool = False) -> torch.Tensor:
    """The predictions in `outputs`: a tensor as it is; a tuple or list: its first element (with
    `with_loss`, the model was given labels: its second, the loss being first); a dict or
    ModelOutput: its `logits` (or, without one, its one tensor that is not `loss`). ValueError in
    one line when none is there."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        if "logits" in outputs:
            return outputs["logits"]
        rest = [k for k, v in outputs.items() if k != "loss" and isinstance(v, torch.Tensor)]
        if len(rest) == 1:
            return outputs[rest[0]]
        raise ValueError(f"the model returned a {type(outputs).__name__} with keys {list(outputs)}: no 'logits' and "
                         f"{'no' if not rest else 'more than one'} other tensor to take as its predictions")
    first = 1 if with_loss else 0
    if isinstance(outputs, (tuple, list)) and len(outputs) > first and isinstance(outputs[first], torch.Tensor):
        return outputs[first]
    raise ValueError(f"the model returned {_what(outputs)}; a tensor, a tuple (predictions first), a dict or a "
                     "ModelOutput (with logits) is needed")


def own_loss(outputs: Any) -> torch.Tensor:
    """The loss a model computed itself from the labels it was given: a dict's or ModelOutput's
    `loss`, or a tuple's first element (a ModelOutput's tuple form puts the loss first)."""
    if isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    elif isinstance(outputs, (tuple, list)) and outputs:
        loss = outputs[0]
    else:
        loss = None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"the model returned {_what(outputs)} when given labels=; task model_loss needs its own loss "
                         "(a dict or ModelOutput with a scalar `loss`, or a tuple with the loss first)")
    return loss.reshape(())


def run_model(model: torch.nn.Module, task: Any, inputs: Tree, targets: Any) -> Any:
    """The model on a batch, as `task` takes its outputs: the predictions, or with the task's
    `labels_to_model` the output whole, the targets given to the model as `labels=` (a dict of
    targets: each by its name)."""
    if not getattr(task, "labels_to_model", False):
        return predictions(forward(model, inputs))
    labels = dict(targets) if isinstance(targets, Mapping) else {"labels": targets}
    if isinstance(inputs, Mapping):
        return model(**inputs, **labels)
    return model(inputs, **labels)


def _what(outputs: Any) -> str:
    if isinstance(outputs, (tuple, list)):
        return f"a {type(outputs).__name__} of {len(outputs)} ({', '.join(type(o).__name__ for o in outputs[:3])})"
    if isinstance(outputs, torch.Tensor):
        return f"a tensor of shape {list(outputs.shape)}"
    return f"a {type(outputs).__name__}"
