"""Bad input through the CLI: one line naming the field or file, exit code 2, nothing started."""
import os
import subprocess
import sys

import pytest
import yaml

from orchestrator.cli.main import main

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


def test_bad_input_through_the_cli_exit_2_one_line_no_traceback_nothing_written(tmp_path):
    """Through `python -m orchestrator run`, each in a fresh process of its own folder, the
    processes side by side: a bad value (optimizer.lr=-1), input found late before (a config that
    is not UTF-8; an unknown checkpoint scheme), the issue's --result-json under a regular file,
    and 2 replicas of 5000 CPUs each with no cluster to join (a local cluster would declare 10000
    logical CPUs: refused before Ray starts; RAY_ADDRESS unset so that no cluster is joined).
    Each: exit 2, one line naming what was wrong, no traceback, nothing written beside the job."""
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("RAY_ADDRESS", None)
    cases = {"lr": (["--set", "optimizer.lr=-1"], "optimizer.lr"),
             "latin1": (None, "UTF-8"),
             "scheme": (["--set", "checkpoint.storage=nosuch://x"], "checkpoint.storage"),
             "result": (["--result-json", "a-file/r.json"], "--result-json"),
             "cpus": (["--set", "scaling.cpus_per_replica=5000", "--no-progress"],
                      "config error: scaling: the job asks for 10000 logical CPUs (scaling.replicas x")}
    procs, before = {}, {}
    for name, (args, _) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        if args is None:
            (folder / "job.yaml").write_bytes("model:\n  factory: caf\xe9:f\n".encode("latin-1"))
            args = []
        else:
            write(folder, GOOD)
        if name == "result":
            (folder / "a-file").write_text("not a directory")
        before[name] = sorted(os.listdir(folder))
        procs[name] = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", "job.yaml", *args], cwd=folder,
                                       env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=180)
        assert_one_line(proc.returncode, err.strip(), cases[name][1])
        assert sorted(os.listdir(tmp_path / name)) == before[name], name


# ---- input that used to be found late (after actors started, or after training) ------------

class Reached(BaseException):
    """The command got past its checks: training, a sweep or a calibration would start now."""


def no_run(monkeypatch):
    """Nothing trains, sweeps, calibrates or starts Ray: each raises Reached instead, so a test
    whose command returns 2 shows it stopped before Ray started."""
    import orchestrator.sweep
    from orchestrator.fleet import cluster
    from orchestrator.cli import simulate
    from orchestrator.trainer import ElasticTrainer

    def reached(*args, **kwargs):
        raise Reached()

    for owner, name in ((ElasticTrainer, "fit"), (cluster, "connect"), (simulate, "simulate"),
                        (orchestrator.sweep, "run_sweep")):
        monkeypatch.setattr(owner, name, reached)


def tree(path):
    """Every file and directory under `path`, relative."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def run_cli(tmp_path, capsys, monkeypatch, raw, overrides):
    """main() in tmp_path, stopped before Ray; (exit code, stderr); asserts nothing was written next to job.yaml."""
    no_run(monkeypatch)
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


@pytest.mark.parametrize("where", ["a-file/ck", "a-file/deeper/ck", "/proc/ck"])
def test_checkpoint_storage_where_nothing_can_be_written(tmp_path, capsys, monkeypatch, where):
    """A path under a regular file, or in /proc, cannot be written by anyone, root included: the
    check writes a probe file instead of trusting os.access (which says yes to root)."""
    (tmp_path / "a-file").write_text("not a directory")
    storage = where if where.startswith("/") else str(tmp_path / where)
    code, err = run_cli(tmp_path, capsys, monkeypatch, GOOD, [f"checkpoint.storage={storage}"])
    assert_one_line(code, err, f"checkpoint.storage: cannot write checkpoints to {storage}")


def test_storage_check_leaves_no_probe_file(tmp_path):
    from orchestrator.persistence.checkpoint import check_storage

    (tmp_path / "ok").mkdir()
    check_storage(str(tmp_path / "ok" / "new" / "ck"))
    assert tree(tmp_path) == ["ok"]


def test_unreachable_tracking_server_is_found_before_ray_starts(tmp_path, capsys, monkeypatch):
    code, err = run_cli(tmp_path, capsys, monkeypatch, GOOD,
                        [f"tracking.tracking_uri=http://127.0.0.1:{closed_port()}"])
    assert_one_line(code, err, "tracking.tracking_uri: no MLflow server answers")


def test_silent_tracking_server_times_out(tmp_path, capsys, monkeypatch):
    """A port that accepts connections but never answers: the check gives up on its own timeout
    (the line says so) and the command exits 2 before Ray starts."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        code, err = run_cli(tmp_path, capsys, monkeypatch, GOOD, [f"tracking.tracking_uri=http://127.0.0.1:{port}"])
    assert_one_line(code, err, "no answer within 3s")


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


