"""examples/cluster: the Ray cluster-launcher YAML passes Ray's own config schema (offline: defaults
filled from the installed Ray's aws/defaults.yaml, no cloud call), keeps token authentication on,
declares every node type's resources and installs the CPU build of torch before the project on
CPU nodes; the KubeRay RayJob's entrypoint names a config in this repository whose `--set`
overrides load. Each check is also shown failing on a broken copy."""
from __future__ import annotations

import copy
import os
import re
import shlex
import socket

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from orchestrator.config import JobConfig
from orchestrator.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = os.path.join(REPO, "examples", "cluster", "aws.yaml")
RAYJOB = os.path.join(REPO, "examples", "cluster", "rayjob.yaml")
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def _load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _torch_pin() -> str:
    """The Makefile's CPU torch pin (TORCH_PIN ?= torch==X), the one the cluster nodes must match."""
    with open(os.path.join(REPO, "Makefile"), encoding="utf-8") as f:
        return re.search(r"^TORCH_PIN \?= (\S+)$", f.read(), re.M).group(1)


@pytest.fixture
def offline(monkeypatch):
    """Any attempt to open a network connection fails the test (the checks must not call a cloud)."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def _schema() -> dict:
    """Ray's cluster-config schema, from the installed Ray (the one validate_config uses)."""
    import json

    import ray.autoscaler

    with open(os.path.join(os.path.dirname(ray.autoscaler.__file__), "ray-schema.json"), encoding="utf-8") as f:
        return json.load(f)


def check_launcher(raw: dict) -> dict:
    """What `ray up` checks before it talks to the cloud: the raw file against Ray's JSON schema,
    then, with the provider's defaults merged (prepare_config reads ray/autoscaler/aws/defaults.yaml,
    boto3 is not imported), Ray's validate_config. Returns the prepared config."""
    jsonschema.validate(raw, _schema())  # the file as written
    prepared = prepare_config(copy.deepcopy(raw))
    validate_config(prepared)
    return prepared


# ---- the cluster launcher ------------------------------------------------------------------------


def test_launcher_passes_rays_schema_offline(offline):
    raw = _load(LAUNCHER)
    assert raw["provider"]["type"] == "aws"
    prepared = check_launcher(raw)
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("breakage, error", [
    (lambda c: c["available_node_types"]["cpu_worker"].pop("resources"), jsonschema.ValidationError),
    (lambda c: c["available_node_types"]["cpu_worker"]["resources"].update(CPU="eight"), jsonschema.ValidationError),
    (lambda c: c["available_node_types"]["gpu_worker"].update(max_worker=2), jsonschema.ValidationError),
    (lambda c: c.update(head_start_ray_commands="ray start --head"), jsonschema.ValidationError),
    (lambda c: c.update(head_node_type="no_such_type"), ValueError),
    (lambda c: c["available_node_types"]["cpu_worker"].update(min_workers=20), ValueError),
])
def test_a_broken_launcher_fails_the_schema_check(offline, breakage, error):
    raw = _load(LAUNCHER)
    breakage(raw)
    with pytest.raises(error):
        check_launcher(raw)


def test_a_broken_launcher_file_fails_the_schema_check(offline, tmp_path):
    """The same check on a file: a deliberately broken copy of aws.yaml (a typo in a node type key)."""
    with open(LAUNCHER, encoding="utf-8") as f:
        text = f.read()
    assert "    min_workers: 0\n" in text
    broken = tmp_path / "aws.yaml"
    broken.write_text(text.replace("    min_workers: 0\n", "    min_worker: 0\n", 1))
    with pytest.raises(jsonschema.ValidationError, match="min_worker"):
        check_launcher(_load(str(broken)))


def _ray_starts(commands: list[str]) -> list[str]:
    return [c for c in commands if re.search(r"\bray start\b", c)]


def auth_problems(raw: dict) -> list[str]:
    """Why the launcher would start Ray without token authentication (empty: it would not)."""
    problems = []
    text = yaml.safe_dump(raw)
    if re.search(r"RAY_AUTH_MODE\s*[=:]\s*['\"]?disabled", text, re.I):
        problems.append("RAY_AUTH_MODE=disabled somewhere")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = _ray_starts(raw.get(key, []))
        if not starts:
            problems.append(f"{key}: no `ray start`")
        problems += [f"{key}: `{c}` does not set RAY_AUTH_MODE=token" for c in starts
                     if not re.search(r"\bRAY_AUTH_MODE=token\s+ray start\b", c)]
    if "~/.ray/auth_token" not in raw.get("file_mounts", {}):
        problems.append("the token file is not copied to the nodes (file_mounts ~/.ray/auth_token)")
    for c in _ray_starts(raw.get("head_start_ray_commands", [])):
        if re.search(r"--dashboard-host[= ](0\.0\.0\.0|::)", c):
            problems.append("the dashboard is bound to every interface")
    return problems


