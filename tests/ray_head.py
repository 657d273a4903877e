"""A real Ray head for tests: `ray start --head --block` in its own process group, token auth
on, everything on 127.0.0.1; stopped by process-group id (never by name)."""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RayHead:
    address: str  # GCS address for ray.init / RAY_ADDRESS
    dashboard_url: str  # for ray job submit
    env: dict  # environment a client needs (token auth)
    proc: subprocess.Popen
    temp_dir: str

    @classmethod
    def start(cls, num_cpus: int = 4, timeout_s: float = 90.0) -> "RayHead":
        port, dash = free_port(), free_port()
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
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}; see {self.temp_dir}/head.log")
            try:
                req = urllib.request.Request(f"{self.dashboard_url}/api/version",
                                             headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"})
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"Ray head not ready within {timeout_s}s; see {self.temp_dir}/head.log")

    def stop(self) -> None:
        try:
            pgid = os.getpgid(self.proc.pid)
        except ProcessLookupError:
            return
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(1.0)
        try:
            os.killpg(pgid, signal.SIGKILL)  # whatever of the group is left
        except ProcessLookupError:
            pass
