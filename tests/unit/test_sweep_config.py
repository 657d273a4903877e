"""Sweep files: checked before Ray starts (one line naming the key, exit code 2), and the pieces of
a sweep that need no cluster (trial resources, the comparison table, the plot)."""
import os

import pytest
import yaml

from orchestrator.cli.main import main
from orchestrator.errors import ConfigError
from orchestrator.sweep import comparison_csv, comparison_markdown, load_sweep, plot_metric, trial_resources

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = os.path.join(REPO, "examples", "mnist_allreduce.yaml")
GOOD = {"base": BASE, "search": {"strategy.mode": {"grid": ["allreduce", "easgd"]},
                                 "optimizer.lr": {"loguniform": [0.01, 0.1]}},
        "num_samples": 2, "metric": "test_accuracy", "goal": "max", "max_concurrent_trials": 2}


def write(tmp_path, raw, name="sweep.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def with_(**changes):
    raw = {**GOOD, **changes}
    return {k: v for k, v in raw.items() if v is not None}


def test_the_example_sweep_file_is_valid(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # its base, examples/mnist_allreduce.yaml, is found from the sweep file's parent
    plan = load_sweep(os.path.join(REPO, "examples", "mnist_sweep.yaml"))
    assert plan.trials == 4 and plan.sweep.scheduler == "asha"
    assert plan.base_path == BASE


def test_a_good_sweep_counts_its_trials_and_takes_fixed_overrides(tmp_path):
    plan = load_sweep(write(tmp_path, with_(set={"stop.epochs": 2, "model.kwargs.hidden": 8}, num_samples=3)),
                      ["scaling.replicas=3"])
    assert plan.trials == 6
    assert plan.base_raw["stop"]["epochs"] == 2 and plan.base_raw["scaling"]["replicas"] == 3
    assert plan.sweep.goal == "max"


def test_goal_defaults_to_the_metrics_direction(tmp_path):
    plan = load_sweep(write(tmp_path, with_(metric="test_loss", goal=None)))
    assert plan.sweep.goal == "min"


@pytest.mark.parametrize("changes, needle", [
    ({"search": {"strategy.mod": {"grid": ["allreduce"]}}}, "search.strategy.mod: not a config key"),
    ({"search": {"optimzer.lr": {"grid": [0.1]}}}, "search.optimzer.lr: not a config key"),
    ({"search": {"optimizer.lr.x": {"grid": [0.1]}}}, "optimizer.lr is a value"),
    ({"set": {"stop.epoch": 2}}, "set.stop.epoch: not a config key"),
    ({"search": {}}, "search"),
    ({"search": {"optimizer.lr": {"grid": []}}}, "search.optimizer.lr.grid"),
    ({"search": {"optimizer.lr": {"loguniform": [0.1, 0.01]}}}, "low < high"),
    ({"search": {"optimizer.lr": {"loguniform": [0, 0.1]}}}, "loguniform needs 0 < low"),
    ({"search": {"optimizer.lr": {"uniform": [0.1]}}}, "uniform needs [low, high]"),
    ({"search": {"optimizer.lr": {"grid": [0.1], "choice": [0.2]}}}, "exactly one of grid, choice"),
    ({"search": {"optimizer.lr": {"range": [0.1, 0.2]}}}, "unknown key search.optimizer.lr.range"),
    ({"search": {"optimizer.lr": {"uniform": [0.01, "fast"]}}}, "search.optimizer.lr.uniform.1"),
    ({"search": {"strategy.mode": {"grid": ["allreduce", "ring"]}}}, "with strategy.mode='ring': strategy.mode"),
    ({"search": {"optimizer.lr": {"uniform": [-0.1, 0.1]}}}, "with optimizer.lr=-0.1: optimizer.lr"),
    ({"search": {"optimizer.momentum": {"uniform": [0.5, 1.5]}}}, "optimizer.momentum"),
    ({"search": {"scaling.replicas": {"uniform": [1, 4]}}}, "with scaling.replicas=2.5: scaling.replicas"),
    ({"search": {"strategy.mode": {"grid": ["allreduce", "downpour"]}, "optimizer.name": {"choice": ["sgd", "adafactor"]}}},
     "adafactor keeps factored"),
    ({"metric": "accuracy"}, "metric"),
    ({"goal": "up"}, "goal"),
    ({"goal": "min"}, "goal min for test_accuracy would rank the worst trial best"),
    ({"num_samples": 0}, "num_samples"),
    ({"max_concurrent_trials": 0}, "max_concurrent_trials"),
    ({"scheduler": "hyperband"}, "scheduler"),
    ({"asha": {"reduction_factor": 1}}, "asha.reduction_factor"),
    ({"base": "no/such/base.yaml"}, "base: config file not found: no/such/base.yaml"),
    ({"trials": 4}, "unknown key trials"),
    ({"set": {"scaling.max_replicas": 4}}, "scaling.max_replicas: a trial's placement group holds"),
    ({"set": {"checkpoint.in_memory": True}}, "sweep error: checkpoint.in_memory: a trial is not started again"),
])
def test_bad_sweep_input_is_one_line_naming_the_key(tmp_path, changes, needle):
    with pytest.raises(ConfigError) as exc:
        load_sweep(write(tmp_path, with_(**changes)))
    msg = str(exc.value)
    assert needle in msg and "\n" not in msg, msg


def test_a_bad_base_config_names_its_field(tmp_path):
    base = write(tmp_path, {"optimizer": {"lr": 0}}, "base.yaml")
    with pytest.raises(ConfigError, match="optimizer.lr"):
        load_sweep(write(tmp_path, with_(base=base)))


def test_base_is_found_next_to_the_sweep_file(tmp_path, monkeypatch):
    write(tmp_path, {"stop": {"epochs": 1}}, "base.yaml")
    path = write(tmp_path, with_(base="base.yaml"))
    monkeypatch.chdir(REPO)
    assert load_sweep(path).base_raw["stop"]["epochs"] == 1


@pytest.mark.parametrize("changes, overrides, needle", [
    ({"search": {"strategy.modes": {"grid": ["easgd"]}}}, [], "search.strategy.modes: not a config key"),
    ({"search": {"optimizer.lr": {"loguniform": [0.1, 0.01]}}}, [], "low < high"),
    ({"metric": "acc"}, [], "metric"),
    ({"base": "missing.yaml"}, [], "base: config file not found"),
    ({}, ["optimizer.lr=0"], "optimizer.lr"),
])
def test_cli_bad_sweep_exit_2_before_ray(tmp_path, capsys, monkeypatch, changes, overrides, needle):
    import ray

    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, with_(**changes))
    connected = ray.is_initialized()  # the whole suite's Ray tests connect this process before these run
    assert main(["sweep", path] + [a for o in overrides for a in ("--set", o)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert ray.is_initialized() == connected  # the sweep did not start or join Ray
    assert os.listdir(tmp_path) == ["sweep.yaml"]  # nothing written


def test_cli_missing_sweep_file(tmp_path, capsys):
    assert main(["sweep", str(tmp_path / "missing.yaml")]) == 2
    assert "sweep file not found" in capsys.readouterr().err


def test_trial_resources_one_bundle_per_replica():
    from orchestrator.config import JobConfig

    cfg = JobConfig.from_dict({"scaling": {"replicas": 3, "cpus_per_replica": 1.5}})
    pgf = trial_resources(cfg, 0.0)
    assert pgf.head_bundle_is_empty and pgf.bundles == [{"CPU": 1.5}] * 3  # the driver reserves nothing
    assert pgf.required_resources == {"CPU": 4.5}
    with_driver = trial_resources(cfg, 0.5)
    assert with_driver.bundles == [{"CPU": 0.5}] + [{"CPU": 1.5}] * 3


def test_comparison_table_and_plot(tmp_path):
    rows = [{"trial": "a", "status": "finished", "mode": "allreduce", "params": {"optimizer.lr": 0.0312345},
             "metric": 0.95, "time_to_target_s": 12.5, "final": {"test_accuracy": 0.95, "test_loss": 0.2},
             "samples_per_s": 800.0, "epochs": 2,
             "run_id": "r1"},
            {"trial": "b", "status": "stopped_early", "mode": "easgd", "params": {"optimizer.lr": 0.09},
             "metric": 0.5, "time_to_target_s": None, "final": {"test_accuracy": 0.5}, "samples_per_s": None,
             "epochs": 1,
             "run_id": "r2"}]
    csv = comparison_csv(rows).splitlines()
    assert csv[0] == "trial,status,mode,params,metric,time_to_target_s,final,samples_per_s,epochs,run_id"
    assert csv[1] == "a,finished,allreduce,optimizer.lr=0.03123,0.95,12.5,test_accuracy=0.95 test_loss=0.2,800,2,r1"
    assert csv[2] == "b,stopped_early,easgd,optimizer.lr=0.09,0.5,,test_accuracy=0.5,,1,r2"
    md = comparison_markdown(rows, "test_accuracy")
    assert "| a | finished | allreduce |" in md
    path = tmp_path / "plot.png"
    plot_metric({"a": ([3.0, 6.0], [0.9, 0.95], rows[0]["params"]), "b": ([4.0], [0.5], rows[1]["params"])},
                str(path), "test_accuracy")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("uri, expected", [
    ("sqlite:///mlflow.db", "sqlite:///{cwd}/mlflow.db"),
    ("sqlite:////abs/mlflow.db", "sqlite:////abs/mlflow.db"),
    ("file:./mlruns", "file://{cwd}/mlruns"),
    ("./mlruns", "{cwd}/mlruns"),
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
])
def test_trials_get_the_drivers_tracking_store_as_an_absolute_uri(tmp_path, monkeypatch, uri, expected):
    """Tune runs each trial in its own working directory: a relative store would be another store."""
    from orchestrator.sweep import absolute_uri as _absolute_uri

    monkeypatch.chdir(tmp_path)
    assert _absolute_uri(uri) == expected.format(cwd=os.getcwd())


def test_a_model_that_does_not_fit_the_data_is_bad_input_before_ray(tmp_path, capsys, monkeypatch):
    """What a trial's fit() would reject (here a factory searched over) is found by the driver first."""
    import ray

    monkeypatch.chdir(tmp_path)
    base = write(tmp_path, {"data": {"source": "builtin:synthetic"}, "model": {"factory": "examples.models:tiny_mlp"},
                            "checkpoint": {"storage": str(tmp_path / "ck")}}, "base.yaml")
    path = write(tmp_path, with_(base=base, search={
        "model.factory": {"grid": ["examples.models:tiny_mlp", "examples.models:mnist_cnn"]}}))
    connected = ray.is_initialized()
    assert main(["sweep", path]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.factory: examples.models:mnist_cnn does not accept builtin:synthetic" in err, err
    assert ray.is_initialized() == connected


@pytest.mark.parametrize("stop, event, last", [
    ({"epochs": 3}, {"epoch": 2, "test_accuracy": 0.99}, False),
    ({"epochs": 3}, {"epoch": 3, "test_accuracy": 0.5}, True),
    ({"epochs": 9, "target_accuracy": 0.9}, {"epoch": 2, "test_accuracy": 0.91}, True),
    ({"epochs": 9, "target_accuracy": 0.9}, {"epoch": 2, "test_accuracy": 0.89}, False),
    ({"epochs": 9, "target_accuracy": 0.9, "at_target": False}, {"epoch": 2, "test_accuracy": 0.95}, False),
])
def test_a_trials_last_epoch_is_known_so_it_is_reported_after_the_run_finished(stop, event, last):
    """The last epoch goes to Tune after fit() returns: a scheduler's stop then cannot cut off a run
    that has done its training (no final checkpoint, no result.json, marked KILLED)."""
    from orchestrator.config import JobConfig
    from orchestrator.sweep import ends_the_run

    assert ends_the_run(JobConfig.from_dict({"stop": stop}), {"kind": "epoch_end", **event}) is last


def test_duplicate_key_in_a_sweep_file_names_both_lines(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {BASE}\nsearch:\n  optimizer.lr: {{grid: [0.1]}}\n  optimizer.lr: {{grid: [0.2]}}\n")
    with pytest.raises(ConfigError) as exc:
        load_sweep(path)
    assert str(exc.value) == f"sweep error: {path}:4: duplicate key 'optimizer.lr' (first at line 3)"


def test_duplicate_key_in_the_base_config_names_both_lines(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("stop:\n  epochs: 1\nstop:\n  epochs: 2\n")
    with pytest.raises(ConfigError) as exc:
        load_sweep(write(tmp_path, with_(base=str(base))))
    assert str(exc.value) == f"config error: {base}:3: duplicate key 'stop' (first at line 1)"
