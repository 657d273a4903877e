"""Bad input through the CLI: one line naming the field or file, exit code 2, nothing started."""
import os
import subprocess
import sys

import pytest
import yaml

from orchestrator.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOOD = {"model": {"factory": "examples.models:tiny_mlp"}, "data": {"source": "builtin:synthetic"}}


def write(tmp_path, raw):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.parametrize("raw, overrides, needle", [
    (GOOD, ["optimzer.lr=0.1"], "unknown key optimzer"),
    (GOOD, ["optimizer.lr=fast"], "optimizer.lr"),
    (GOOD, ["optimizer.lr=0"], "optimizer.lr"),
    (GOOD, ["scaling.replicas=0"], "scaling.replicas"),
    (GOOD, ["data.batch_size=-3"], "data.batch_size"),
    (GOOD, ["model.factory=no_such_module:f"], "model.factory: cannot import 'no_such_module'"),
    (GOOD, ["model.factory=examples.models:nothing"], "has no function 'nothing'"),
    (GOOD, ["model.factory=tests.factories:not_a_module"], "returned int, not a torch.nn.Module"),
    (GOOD, ["model.factory=tests.factories:raises"], "failed (RuntimeError: boom)"),
    (GOOD, ["model.factory=examples.models:mnist_cnn"], "does not accept builtin:synthetic inputs"),
    (GOOD, ["data.batch_size=100000"], "data.batch_size"),
    (GOOD, ["bogus"], "section.key=value"),
])
def test_bad_input_exit_2_one_line(tmp_path, capsys, monkeypatch, raw, overrides, needle):
    monkeypatch.chdir(tmp_path)
    argv = ["run", write(tmp_path, raw)] + [a for o in overrides for a in ("--set", o)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert os.listdir(tmp_path) == ["job.yaml"]  # nothing written: no MLflow store, no checkpoint


def test_missing_config_file(tmp_path, capsys):
    assert main(["run", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_subprocess_exit_code_and_no_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "run", write(tmp_path, GOOD), "--set",
                           "optimizer.lr=-1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "optimizer.lr" in proc.stderr and "Traceback" not in proc.stderr
