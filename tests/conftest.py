"""Shared fixtures. One real Ray head per session (token auth on, 127.0.0.1), one real
`mlflow server` for end-to-end tests; every test's MLflow default points at a temp dir."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import urllib.request

import secrets

import pytest

# Ray reads its auth token once per process: fix this session's token before anything imports ray.
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
os.environ.pop("RAY_ADDRESS", None)

from tests.ray_head import RayHead, free_port  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    """Soaks (marker `soak`: the short and the long ones, and the sharded node drops) run only
    when the marker expression asks for them."""
    if "soak" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="soak: run with -m soak (docs/reliability.md)")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Seconds per test file (setup, call and teardown summed), the slowest 25: where the suite's
    time goes, for keeping make test and make test-all inside their budgets."""
    per_file: dict[str, float] = {}
    outside_full = 0.0  # the share of this run make test would have run (tests not marked `full`)
    for reports in terminalreporter.stats.values():
        for report in reports:
            if hasattr(report, "duration") and hasattr(report, "nodeid") and report.nodeid:
                path = report.nodeid.split("::")[0]
                per_file[path] = per_file.get(path, 0.0) + report.duration
                if "full" not in getattr(report, "keywords", {}):
                    outside_full += report.duration
    if not per_file:
        return
    terminalreporter.write_sep("=", "seconds per test file (slowest 25)")
    for path, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")
    terminalreporter.write_line(f"{sum(per_file.values()):8.1f}s  in all; {outside_full:.1f}s in tests not marked "
                                f"`full` (make test's share, its session start-ups aside)")


@pytest.fixture(scope="session")
def _mlflow_schema(tmp_path_factory):
    """One sqlite MLflow store created by MLflow itself, its tables made: each Ray and end-to-end
    test's store at `<tmp_path>/mlflow.db` starts as a copy of it (MLflow creating the tables of
    a new store takes ~1.5-2 s; a copy, milliseconds)."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-schema") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture(autouse=True)
def _mlflow_in_tmp(request, tmp_path, monkeypatch):
    """No test writes MLflow data into the repo: the default store is a temp sqlite file. In a
    Ray or end-to-end test (unless marked `empty_tmp`: it checks that nothing was written) that
    file is there already, a new store with MLflow's tables made (`_mlflow_schema`)."""
    keywords = request.node.keywords
    if ("ray" in keywords or "e2e" in keywords) and "empty_tmp" not in keywords:
        import shutil

        shutil.copy(request.getfixturevalue("_mlflow_schema"), tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")


@pytest.fixture(scope="session")
def ray_head():
    head = RayHead.start(num_cpus=4)
    yield head
    head.stop()


@pytest.fixture(scope="session")
def ray_cluster(ray_head):
    """This process connected to the session's Ray head (shared by all Ray tests)."""
    import ray

    ray.init(address=ray_head.address, logging_level="WARNING")
    yield ray_head
    ray.shutdown()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 with a sqlite store and a local artifact root."""
    root = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    log = open(root / "server.log", "w")
    cmd = [os.path.join(os.path.dirname(sys.executable), "mlflow"), "server", "--host", "127.0.0.1",
           "--port", str(port), "--workers", "1", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
           "--artifacts-destination", str(root / "artifacts")]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited; see {root}/server.log")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except Exception:
            time.sleep(0.5)
    else:
        raise RuntimeError(f"mlflow server not up in 90s; see {root}/server.log")
    yield url
    os.killpg(os.getpgid(proc.pid), 15)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(os.getpgid(proc.pid), 9)


def job_config(**sections):
    """A small, fast job (synthetic blobs, tiny MLP) with per-section overrides."""
    from orchestrator.config import JobConfig

    raw = {
        "model": {"factory": "examples.models:tiny_mlp"},
        "data": {"source": "builtin:synthetic", "batch_size": 32},
        "optimizer": {"lr": 0.05},
        "scaling": {"replicas": 2, "cpus_per_replica": 1},
        "stop": {"epochs": 2},
        "strategy": {"timeout_s": 30},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return JobConfig.from_dict(raw)


def assert_carried(event: dict, *steps: str) -> None:
    """The reconfiguration event came through the one carrier (orchestrator/control/reconfig/carrier.py):
    timed steps are the carrier's, in its order, and include `steps`."""
    from orchestrator.control.reconfig.carrier import STEPS

    parts = list(event["reconfigure_parts_s"])
    assert parts == [s for s in STEPS if s in parts], parts
    assert set(steps) <= set(parts), (steps, parts)
    assert event["reconfigure_s"] >= sum(event["reconfigure_parts_s"].values()) - 0.01


class StopAfter:
    """A reporting callback that ends the run `epochs` epochs after the epoch of its first
    `kind` event: a test that waits for something a loaded host takes long to do (a new replica's
    process start and join) sets a generous stop.epochs and runs only as long as it needs."""

    def __init__(self, trainer, kind: str, epochs: int) -> None:
        self.trainer, self.kind, self.epochs, self.fired = trainer, kind, epochs, False

    def on_event(self, event: dict) -> None:
        if self.fired or event["kind"] != self.kind:
            return
        self.fired = True
        ctl = self.trainer.controller
        ctl.stop_policy = dataclasses.replace(ctl.stop_policy, epochs=int(event["epoch"]) + self.epochs)
