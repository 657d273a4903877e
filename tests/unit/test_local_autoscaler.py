"""orchestrator/testing/local_autoscaler.py without starting anything: the cluster config it writes for
Ray's autoscaler (the fake multi-node provider's base config, which Ray's wheel does not ship)
passes Ray's own config schema, and a broken copy does not."""
from __future__ import annotations

import copy

import jsonschema
import pytest
from ray.autoscaler._private.util import validate_config

from orchestrator.testing.local_autoscaler import HEAD_NODE_TYPE, LocalAutoscalingCluster

CPU_NODE = {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 0, "max_workers": 2}


def _config() -> dict:
    return LocalAutoscalingCluster({"CPU": 0}, {"cpu_node": dict(CPU_NODE)}, idle_timeout_minutes=0.2,
                                   max_workers=2)._config


def test_the_generated_config_passes_rays_schema():
    config = _config()
    validate_config(config)
    assert config["provider"]["type"] == "fake_multinode" and config["head_node_type"] == HEAD_NODE_TYPE
    assert config["available_node_types"][HEAD_NODE_TYPE]["resources"] == {"CPU": 0}
    assert config["available_node_types"]["cpu_node"] == CPU_NODE
    assert config["idle_timeout_minutes"] == 0.2 and config["max_workers"] == 2


def test_a_broken_config_fails_rays_schema():
    config = copy.deepcopy(_config())
    del config["provider"]["type"]
    with pytest.raises(jsonschema.ValidationError):
        validate_config(config)


def test_nothing_starts_before_start():
    cluster = LocalAutoscalingCluster({"CPU": 0}, {"cpu_node": dict(CPU_NODE)})
    assert cluster.proc is None and cluster.shutdown() == []
