"""End-to-end runs shared by several tests: each real run is made once per session and asserted
on from every angle that needs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

MAIN_EXAMPLE = os.path.join(REPO, "examples", "mnist_allreduce.yaml")


def submit(ray_head, entrypoint: list[str], timeout_s: float = 600, options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`ray job submit [options]` (waits for the job); retried while the head's job agent is still starting."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [ray_bin, "job", "submit", "--address", ray_head.dashboard_url, *options, "--"] + entrypoint
    env = dict(ray_head.env)
    env.pop("MLFLOW_TRACKING_URI", None)
    deadline = time.monotonic() + 60
    while True:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if "No available agent" not in proc.stdout + proc.stderr or time.monotonic() > deadline:
            return proc
        time.sleep(2)


@pytest.fixture(scope="session")
def main_example_job(ray_head, mlflow_server, tmp_path_factory):
    """The main example, unchanged, submitted with `ray job submit` to the session's head and
    tracked to the session's `mlflow server`, its model registered: (the finished `ray job
    submit`, its result JSON, the folder holding the JSON and the checkpoints). The job-submit
    test checks the job and what it tracked; the resume test takes it as the uncrashed reference."""
    tmp = tmp_path_factory.mktemp("main_example_job")
    out = tmp / "result.json"
    proc = submit(ray_head, [sys.executable, "-m", "orchestrator", "run", MAIN_EXAMPLE,
                             "--set", f"tracking.tracking_uri={mlflow_server}", "--set", "tracking.register_as=e2e-main",
                             "--set", f"checkpoint.storage={tmp}/ck", "--result-json", str(out)])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc, json.loads(out.read_text()), tmp


@pytest.fixture
def own_cluster(request):
    """A cluster of the test's own (`ray.cluster_utils.Cluster`): a 0-CPU head and
    `request.param` 1-CPU worker nodes (1 unless parametrized indirectly); the session's
    connection (if any) is put back after."""
    import ray
    from ray.cluster_utils import Cluster

    shared = ray.is_initialized()
    if shared:  # the session's head stays up; this process leaves it for the test and comes back
        head_address = request.getfixturevalue("ray_head").address
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(getattr(request, "param", 1)):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if shared:
            ray.init(address=head_address, logging_level="WARNING")


class InThread:
    """A call (a run's `fit`) on a daemon thread, so the test's main thread can add and remove
    nodes meanwhile (only the main thread may: Ray sets signal handlers); `result()` hands back
    its value or raises its exception."""

    def __init__(self, call) -> None:
        import threading

        self.out: dict = {}

        def run():
            try:
                self.out["value"] = call()
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                self.out["error"] = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def wait_for_file(self, pattern: str, timeout_s: float = 240) -> None:
        """Until a file matching `pattern` exists (the call still running meanwhile)."""
        import glob

        deadline = time.monotonic() + timeout_s
        while not glob.glob(pattern):
            assert self.alive() and time.monotonic() < deadline, self.out
            time.sleep(0.1)

    def result(self, timeout_s: float = 600):
        self.thread.join(timeout=timeout_s)
        assert not self.alive(), f"the call did not end within {timeout_s:g} s"
        if "error" in self.out:
            raise self.out["error"]
        return self.out["value"]
