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


# ---- input that used to be found late (after actors started, or after training) ------------

def run_cli(tmp_path, capsys, monkeypatch, raw, overrides):
    """main() in tmp_path; (exit code, stderr); asserts nothing was written next to job.yaml."""
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    argv = ["run", write(tmp_path, raw)] + [a for o in overrides for a in ("--set", o)]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert sorted(os.listdir(tmp_path)) == sorted(set(before) | {"job.yaml"}), "something was written"
    return code, err


def assert_one_line(code, err, needle):
    assert code == 2, err
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def closed_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("storage", ["nosuch://x", "/proc/self/checkpoints", "FILE/under-a-file"])
def test_checkpoint_storage_unknown_scheme_or_unwritable(tmp_path, capsys, monkeypatch, storage):
    (tmp_path / "a-file").write_text("not a directory")
    storage = storage.replace("FILE", str(tmp_path / "a-file"))
    code, err = run_cli(tmp_path, capsys, monkeypatch, GOOD, [f"checkpoint.storage={storage}"])
    assert_one_line(code, err, "checkpoint.storage")


def test_checkpoint_storage_under_a_read_only_directory(tmp_path, capsys, monkeypatch):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        code, err = run_cli(tmp_path, capsys, monkeypatch, GOOD, [f"checkpoint.storage={ro}/ck"])
    finally:
        ro.chmod(0o755)
    assert_one_line(code, err, f"checkpoint.storage: cannot write checkpoints to {ro}/ck")


def test_unreachable_tracking_server_is_found_within_seconds(tmp_path, capsys, monkeypatch):
    import time

    t = time.monotonic()
    code, err = run_cli(tmp_path, capsys, monkeypatch, GOOD,
                        [f"tracking.tracking_uri=http://127.0.0.1:{closed_port()}"])
    assert_one_line(code, err, "tracking.tracking_uri: no MLflow server answers")
    assert time.monotonic() - t < 30


def test_silent_tracking_server_times_out(tmp_path, capsys, monkeypatch):
    """A port that accepts connections but never answers: the check gives up after a few seconds."""
    import socket
    import time

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        t = time.monotonic()
        code, err = run_cli(tmp_path, capsys, monkeypatch, GOOD, [f"tracking.tracking_uri=http://127.0.0.1:{port}"])
    assert_one_line(code, err, "no answer within 3s")
    assert time.monotonic() - t < 30


@pytest.mark.parametrize("uri", ["sqlite:////proc/self/mlruns/mlflow.db", "FILE/mlruns"])
def test_tracking_store_that_cannot_be_written(tmp_path, capsys, monkeypatch, uri):
    (tmp_path / "a-file").write_text("not a directory")
    uri = uri.replace("FILE", str(tmp_path / "a-file"))
    code, err = run_cli(tmp_path, capsys, monkeypatch, GOOD, [f"tracking.tracking_uri={uri}"])
    assert_one_line(code, err, "tracking.tracking_uri: cannot write the MLflow store")


@pytest.mark.parametrize("mode", ["downpour", "easgd"])
def test_more_shards_than_parameters(tmp_path, capsys, monkeypatch, mode):
    code, err = run_cli(tmp_path, capsys, monkeypatch, GOOD, [f"strategy.mode={mode}", "scaling.shards=100000"])
    assert_one_line(code, err, "scaling.shards: 100000 shards for the")


def test_test_source_with_other_feature_width(tmp_path, capsys, monkeypatch):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)

    def table(n, dim):
        cols = {"label": rng.integers(0, 3, n)}
        cols.update({f"f{i}": rng.normal(size=n).astype(np.float32) for i in range(dim)})
        return pa.table(cols)

    pq.write_table(table(200, 4), tmp_path / "train.parquet")
    pq.write_table(table(50, 5), tmp_path / "test.parquet")
    raw = {"model": {"factory": "examples.models:tiny_mlp", "kwargs": {"in_features": 4, "num_classes": 3}},
           "data": {"source": str(tmp_path / "train.parquet"), "test_source": str(tmp_path / "test.parquet")}}
    code, err = run_cli(tmp_path, capsys, monkeypatch, raw, [])
    assert_one_line(code, err, "data.test_source:")
    assert "[5]" in err and "[4]" in err


def test_slow_replica_rank_that_does_not_exist(tmp_path, capsys, monkeypatch):
    code, err = run_cli(tmp_path, capsys, monkeypatch, GOOD, ["scaling.replicas=2", "faults.slow_replicas={2: 0.1}"])
    assert_one_line(code, err, "faults.slow_replicas: no replica of rank 2")


@pytest.mark.parametrize("source", ["file:///no/such/dir", "s3://bucket/data?region=us-east-1&scheme=http&endpoint_override=127.0.0.1:PORT"])
def test_remote_source_that_cannot_be_listed(tmp_path, capsys, monkeypatch, source):
    code, err = run_cli(tmp_path, capsys, monkeypatch, GOOD, [f"data.source={source.replace('PORT', str(closed_port()))}"])
    assert_one_line(code, err, "data.source: ")
    assert ("no such file or directory" if source.startswith("file") else "cannot list s3://bucket/data") in err


def test_config_file_that_is_not_utf8(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_bytes(b"model:\n  factory: \xff\xfe\x00\n")
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not UTF-8 text" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("value", ["inf", "-inf", ".inf", "1e400", "nan", ".nan"])
def test_non_finite_numbers(tmp_path, capsys, monkeypatch, value):
    code, err = run_cli(tmp_path, capsys, monkeypatch, GOOD, [f"optimizer.lr={value}"])
    assert_one_line(code, err, "optimizer.lr: Input should be a finite number")


def test_fractional_gpus_with_allreduce(tmp_path, capsys, monkeypatch):
    code, err = run_cli(tmp_path, capsys, monkeypatch, GOOD, ["strategy.mode=allreduce", "scaling.gpus_per_replica=0.5"])
    assert_one_line(code, err, "scaling.gpus_per_replica: allreduce needs a whole GPU per replica")


@pytest.mark.parametrize("name", ["adam", "adagrad"])
def test_easgd_momentum_with_adam_or_adagrad(tmp_path, capsys, monkeypatch, name):
    code, err = run_cli(tmp_path, capsys, monkeypatch, GOOD,
                        ["strategy.mode=easgd", f"optimizer.name={name}", "strategy.momentum=0.5"])
    assert_one_line(code, err, "strategy.momentum is EAMSGD's Nesterov momentum for optimizer.name sgd")


def test_subprocess_no_traceback_for_late_found_input(tmp_path):
    """Through `python -m orchestrator`: exit 2, one line, no traceback (not UTF-8; unknown scheme)."""
    env = dict(os.environ, PYTHONPATH=REPO)
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("model:\n  factory: caf\xe9:f\n".encode("latin-1"))
    for cmd in ([str(bad)], [write(tmp_path, GOOD), "--set", "checkpoint.storage=nosuch://x"]):
        proc = subprocess.run([sys.executable, "-m", "orchestrator", "run", *cmd], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
