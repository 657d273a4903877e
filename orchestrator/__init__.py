"""Elastic Orchestrator: elastic training of PyTorch models on Ray actors.

The names below are loaded when first used (PEP 562), so a process that imports one submodule
(`python -m orchestrator` refusing a bad config, a tool reading a run's files) does not pay for
torch, Ray and MLflow before it needs them."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.config import JobConfig
    from orchestrator.errors import ConfigError, TrainingError
    from orchestrator.reporting.reporter import Action
    from orchestrator.reporting.result import TrainResult
    from orchestrator.trainer import ElasticTrainer
    from policies.rules.tasks import Task

_WHERE = {"JobConfig": "orchestrator.config", "ConfigError": "orchestrator.errors",
          "TrainingError": "orchestrator.errors", "Action": "orchestrator.reporting.reporter",
          "TrainResult": "orchestrator.reporting.result", "ElasticTrainer": "orchestrator.trainer",
          "Task": "policies.rules.tasks"}
__all__ = ["Action", "ElasticTrainer", "JobConfig", "TrainResult", "ConfigError", "TrainingError", "Task"]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
