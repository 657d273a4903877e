"""Config: typed, validated, overridable; bad input is one line naming the field."""
import pytest

from orchestrator.config import JobConfig, apply_overrides, read_mapping
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
    ({}, ["optimizer.name=rmsprob"], "optimizer.name: unknown optimizer 'rmsprob'"),
    ({}, ["optimizer.name=lbfgs"], "lbfgs needs a closure"),
    ({}, ["strategy.mode=sandblaster", "checkpoint.every_s=5"], "strategy.mode sandblaster checkpoints at pass"),
    ({}, ["strategy.phases=[{mode: sandblaster, until: {epochs: 1}}, {mode: allreduce}]"],
     "strategy.mode sandblaster is one mode for the whole run"),
    ({}, ["strategy.mode=sandblaster", "optimizer.schedule={name: cosine}"], "sandblaster takes no optimizer.schedule"),
    ({}, ["strategy.mode=sandblaster", "strategy.history_size=0"], "strategy.history_size"),
    ({}, ["strategy.mode=sandblaster", "model.precision=fp16"], "sandblaster takes model.precision fp32 or bf16"),
    ({}, ["strategy.mode=sandblaster", "strategy.task_rows=0"], "strategy.task_rows"),
    ({}, ["strategy.mode=downpour", "optimizer.name=adafactor"], "factored"),
    ({}, ["optimizer.schedule={name: cosin}"], "unknown schedule"),
    ({}, ["strategy.mode=ring"], "strategy.mode"),
    ({}, ["data.source=builtin:imagenet"], "data.source"),
    ({}, ["model.factory=nocolon"], "model.factory"),
    ({}, ["stop.target_accuracy=1.5"], "stop.target_accuracy"),
    ({}, ["optimizer.lr=inf"], "optimizer.lr: Input should be a finite number"),
    ({}, ["optimizer.lr=1e400"], "optimizer.lr: Input should be a finite number"),
    ({}, ["optimizer.weight_decay=nan"], "optimizer.weight_decay: Input should be a finite number"),
    ({}, ["stop.max_wall_s=.inf"], "stop.max_wall_s: Input should be a finite number"),
    ({}, ["faults.slow_replicas={0: .inf}"], "faults.slow_replicas.0"),
    ({}, ["scaling.replicas=2", "faults.slow_replicas={2: 0.1}"], "faults.slow_replicas: no replica of rank 2"),
    ({"scaling": {"gpus_per_replica": 2}}, [], "scaling.gpus_per_replica: a replica uses one GPU"),
    ({}, ["strategy.mode=easgd", "optimizer.name=adam", "strategy.momentum=0.9"],
     "strategy.momentum is EAMSGD's Nesterov momentum for optimizer.name sgd"),
    ({}, ["strategy.mode=easgd", "optimizer.name=adagrad", "strategy.momentum=0.1"], "strategy.momentum"),
    ({}, ["strategy.backup_replicas=-1"], "strategy.backup_replicas"),
    ({}, ["scaling.replicas=2", "strategy.backup_replicas=2"], "strategy.backup_replicas (2) must be below"),
    ({}, ["strategy.backup_replicas=1", "strategy.balance=true"], "backup_replicas and balance"),
    ({}, ["strategy.backup_replicas=1", "strategy.compression=powersgd"], "backup_replicas and compression powersgd"),
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

    from orchestrator.cli.config_docs import reference_markdown

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "config.md")
    with open(path) as f:
        assert f.read().strip() == reference_markdown().strip(), "run: python -m orchestrator config-reference > docs/config.md"


def test_rules_that_still_allow_what_works():
    easgd_adam = JobConfig.from_dict({}, ["strategy.mode=easgd", "optimizer.name=adam", "strategy.momentum=0"])
    assert easgd_adam.optimizer.name == "adam"  # the replicas' local optimizer
    assert JobConfig.from_dict({}, ["strategy.mode=easgd", "strategy.momentum=0.9"]).strategy.momentum == 0.9
    assert JobConfig.from_dict({}, ["strategy.mode=downpour", "scaling.gpus_per_replica=0.5"]).scaling.gpus_per_replica == 0.5
    assert JobConfig.from_dict({}, ["scaling.gpus_per_replica=1"]).scaling.gpus_per_replica == 1
    for mode in ("allreduce", "local_sgd"):  # replicas sharing a GPU reduce with gloo (actors/reducer.group_backend)
        assert JobConfig.from_dict({}, [f"strategy.mode={mode}", "scaling.gpus_per_replica=0.5"]).scaling.gpus_per_replica == 0.5
    assert JobConfig.from_dict({}, ["scaling.replicas=3", "faults.slow_replicas={2: 0.1}"]).faults.slow_replicas[0].model_dump(
        exclude_none=True) == {"rank": 2, "delay_s": 0.1}  # the short form: one window, the whole run


def test_config_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_bytes(b"optimizer:\n  name: \xe9\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text") as exc:
        JobConfig.from_yaml(path)
    assert "\n" not in str(exc.value)


def test_every_example_job_config_validates():
    import glob
    import os

    root = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
    paths = [p for p in glob.glob(os.path.join(root, "*.yaml")) if "sweep" not in os.path.basename(p)]
    assert len(paths) >= 8
    for path in paths:
        JobConfig.from_yaml(path)  # raises ConfigError naming the field


def test_a_phase_takes_only_its_own_modes_options():
    cfg = JobConfig.from_dict({"strategy": {"phases": [{"mode": "local_sgd", "period": 3, "outer_momentum": 0.9,
                                                        "until": {"epochs": 1}}, {"mode": "allreduce"}]}})
    assert cfg.strategy.plan()[0]["period"] == 3 and cfg.strategy.plan()[0]["outer_momentum"] == 0.9
    with pytest.raises(ConfigError, match="period: used by local_sgd, gossip; this phase's mode"):
        JobConfig.from_dict({"strategy": {"phases": [{"mode": "allreduce", "period": 3}]}})


