"""A local cluster run by Ray's own autoscaler: a head started with `--autoscaling-config` and the
fake multi-node provider, whose "nodes" are extra raylets on this machine that the autoscaler
launches when resources are asked for and terminates once idle. For the autoscaler example
(examples/autoscaling.py) and its end-to-end test (tests/e2e/test_autoscaler_e2e.py).

`ray.cluster_utils.AutoscalingCluster` keeps the cluster config (`_generate_config`), but two
things of it cannot be used here: its base config is read from a file Ray's wheel does not ship
(fake_multi_node/example.yaml), and its start() and shutdown() run `ray stop --force`, which
stops every Ray on the machine. This subclass writes the base config itself and starts the head
like any other of this project's test heads: `ray start --head --block` in a process group of
its own, on 127.0.0.1, free ports, a temp dir of its own, token auth; it is stopped by that
process group, and any raylet of this cluster left over is found by pid and killed.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from typing import Optional

from ray.cluster_utils import AutoscalingCluster

HEAD_NODE_TYPE = "ray.head.default"


# Ray's own default ports (GCS, dashboard, client server, the dashboard agent's HTTP): a head
# given one of them for another component refuses to start ("a port number 52365 that is used by
# other components"), and the kernel's ephemeral range holds 52365
RAY_DEFAULT_PORTS = frozenset({6379, 8265, 10001, 52365})


def free_port(*taken: int) -> int:
    """A port free on 127.0.0.1 now, none of Ray's defaults and none of `taken`."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in RAY_DEFAULT_PORTS and port not in taken:
            return port


