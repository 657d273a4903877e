"""Elastic Orchestrator: elastic training of PyTorch models on Ray actors."""
from orchestrator.config import JobConfig
from orchestrator.errors import ConfigError, TrainingError
from orchestrator.reporting.reporter import Action
from orchestrator.reporting.result import TrainResult
from orchestrator.trainer import ElasticTrainer
from policies.rules.tasks import Task

__all__ = ["Action", "ElasticTrainer", "JobConfig", "TrainResult", "ConfigError", "TrainingError", "Task"]