def test_launcher_starts_ray_with_token_auth_on():
    raw = _load(LAUNCHER)
    assert auth_problems(raw) == []
    head = _ray_starts(raw["head_start_ray_commands"])
    assert len(head) == 1 and "--head" in head[0] and "--autoscaling-config=~/ray_bootstrap_config.yaml" in head[0]
    worker = _ray_starts(raw["worker_start_ray_commands"])
    assert len(worker) == 1 and "--address=$RAY_HEAD_IP:6379" in worker[0]


@pytest.mark.parametrize("breakage, problem", [
    (lambda c: c["head_start_ray_commands"].__setitem__(
        1, c["head_start_ray_commands"][1].replace("RAY_AUTH_MODE=token", "RAY_AUTH_MODE=disabled")), "disabled"),
    (lambda c: c["worker_start_ray_commands"].__setitem__(
        1, c["worker_start_ray_commands"][1].replace("RAY_AUTH_MODE=token ", "")), "does not set"),
    (lambda c: c["docker"]["run_options"].append("--env RAY_AUTH_MODE=disabled"), "disabled"),
    (lambda c: c["file_mounts"].pop("~/.ray/auth_token"), "token file"),
    (lambda c: c["head_start_ray_commands"].__setitem__(
        1, c["head_start_ray_commands"][1].replace("--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0")),
     "every interface"),
])
def test_auth_check_catches_a_launcher_without_auth(breakage, problem):
    raw = _load(LAUNCHER)
    breakage(raw)
    assert any(problem in p for p in auth_problems(raw))


def resource_problems(prepared: dict) -> list[str]:
    """Node types whose resources are not declared, or that do not autoscale from zero."""
    problems = []
    for name, node in prepared["available_node_types"].items():
        resources = node.get("resources") or {}
        if resources.get("CPU", 0) <= 0:
            problems.append(f"{name}: no CPU declared")
        if name == prepared["head_node_type"]:
            continue
        if node.get("min_workers", 0) != 0 or node.get("max_workers", 0) <= 0:
            problems.append(f"{name}: not 0..max_workers ({node.get('min_workers')}..{node.get('max_workers')})")
        if "gpu" in name and resources.get("GPU", 0) <= 0:
            problems.append(f"{name}: no GPU declared")
    return problems


def test_every_node_type_declares_its_resources_and_workers_autoscale_from_zero(offline):
    prepared = check_launcher(_load(LAUNCHER))
    assert resource_problems(prepared) == []
    workers = {k: v for k, v in prepared["available_node_types"].items() if k != prepared["head_node_type"]}
    assert any(v["resources"].get("GPU", 0) > 0 for v in workers.values())
    assert any(v["resources"].get("GPU", 0) == 0 for v in workers.values())
    assert sum(v["max_workers"] for v in workers.values()) <= prepared["max_workers"]


def test_resource_check_catches_an_undeclared_type(offline):
    raw = _load(LAUNCHER)
    raw["available_node_types"]["gpu_worker"]["resources"] = {"CPU": 4}
    raw["available_node_types"]["cpu_worker"]["min_workers"] = 1
    problems = resource_problems(check_launcher(raw))
    assert any("gpu_worker: no GPU" in p for p in problems)
    assert any("cpu_worker: not 0..max_workers" in p for p in problems)


