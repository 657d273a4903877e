"""Where a run's files go under `ray job submit --working-dir` (orchestrator/persistence/job_paths.py),
without Ray: relative checkpoint and tracking paths inside a job's package directory move under
a directory that outlives the job; nothing else moves."""
import os

from orchestrator.config import JobConfig
from orchestrator.persistence.job_paths import job_package, settle_paths, stable_home


def package(tmp_path):
    pkg = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0a1b"
    (pkg / "sub").mkdir(parents=True, exist_ok=True)
    return pkg


def config(**sections):
    return JobConfig.from_dict({"model": {"factory": "examples.models:tiny_mlp"}, **sections})


def test_only_a_jobs_package_directory_is_one(tmp_path):
    pkg = package(tmp_path)
    assert job_package(str(pkg / "sub")) == str(pkg)
    assert job_package(str(tmp_path)) is None
    assert stable_home({"ORCHESTRATOR_HOME": str(tmp_path / "h")}) == str(tmp_path / "h")
    assert stable_home({}) == os.path.expanduser(os.path.join("~", "elastic-orchestrator"))


def test_inside_a_job_relative_checkpoints_and_the_default_store_move_to_the_stable_home(tmp_path):
    home = tmp_path / "home"
    cfg = config()
    said = settle_paths(cfg, cwd=str(package(tmp_path)), env={"ORCHESTRATOR_HOME": str(home)})
    assert cfg.checkpoint.storage == str(home / "runs" / "checkpoints")
    assert cfg.tracking.tracking_uri == f"sqlite:///{home}/mlflow.db"
    assert len(said) == 2 and "runs/checkpoints" in said[0] and "_ray_pkg_0a1b" in said[0] and home.is_dir()
    assert settle_paths(cfg, cwd=str(package(tmp_path)), env={"ORCHESTRATOR_HOME": str(home)}) == []  # settled once

    rel = config(tracking={"tracking_uri": "sqlite:///runs/mlflow.db"}, checkpoint={"storage": "ck"})
    settle_paths(rel, cwd=str(package(tmp_path)), env={"ORCHESTRATOR_HOME": str(home)})
    assert (rel.tracking.tracking_uri, rel.checkpoint.storage) == (f"sqlite:///{home}/runs/mlflow.db", str(home / "ck"))
    files = config(tracking={"tracking_uri": "mlruns"})
    settle_paths(files, cwd=str(package(tmp_path)), env={"ORCHESTRATOR_HOME": str(home)})
    assert files.tracking.tracking_uri == str(home / "mlruns")  # a file store stays a file store


def test_absolute_paths_uris_the_environments_store_and_runs_outside_a_job_stay_as_given(tmp_path):
    given = {"checkpoint": {"storage": str(tmp_path / "ck")}, "tracking": {"tracking_uri": "http://127.0.0.1:5000"}}
    for cwd, sections, env in ((str(package(tmp_path)), given, {}),
                               (str(package(tmp_path)), {"checkpoint": {"storage": "s3://bucket/ck"}},
                                {"MLFLOW_TRACKING_URI": "http://mlflow:5000"}),
                               (str(tmp_path), {}, {})):
        cfg = config(**sections)
        before = (cfg.checkpoint.storage, cfg.tracking.tracking_uri)
        assert settle_paths(cfg, cwd=cwd, env=env) == []
        assert (cfg.checkpoint.storage, cfg.tracking.tracking_uri) == before
