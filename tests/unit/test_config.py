"""Config: typed, validated, overridable; bad input is one line naming the field."""
import pytest

from orchestrator.config import JobConfig, apply_overrides
from orchestrator.errors import ConfigError


def test_defaults_validate_and_flatten():
    cfg = JobConfig()
    flat = cfg.flat()
    assert flat["strategy.mode"] == "allreduce"
    assert flat["optimizer.lr"] == 0.05
    assert "model.factory" in flat


def test_overrides_are_coerced_to_the_field_type():
    cfg = JobConfig.from_dict({}, ["optimizer.lr=0.2", "scaling.replicas=3", "stop.target_accuracy=0.9",
                                   "model.kwargs.hidden=17", "tracking.run_name=abc"])
    assert cfg.optimizer.lr == 0.2 and isinstance(cfg.optimizer.lr, float)
    assert cfg.scaling.replicas == 3 and isinstance(cfg.scaling.replicas, int)
    assert cfg.model.kwargs == {"hidden": 17}
    assert cfg.tracking.run_name == "abc"


def test_yaml_round_trip(tmp_path):
    cfg = JobConfig.from_dict({"optimizer": {"lr": 0.3}})
    path = tmp_path / "job.yaml"
    path.write_text(cfg.to_yaml())
    assert JobConfig.from_yaml(path) == cfg


@pytest.mark.parametrize("raw, overrides, field", [
    ({"optimizer": {"lr": 0}}, [], "optimizer.lr"),
    ({}, ["optimizer.lr=-1"], "optimizer.lr"),
    ({"scaling": {"replicas": 0}}, [], "scaling.replicas"),
    ({"scaling": {"replicas": "two"}}, [], "scaling.replicas"),
    ({"optimzer": {"lr": 0.1}}, [], "unknown key optimzer"),
    ({"optimizer": {"rate": 0.1}}, [], "unknown key optimizer.rate"),
    ({}, ["stop.epochs=1.5"], "stop.epochs"),
    ({}, ["optimizer.name=rmsprop"], "optimizer.name"),
    ({}, ["strategy.mode=ring"], "strategy.mode"),
    ({}, ["data.source=builtin:imagenet"], "data.source"),
    ({}, ["model.factory=nocolon"], "model.factory"),
    ({}, ["stop.target_accuracy=1.5"], "stop.target_accuracy"),
])
def test_bad_input_names_the_field(raw, overrides, field):
    with pytest.raises(ConfigError) as exc:
        JobConfig.from_dict(raw, overrides)
    msg = str(exc.value)
    assert field in msg and "\n" not in msg


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_overrides({}, ["optimizer.lr"])
    with pytest.raises(ConfigError, match="config file not found"):
        JobConfig.from_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        JobConfig.from_yaml(bad)


def test_docs_config_reference_is_current():
    import os

    from orchestrator.config import reference_markdown

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "config.md")
    with open(path) as f:
        assert f.read().strip() == reference_markdown().strip(), "run: python -m orchestrator config-reference > docs/config.md"