def setup_problems(prepared: dict) -> list[str]:
    """Each node type's setup (as the launcher runs it: a type's own worker_setup_commands replace
    the global ones) installs torch at the Makefile's pin before the project: the CPU build on
    CPU types, the CUDA build (no CPU index) on GPU types."""
    pin = _torch_pin()
    problems = []
    for name, node in prepared["available_node_types"].items():
        if name == prepared["head_node_type"]:
            commands = prepared["head_setup_commands"]
        else:
            commands = node.get("worker_setup_commands", prepared["worker_setup_commands"])
        gpu = node["resources"].get("GPU", 0) > 0
        torch_at = [i for i, c in enumerate(commands) if pin in c]
        project_at = [i for i, c in enumerate(commands) if re.search(r"pip install \S*elastic-orchestrator", c)]
        if not torch_at or not project_at or torch_at[0] > project_at[0]:
            problems.append(f"{name}: {pin} is not installed before the project")
            continue
        if gpu == (CPU_TORCH_INDEX in commands[torch_at[0]]):
            problems.append(f"{name}: {'the CPU' if not gpu else 'a CUDA'} build of torch is not installed")
    return problems


def test_nodes_install_the_pinned_torch_before_the_project(offline):
    assert setup_problems(check_launcher(_load(LAUNCHER))) == []


def test_setup_check_catches_a_project_installed_before_torch(offline):
    raw = _load(LAUNCHER)
    raw["worker_setup_commands"].reverse()
    raw["available_node_types"]["gpu_worker"]["worker_setup_commands"][0] += f" --index-url {CPU_TORCH_INDEX}"
    problems = setup_problems(check_launcher(raw))
    assert any(p.startswith("cpu_worker:") and "before the project" in p for p in problems)
    assert any(p.startswith("gpu_worker:") and "CUDA" in p for p in problems)


# ---- the KubeRay RayJob ---------------------------------------------------------------------------


def entrypoint_config(entrypoint: str, repo: str = REPO) -> JobConfig:
    """The job the entrypoint would run: `python -m orchestrator run CONFIG [--set k=v ...]`, the
    config resolved in the repository (the job's working_dir) and loaded with its overrides;
    ConfigError for a missing file or a bad override, ValueError for another command."""
    argv = shlex.split(entrypoint)
    if argv[:4] != ["python", "-m", "orchestrator", "run"] or len(argv) < 5:
        raise ValueError(f"not `python -m orchestrator run CONFIG ...`: {entrypoint!r}")
    config, rest, overrides = argv[4], argv[5:], []
    while rest:
        flag = rest.pop(0)
        if flag == "--set" and rest:
            overrides.append(rest.pop(0))
        elif flag.startswith("--set="):
            overrides.append(flag[len("--set="):])
        else:
            raise ValueError(f"unexpected argument {flag!r} in the entrypoint")
    return JobConfig.from_yaml(os.path.join(repo, config), overrides)


def test_rayjob_runs_the_main_example_on_an_autoscaling_cluster():
    job = _load(RAYJOB)
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["authOptions"]["mode"] == "token"
    assert cluster["rayVersion"].startswith("2.60")
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert head and all(c["resources"]["limits"] for c in head)
    groups = cluster["workerGroupSpecs"]
    assert groups
    for group in groups:
        assert 0 == group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"] and group["maxReplicas"] > 0
        assert all(c["resources"]["limits"]["cpu"] for c in group["template"]["spec"]["containers"])
    env = yaml.safe_load(spec.get("runtimeEnvYAML") or "{}") or {}

    cfg = entrypoint_config(spec["entrypoint"])
    assert "examples/mnist_allreduce.yaml" in spec["entrypoint"]
    uri = cfg.tracking.tracking_uri or env.get("env_vars", {}).get("MLFLOW_TRACKING_URI")
    assert uri == "http://mlflow:5000"
    assert cfg.scaling.max_replicas is not None and cfg.scaling.max_replicas > cfg.scaling.replicas
    head_cpus = float(cluster["headGroupSpec"]["rayStartParams"]["num-cpus"])
    assert cfg.scaling.replicas * cfg.scaling.cpus_per_replica <= head_cpus  # starts before any worker exists


@pytest.mark.parametrize("entrypoint, error", [
    ("python -m orchestrator run examples/no_such.yaml --set tracking.tracking_uri=http://mlflow:5000",
     ConfigError),
    ("python -m orchestrator run examples/mnist_allreduce.yaml --set tracking.tracking_url=http://mlflow:5000",
     ConfigError),
    ("python -m orchestrator run examples/mnist_allreduce.yaml --set scaling.max_replicas=1", ConfigError),
    ("python -m orchestrator sweep examples/mnist_sweep.yaml", ValueError),
])
def test_entrypoint_check_catches_a_bad_entrypoint(entrypoint, error):
    with pytest.raises(error):
        entrypoint_config(entrypoint)