def test_group_backend_nccl_only_for_a_gpu_of_its_own():
    import torch

    from actors.replica.reducer import group_backend

    assert group_backend(torch.device("cpu"), 0) == "gloo"
    assert group_backend(torch.device("cuda"), 1) == "nccl"
    assert group_backend(torch.device("cuda"), 0.5) == "gloo"  # NCCL cannot put two ranks on one GPU


# ---- issue 57: bad input that was accepted --------------------------------------------------------

@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "null\n", "~\n", "---\n"])
def test_empty_config_file_is_an_error_naming_it(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        JobConfig.from_yaml(path)
    msg = str(exc.value)
    assert f"config file {path} is empty" in msg and "\n" not in msg, msg


@pytest.mark.parametrize("text, line, first, key", [
    ("optimizer:\n  lr: 0.1\n  lr: 0.2\n", 3, 2, "lr"),
    ("stop: {epochs: 1}\noptimizer: {lr: 0.1}\nstop: {epochs: 2}\n", 3, 1, "stop"),
    ("model:\n  kwargs:\n    hidden: 8\n    depth: 2\n    hidden: 16\n", 5, 3, "hidden"),  # nested deeper
    ("strategy: {mode: easgd, tau: 2, tau: 8}\n", 1, 1, "tau"),  # flow style: both on one line
])
def test_duplicate_key_in_a_config_file_names_both_lines(tmp_path, text, line, first, key):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        JobConfig.from_yaml(path)
    assert str(exc.value) == f"config error: {path}:{line}: duplicate key {key!r} (first at line {first})"


def test_a_merged_key_may_be_overridden_and_a_duplicate_in_set_is_refused(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("x-base: &base {lr: 0.1, momentum: 0.5}\noptimizer: {<<: *base, lr: 0.2}\n")
    raw = read_mapping(str(path))
    assert raw["optimizer"] == {"lr": 0.2, "momentum": 0.5}  # YAML's merge: the explicit key wins
    with pytest.raises(ConfigError, match=r"^--set model.kwargs: duplicate key 'hidden' \(first at line 1\)$"):
        apply_overrides({}, ["model.kwargs={hidden: 8, hidden: 16}"])


@pytest.mark.parametrize("raw, overrides, needle", [
    ({}, ["strategy.tau=8"], "config error: strategy.tau: used by easgd; this run's modes (allreduce) do not use it"),
    ({}, ["strategy.mode=easgd", "strategy.n_push=4"], "strategy.n_push: used by downpour; this run's modes (easgd)"),
    ({}, ["strategy.mode=downpour", "strategy.period=4"], "strategy.period: used by local_sgd, gossip; this run's "
     "modes (downpour) do not use it"),
    ({"strategy": {"phases": [{"mode": "downpour", "until": {"epochs": 1}}, {"mode": "allreduce"}], "alpha": 0.5}}, [],
     "strategy.alpha: used by easgd; this run's modes (downpour, allreduce) do not use it"),
    ({}, ["strategy.switch=adaptive", "strategy.n_fetch=2"], "strategy.n_fetch: used by downpour; this run's modes "
     "(allreduce, easgd) do not use it"),
    ({}, ["strategy.mode=easgd", "strategy.history_size=5"], "strategy.history_size: used by sandblaster"),
    ({}, ["strategy.task_rows=64"], "strategy.task_rows: used by sandblaster; this run's modes (allreduce)"),
    ({"strategy": {"phases": [{"mode": "allreduce", "period": 3}]}}, [],
     "strategy.phases.0: period: used by local_sgd, gossip; this phase's mode (allreduce) does not use it"),
])
def test_an_option_no_mode_of_the_run_uses(raw, overrides, needle):
    with pytest.raises(ConfigError) as exc:
        JobConfig.from_dict(raw, overrides)
    msg = str(exc.value)
    assert needle in msg and "\n" not in msg, msg


@pytest.mark.parametrize("raw, overrides", [
    ({}, ["strategy.mode=easgd", "strategy.tau=8", "strategy.alpha=0.2"]),
    ({"strategy": {"phases": [{"mode": "easgd", "until": {"epochs": 1}}, {"mode": "allreduce"}], "tau": 8}}, []),
    ({}, ["strategy.switch=adaptive", "strategy.tau=8"]),  # the asynchronous mode is easgd
    ({}, ["strategy.switch=adaptive", "strategy.adaptive.async_mode=downpour", "strategy.n_push=2"]),
    ({}, ["strategy.mode=gossip", "strategy.period=2"]),
    ({}, ["strategy.mode=sandblaster", "strategy.history_size=5", "strategy.task_rows=64", "checkpoint.every_steps=0",
          "checkpoint.every_s=0"]),
    ({}, ["strategy.tau=4", "strategy.alpha=null"]),  # an unused option at its default: as if not set
])
def test_options_of_the_runs_modes_and_defaults_are_accepted(raw, overrides):
    JobConfig.from_dict(raw, overrides)


def test_a_whole_dumped_config_loads_back(tmp_path):
    """config.yaml and a checkpoint's config hold every field, each mode's options at their defaults."""
    for overrides in ([], ["strategy.mode=easgd", "strategy.tau=8"], ["strategy.switch=adaptive"]):
        cfg = JobConfig.from_dict({}, overrides)
        assert JobConfig.from_dict(cfg.model_dump(mode="json")) == cfg
