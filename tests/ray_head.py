"""A real Ray head for tests: `ray start --head --block` in its own process group, token auth
on, everything on 127.0.0.1; stopped by process-group id (never by name)."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from orchestrator.testing.local_autoscaler import free_port, wait_for_head

STOP_GRACE_S = 5.0  # SIGTERM, then this long before the process group is SIGKILLed


@dataclass
class RayHead:
    address: str  # GCS address for ray.init / RAY_ADDRESS
    dashboard_url: str  # for ray job submit
    env: dict  # environment a client needs (token auth)
    proc: subprocess.Popen
    temp_dir: str

    @classmethod
    def start(cls, num_cpus: int = 4, timeout_s: float = 90.0) -> "RayHead":
        port = free_port()
        dash = free_port(port)
        temp_dir = tempfile.mkdtemp(prefix="rt_", dir="/tmp")
        token = os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(16)
        env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_USAGE_STATS_ENABLED="0")
        env.pop("RAY_ADDRESS", None)
        ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
        cmd = [ray_bin, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
               "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--num-cpus={num_cpus}",
               f"--temp-dir={temp_dir}", "--disable-usage-stats", "--include-dashboard=true"]
        log = open(os.path.join(temp_dir, "head.log"), "w")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        head = cls(f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}", env, proc, temp_dir)
        head._wait_ready(timeout_s)
        return head

    def _wait_ready(self, timeout_s: float) -> None:
        if not wait_for_head(self.proc, self.dashboard_url, self.env["RAY_AUTH_TOKEN"], timeout_s, self.temp_dir):
            self.stop()
            raise RuntimeError(f"Ray head not ready within {timeout_s}s; see {self.temp_dir}/head.log")

    def stop(self) -> None:
        try:
            pgid = os.getpgid(self.proc.pid)
        except ProcessLookupError:
            return
        os.killpg(pgid, signal.SIGTERM)
        # the raylet and the autoscaler's monitor outlast a SIGTERM by a minute or more here and
        # `ray start --block` waits for them: what is left after a short grace is SIGKILLed, as
        # `ray stop` does after its own grace period
        try:
            self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(1.0)
        try:
            os.killpg(pgid, signal.SIGKILL)  # whatever of the group is left
        except ProcessLookupError:
            pass
