"""benchmarks/gpu_check.py (`make gpu-check`, docs/clusters.md "GPU check"): its cpu branch, so the
script a GPU session runs in one call cannot rot between GPU sessions. It runs in a fresh process:
its "imports" row checks that nothing from ray, mlflow, pydantic or orchestrator/ was imported
(the GPU machine has none of them), which this test process could not show."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.full  # 20-50 s of training on CPU: make test-all runs it


def test_gpu_check_cpu_branch_passes_without_ray(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--steps", "20",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    for name in ("fp32", "bf16", "fp16", "pinned", "main example", "shared device", "imports"):
        assert rows[name]["status"] == "ok", rows[name]
    for name in ("fp32", "bf16", "fp16", "main example"):
        assert rows[name]["steps"] == 20 and math.isfinite(rows[name]["loss"]), rows[name]
    assert rows["slow collective"]["status"] == "skip" and rows["trainer"]["status"] == "skip"
    assert rows["fp32"]["loss"] < 0.5 * 2.3 and rows["main example"]["loss"] < 0.75 * 2.3
    assert "gloo via ProcessGroupReducer" in "; ".join(rows["fp32"]["notes"])
    shared = "; ".join(rows["shared device"]["notes"])  # two ranks' parameters equal a single process's
    assert "ProcessGroupGloo" in shared and "ranks identical: True" in shared, shared
    assert "check" in proc.stdout and "all checks passed" in proc.stdout  # the table was printed