@pytest.mark.parametrize("source", [  # an s3:// store waits out its client's retries (~6 s): tests/unit/test_sources.py in make test
    "file:///no/such/dir",
    pytest.param("s3://bucket/data?region=us-east-1&scheme=http&endpoint_override=127.0.0.1:PORT", marks=pytest.mark.full)])
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


@pytest.mark.parametrize("name", ["adam", "adagrad"])
def test_easgd_momentum_with_adam_or_adagrad(tmp_path, capsys, monkeypatch, name):
    code, err = run_cli(tmp_path, capsys, monkeypatch, GOOD,
                        ["strategy.mode=easgd", f"optimizer.name={name}", "strategy.momentum=0.5"])
    assert_one_line(code, err, "strategy.momentum is EAMSGD's Nesterov momentum for optimizer.name sgd")


# ---- output paths and read-only stores: checked before anything runs or is written -------------

def outputs(tmp_path):
    """tmp_path with a regular file, a directory, and out/ whose training.png is a directory; the
    job file (GOOD) and a sweep over it. Returns the job's path."""
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "out" / "training.png").mkdir(parents=True)
    sweep = {"base": "job.yaml", "search": {"optimizer.lr": {"grid": [0.1]}}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    return write(tmp_path, GOOD)


def main_in(tmp_path, capsys, monkeypatch, argv):
    """main(argv) in tmp_path, stopped before anything runs; (exit code, stderr); asserts that
    nothing under tmp_path was created, removed or left behind (no probe file either)."""
    no_run(monkeypatch)
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert tree(tmp_path) == before, "something was written"
    return code, err


BAD_OUTPUTS = [("a-file/r.json", "a-file is not a directory"), ("a-file/deeper/r.json", "a-file is not a directory"),
               ("a-dir", "is a directory")]


@pytest.mark.parametrize("target, why", BAD_OUTPUTS + [("out/r.json", "training.png")])
@pytest.mark.parametrize("command", ["run", "resume"])
def test_result_json_that_cannot_be_written(tmp_path, capsys, monkeypatch, command, target, why):
    """Refused up front (it was a traceback, or a whole run trained and then failed to write);
    for run and resume alike, and the training.png written beside it counts too."""
    job = outputs(tmp_path)
    argv = ["run", job] if command == "run" else ["resume", str(tmp_path / "no-such-run")]
    code, err = main_in(tmp_path, capsys, monkeypatch, argv + ["--result-json", str(tmp_path / target)])
    assert_one_line(code, err, "--result-json: cannot write")
    assert why in err, err


@pytest.mark.parametrize("target, why", BAD_OUTPUTS)
def test_sweep_json_that_cannot_be_written(tmp_path, capsys, monkeypatch, target, why):
    outputs(tmp_path)
    argv = ["sweep", str(tmp_path / "sweep.yaml"), "--json", str(tmp_path / target)]
    code, err = main_in(tmp_path, capsys, monkeypatch, argv)
    assert_one_line(code, err, "--json: cannot write")
    assert why in err, err


@pytest.mark.parametrize("flag", ["--plot", "--json"])
@pytest.mark.parametrize("target, why", BAD_OUTPUTS)
def test_simulate_outputs_that_cannot_be_written(tmp_path, capsys, monkeypatch, flag, target, why):
    """Refused before calibrating (it was a traceback after it)."""
    job = outputs(tmp_path)
    code, err = main_in(tmp_path, capsys, monkeypatch, ["simulate", job, flag, str(tmp_path / target)])
    assert_one_line(code, err, f"{flag}: cannot write")
    assert why in err, err


def test_simulate_default_plot_that_cannot_be_written(tmp_path, capsys, monkeypatch):
    job = outputs(tmp_path)
    (tmp_path / "simulate.png").mkdir()
    code, err = main_in(tmp_path, capsys, monkeypatch, ["simulate", job])
    assert_one_line(code, err, "--plot: cannot write")


@pytest.mark.parametrize("uri", ["sqlite:///new.db", "DEFAULT", "TMP/no-store"])
def test_simulate_from_run_opens_the_store_read_only(tmp_path, capfd, monkeypatch, uri):
    """A store that is not there is one line, and nothing is created (it was a new 954 KB
    mlflow.db, with MLflow's INFO lines on stderr)."""
    job = outputs(tmp_path)
    no_run(monkeypatch)
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    extra = [] if uri == "DEFAULT" else ["--tracking-uri", uri.replace("TMP", str(tmp_path))]
    code = main(["simulate", job, "--from-run", "0123abcd", *extra])
    err = capfd.readouterr().err.strip()
    assert_one_line(code, err, "--from-run 0123abcd: no MLflow store at")
    assert tree(tmp_path) == before, "something was written"


def test_simulate_from_run_reads_an_existing_store_quietly(tmp_path, capfd):
    """An existing store is read as it is: the run's figures, no line on stderr, the file unchanged."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from orchestrator.cli.calibration import from_run

    uri = f"sqlite:///{tmp_path}/store.db"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("x"))
    client.log_batch(run.info.run_id, metrics=[Metric("samples_per_s", 640.0, 0, 1)])
    client.log_param(run.info.run_id, "data.batch_size", "64")
    capfd.readouterr()
    before = (tmp_path / "store.db").read_bytes()
    got = from_run(run.info.run_id, uri)
    assert got["batch"] == 64 and got["step_s"] == pytest.approx(0.1)
    assert capfd.readouterr().err == ""
    assert (tmp_path / "store.db").read_bytes() == before


# ---- fields a builtin source ignores; GPUs a replica cannot use; an oversized local cluster -------

@pytest.mark.parametrize("override, field", [
    ("data.feature_shape=[1, 2]", "data.feature_shape"), ("data.decode=examples.text:decode", "data.decode"),
    ("data.label_column=target", "data.label_column"), ("data.feature_columns=[f0]", "data.feature_columns"),
    ("data.test_source=TMP/test.parquet", "data.test_source"), ("data.id_column=id", "data.id_column"),
    ("data.test_fraction=0.3", "data.test_fraction"),
])
def test_decoder_fields_with_a_builtin_source(tmp_path, capsys, monkeypatch, override, field):
    """A builtin dataset comes decoded and split: these fields would be ignored, so they are refused."""
    code, err = run_cli(tmp_path, capsys, monkeypatch, GOOD, [override.replace("TMP", str(tmp_path))])
    assert_one_line(code, err, f"config error: {field}:")
    assert "builtin:synthetic" in err, err


@pytest.mark.parametrize("gpus", ["2", "1.5"])
def test_more_than_one_gpu_per_replica(tmp_path, capsys, monkeypatch, gpus):
    code, err = run_cli(tmp_path, capsys, monkeypatch, GOOD, [f"scaling.gpus_per_replica={gpus}"])
    assert_one_line(code, err, "scaling.gpus_per_replica: a replica uses one GPU")


def test_one_gpu_per_replica_is_valid():
    from orchestrator.config import JobConfig

    assert JobConfig.from_dict(GOOD, ["scaling.gpus_per_replica=1"]).scaling.gpus_per_replica == 1


@pytest.mark.parametrize("cpus, started", [(8, True), (8.5, False), (64, False)])
def test_local_cluster_bound(monkeypatch, cpus, started):
    """At most 4 logical CPUs per core on a local cluster started here (2 cores: 8)."""
    import ray

    from orchestrator.fleet import cluster
    from orchestrator.errors import ConfigError

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if started:
        assert cluster.connect(cpus) is True and calls[0]["num_cpus"] == 8
    else:
        with pytest.raises(ConfigError, match="at most 4 per core"):
            cluster.connect(cpus)
        assert calls == []



# ---- issue 57: an empty file, a duplicate key, an option no mode uses, an unreachable cluster -----

@pytest.mark.parametrize("text, needle", [
    ("# nothing but a comment\n", "config file {path} is empty"),
    ("null\n", "config file {path} is empty"),
    ("optimizer:\n  lr: 0.1\n  momentum: 0.9\n  lr: 0.2\n", "config error: {path}:4: duplicate key 'lr' (first at line 2)"),
    ("strategy: {mode: allreduce, tau: 8}\n", "config error: strategy.tau: used by easgd; this run's modes (allreduce)"),
])
def test_config_that_used_to_train_something_else_exit_2(tmp_path, capsys, monkeypatch, text, needle):
    no_run(monkeypatch)
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "job.yaml"
    path.write_text(text)
    code = main(["run", str(path)])
    assert_one_line(code, capsys.readouterr().err.strip(), needle.format(path=path))
    assert os.listdir(tmp_path) == ["job.yaml"]


def ray_address_line(address, monkeypatch):
    """connect()'s ConfigError line with RAY_ADDRESS=address, the cluster check waiting 0.5 s at most;
    fails the test if ray.init was called."""
    import ray

    from orchestrator.fleet import cluster
    from orchestrator.errors import ConfigError

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail(f"ray.init({kw}) called"))
    monkeypatch.setattr(cluster, "RAY_ADDRESS_WAIT_S", 0.5)
    monkeypatch.setenv("RAY_ADDRESS", address)
    with pytest.raises(ConfigError) as exc:
        cluster.connect(2)
    return str(exc.value)


@pytest.mark.parametrize("form", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}", "localhost:{port}"])
def test_unreachable_ray_address_is_bad_input(monkeypatch, form):
    address = form.format(port=closed_port())
    line = ray_address_line(address, monkeypatch)
    assert line.startswith(f"config error: RAY_ADDRESS: no Ray cluster answers at {address}") and "\n" not in line, line


@pytest.mark.parametrize("address, needle", [
    ("myhost", "RAY_ADDRESS: 'myhost' is not host:port"),
    ("127.0.0.1:port", "RAY_ADDRESS: '127.0.0.1:port' is not host:port"),
    ("http://127.0.0.1:8265", "RAY_ADDRESS: http://127.0.0.1:8265 is an HTTP address"),
])
def test_malformed_ray_address_is_bad_input(monkeypatch, address, needle):
    assert needle in ray_address_line(address, monkeypatch)


def test_ray_address_auto_with_no_cluster_here_is_bad_input(monkeypatch):
    from orchestrator.fleet import cluster

    def none_here():
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(cluster, "local_cluster_address", none_here)
    assert "RAY_ADDRESS: auto: no running Ray cluster found on this machine" in ray_address_line("auto", monkeypatch)


def test_ray_address_auto_names_the_cluster_it_found(monkeypatch):
    from orchestrator.fleet import cluster

    port = closed_port()
    monkeypatch.setattr(cluster, "local_cluster_address", lambda: f"127.0.0.1:{port}")
    line = ray_address_line("auto", monkeypatch)
    assert f"no Ray cluster answers at 127.0.0.1:{port} (found by auto)" in line, line


def test_reachable_ray_address_is_joined(monkeypatch):
    import socket

    import ray

    from orchestrator.fleet import cluster

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        monkeypatch.setenv("RAY_ADDRESS", address)
        assert cluster.connect(2) is False
    assert calls[0]["address"] == address


@pytest.mark.full  # ~25 s (the 20 s wait): make test checks the address in process above, and exit 2 from the CLI
def test_subprocess_unreachable_ray_address_exit_2(tmp_path):
    """The example with RAY_ADDRESS naming a port nothing listens on: one line naming the address and
    exit 2, nothing written, no cluster started (this process's timeout is what catches a hang)."""
    address = f"127.0.0.1:{closed_port()}"
    env = dict(os.environ, PYTHONPATH=REPO, RAY_ADDRESS=address)
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "run", os.path.join(REPO, "examples",
                           "mnist_allreduce.yaml"), "--no-progress"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=90)
    assert_one_line(proc.returncode, proc.stderr.strip(), f"config error: RAY_ADDRESS: no Ray cluster answers at {address}")
    assert os.listdir(tmp_path) == []

# ---- --no-progress: only the final line ------------------------------------------------------------

def test_no_progress_prints_only_the_final_line(tmp_path, capsys, monkeypatch):
    from orchestrator.reporting.result import FinalMetrics, TrainResult
    from orchestrator.trainer import ElasticTrainer

    result = TrainResult(mlflow_run_id="0123abcd", mode="allreduce", replicas=2, epochs=1, steps=10, samples=640,
                         wall_s=3.0, samples_per_s=320.0, steady_samples_per_s=400.0, startup_s=1.0,
                         time_to_target_s=None, final=FinalMetrics(test_accuracy=0.5, test_loss=1.0, train_loss=1.1),
                         stop_reason="epochs", checkpoint=None, tracking_uri="sqlite:///x.db", experiment_id="0")
    monkeypatch.setattr(ElasticTrainer, "fit", lambda self: result)
    monkeypatch.chdir(tmp_path)
    assert main(["run", write(tmp_path, GOOD), "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["done: epochs; test_accuracy 0.5000; MLflow run 0123abcd"], out