def wait_for_head(proc: subprocess.Popen, dashboard_url: str, token: str, timeout_s: float, temp_dir: str) -> bool:
    """Wait until a head started with `ray start --head --block` answers on its dashboard (with
    the token); False after `timeout_s`, RuntimeError if `ray start` exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}; see {temp_dir}/head.log")
        try:
            req = urllib.request.Request(f"{dashboard_url}/api/version", headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return True
        except Exception:
            time.sleep(0.5)
    return False


def base_config(idle_timeout_minutes: float, max_workers: int) -> dict:
    """The fake multi-node provider's base cluster config (upstream's example.yaml)."""
    return {
        "cluster_name": "fake_multinode",
        "max_workers": max_workers,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True},
        "auth": {"ssh_user": "ubuntu"},
        "docker": {},
        "head_node_type": HEAD_NODE_TYPE,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_minutes,
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


class LocalAutoscalingCluster(AutoscalingCluster):
    """`LocalAutoscalingCluster(head_resources={"CPU": 0}, worker_node_types={...},
    idle_timeout_minutes=0.2).start()`; then `address` (for RAY_ADDRESS / ray.init), `env` (the
    token a client needs), `worker_nodes()`, and `shutdown()` (always: it is the only way the
    fake nodes go away)."""

    def __init__(self, head_resources: dict, worker_node_types: dict, idle_timeout_minutes: float = 0.2,
                 max_workers: int = 8, **config_kwargs):
        self.idle_timeout_minutes = idle_timeout_minutes
        self.max_workers = max_workers
        super().__init__(dict(head_resources), worker_node_types, autoscaler_v2=False, **config_kwargs)
        self.proc: Optional[subprocess.Popen] = None
        self.address = self.dashboard_url = self.temp_dir = ""
        self.port = 0
        self.env: dict = {}

    def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **config_kwargs):
        config = base_config(self.idle_timeout_minutes, self.max_workers)
        config["available_node_types"] = {**worker_node_types,
                                          HEAD_NODE_TYPE: {"resources": dict(head_resources), "node_config": {},
                                                           "max_workers": 0}}
        config.update(config_kwargs)
        return config

    # ---- start / stop --------------------------------------------------------------------------
    def start(self, timeout_s: float = 90.0) -> "LocalAutoscalingCluster":
        self.port = free_port()
        dash = free_port(self.port)
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard_url = f"http://127.0.0.1:{dash}"
        self.temp_dir = tempfile.mkdtemp(prefix="ras_", dir="/tmp")
        self._config["provider"]["gcs_address"] = self.address  # fake nodes join this GCS, not :6379
        config_path = os.path.join(self.temp_dir, "autoscaling.json")
        with open(config_path, "w") as f:
            json.dump(self._config, f)
        # the token of this process if it has one (Ray reads it once per process: a test session's
        # own clients then work with this cluster too), else a new one for the cluster's clients
        token = os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(16)
        bin_dir = os.path.dirname(sys.executable)
        self.env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_USAGE_STATS_ENABLED="0")
        self.env.pop("RAY_ADDRESS", None)
        # the monitor looks every second and calls the `ray` CLI; a SIGTERM stops the head at once
        # (by default it first drains for up to 30 s, for serving; nothing here to drain for)
        head_env = dict(self.env, AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_FAKE_CLUSTER="1",
                        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
                        PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
        resources = dict(self._head_resources)
        cmd = [os.path.join(bin_dir, "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
               f"--port={self.port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
               f"--num-cpus={resources.pop('CPU', 0)}", f"--temp-dir={self.temp_dir}", "--disable-usage-stats",
               "--include-dashboard=true", f"--autoscaling-config={config_path}"]
        if "GPU" in resources:
            cmd.append(f"--num-gpus={resources.pop('GPU')}")
        if resources:
            cmd.append(f"--resources={json.dumps(resources)}")
        log = open(os.path.join(self.temp_dir, "head.log"), "w")
        self.proc = subprocess.Popen(cmd, env=head_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.shutdown()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        if not wait_for_head(self.proc, self.dashboard_url, self.env["RAY_AUTH_TOKEN"], timeout_s, self.temp_dir):
            raise RuntimeError(f"autoscaling head not ready within {timeout_s}s; see {self.temp_dir}/head.log")

    def shutdown(self) -> list[int]:
        """Stop the head's process group (SIGTERM, then SIGKILL), then kill by pid any process of
        this cluster still there (a fake node's raylet or worker: a descendant of the head, or a
        command line naming this cluster's temp dir or GCS address). Returns the pids it had to
        kill after the group was gone (empty when the group took everything with it)."""
        if self.proc is None:
            return []
        tree = descendants(self.proc.pid)
        try:
            pgid = os.getpgid(self.proc.pid)
        except ProcessLookupError:
            pgid = None
        if pgid is not None:
            os.killpg(pgid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            time.sleep(1.0)
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        left = sorted(self.leftovers(tree))
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while self.leftovers(tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.proc = None
        return left

    def leftovers(self, tree: set[int] = frozenset()) -> set[int]:
        """Pids still alive that belong to this cluster."""
        marks = [m for m in (self.temp_dir, self.address) if m]
        out = set()
        for pid in all_pids():
            if pid == os.getpid():
                continue
            if pid in tree and not zombie(pid):
                out.add(pid)
                continue
            cmdline = read_proc(pid, "cmdline").replace("\0", " ")
            if any(m in cmdline for m in marks) and not zombie(pid):
                out.add(pid)
        return out

    # ---- looking ---------------------------------------------------------------------------------
    def worker_nodes(self) -> int:
        """Alive nodes other than the head (those the autoscaler launched), from the dashboard's
        state API (HTTP with the token: this process need not be a Ray client of the cluster)."""
        req = urllib.request.Request(f"{self.dashboard_url}/api/v0/nodes?limit=1000",
                                     headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            nodes = json.load(r)["data"]["result"]["result"]
        return sum(1 for n in nodes if n.get("state") == "ALIVE" and not n.get("is_head_node"))

    def autoscaler_log(self) -> list[str]:
        """The monitor's lines about launching and terminating nodes (monitor.log)."""
        path = os.path.join(self.temp_dir, "session_latest", "logs", "monitor.log")
        try:
            with open(path) as f:
                return [ln.rstrip() for ln in f if ": Launching " in ln or "StandardAutoscaler: Terminating" in ln]
        except OSError:
            return []

    def launch_times(self) -> list[float]:
        """Wall times at which the autoscaler launched a node (from monitor.log, local time)."""
        out = []
        for ln in self.autoscaler_log():
            if ": Launching " in ln:
                try:
                    out.append(datetime.strptime(ln[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp())
                except ValueError:
                    pass
        return out


def read_proc(pid: int, name: str) -> str:
    try:
        with open(f"/proc/{pid}/{name}") as f:
            return f.read()
    except OSError:
        return ""


def zombie(pid: int) -> bool:
    stat = read_proc(pid, "stat")
    return not stat or stat.rsplit(")", 1)[-1].split()[0] == "Z"


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def descendants(root: int) -> set[int]:
    """Every process under `root` (by parent pid), now."""
    children: dict[int, list[int]] = {}
    for pid in all_pids():
        stat = read_proc(pid, "stat")
        if stat:
            ppid = int(stat.rsplit(")", 1)[-1].split()[1])
            children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out
