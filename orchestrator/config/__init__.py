"""The job config: typed, validated, documented; YAML is a view of these models.

`JobConfig` (orchestrator/config/job.py) holds the sections: what is trained and how it is kept
(orchestrator/config/sections.py), how replicas train together (orchestrator/config/strategy.py), and
the replicas as a fleet: scaling, fault tolerance, injected faults (orchestrator/config/fleet.py).
`JobConfig.from_yaml(path, overrides)` is the one way in from the outside world; it raises
`ConfigError` with a single line naming the field or file on bad input; every YAML a user gives is
read by orchestrator/config/yaml_file.py (duplicate keys refused). docs/config.md is
written from these models by orchestrator/cli/config_docs.py.
"""
from orchestrator.config.job import JobConfig, apply_overrides, describe_validation_error
from orchestrator.config.yaml_file import MAX_YAML_VALUES, UniqueKeyLoader, read_mapping, yaml_shape_problem
from orchestrator.config.sections import (RUN_NAME, CheckpointConfig, DataConfig, ModelConfig,
                                          RunConfig, Section, StopConfig, TargetConfig, TaskConfig, TrackingConfig)
from orchestrator.config.optim import OptimizerConfig, ScheduleConfig
from orchestrator.config.fleet import FaultsConfig, FaultToleranceConfig, ScalingConfig, SlowWindow
from orchestrator.config.strategy import (MODE_OPTIONS, UNTIL_COUNTS, AdaptiveConfig, PhaseConfig, PhaseOptimizer,
                                          StrategyConfig)

__all__ = [
    "MAX_YAML_VALUES", "JobConfig", "UniqueKeyLoader", "apply_overrides", "describe_validation_error", "read_mapping",
    "yaml_shape_problem", "RUN_NAME",
    "CheckpointConfig", "DataConfig", "ModelConfig", "OptimizerConfig", "RunConfig", "Section", "StopConfig",
    "TargetConfig", "TaskConfig", "TrackingConfig", "MODE_OPTIONS", "UNTIL_COUNTS", "AdaptiveConfig", "FaultsConfig",
    "FaultToleranceConfig", "PhaseConfig", "PhaseOptimizer", "ScalingConfig", "SlowWindow", "StrategyConfig",
]
