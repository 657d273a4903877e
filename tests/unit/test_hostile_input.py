"""Hostile input by the hundred: generated configs, `--set` overrides, URIs, data files,
checkpoints and sweep files through `main(argv)` (run, resume, sweep), in-process.

Every case either is bad input, and then `main` returns 2 with exactly one stderr line that
starts `orchestrator:` and names the field or file, no traceback; or is a valid job, and then
`JobConfig.from_yaml` returns a config and `ElasticTrainer(config).check()` passes or raises
ConfigError (never another exception); a valid job is never trained: `ElasticTrainer.fit` and
`cluster.connect` are replaced by a stub that raises `Reached`, so Ray never starts. Each case
runs in an empty working directory, which must still be empty afterwards (no mlflow.db, mlruns
or checkpoint directory), and the inputs' directory must be unchanged.

Generated examples per run: 640 (max_examples: bytes 50, yaml text 60, field values 140,
overrides 100, uris 80, data files 70, checkpoints 70, sweep files 70), derandomized (the same
examples every run) plus the explicit @example regressions; the file takes about 23 s on a
2-core machine.
Each @example marked "regression" was a traceback, an exit 1, a second stderr line or a file
written before the fix that came with this suite.
"""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import tempfile

import pytest
import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from orchestrator.cli.main import main
from orchestrator.config import JobConfig
from orchestrator.errors import ConfigError

# a warning is one more stderr line in the CLI (pytest would only record it): here it fails the case
pytestmark = pytest.mark.filterwarnings("error::UserWarning")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOOD = {"model": {"factory": "examples.models:tiny_mlp"}, "data": {"source": "builtin:synthetic"}}


def hostile(n: int):
    """Reproducible (derandomized, no example database), no per-example deadline (the test's
    timeout bounds it), function-scoped fixtures allowed (each example cleans up after itself)."""
    return settings(max_examples=n, derandomize=True, database=None, deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                           HealthCheck.large_base_example])


class Reached(BaseException):
    """The input got past every check (training would start); raised instead of starting Ray."""


@pytest.fixture
def harness(monkeypatch, capfd):
    """No training, no Ray: fit() and cluster.connect raise Reached. Yields a Harness."""
    from orchestrator.fleet import cluster
    from orchestrator.trainer import ElasticTrainer

    def reached(*args, **kwargs):
        raise Reached()

    monkeypatch.setattr(ElasticTrainer, "fit", reached)
    monkeypatch.setattr(cluster, "connect", reached)
    with tempfile.TemporaryDirectory(prefix="hostile-") as root:
        yield Harness(root, capfd)


def _listing(path: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        rel = os.path.relpath(dirpath, path)
        out += [os.path.join(rel, n) for n in sorted(dirnames + filenames)]
    return sorted(out)


class Harness:
    def __init__(self, root: str, capfd) -> None:
        self.root, self.capfd = root, capfd
        self.n = 0

    def inputs(self) -> str:
        """A fresh directory for one example's input files."""
        self.n += 1
        path = os.path.join(self.root, f"in{self.n}")
        os.makedirs(path)
        return path

    @contextlib.contextmanager
    def empty_cwd(self, watched: str):
        """chdir into an empty directory; afterwards it must still be empty and `watched` unchanged."""
        before = _listing(watched)
        old = os.getcwd()
        with tempfile.TemporaryDirectory(prefix="cwd-", dir=self.root) as cwd:
            os.chdir(cwd)
            try:
                yield cwd
            finally:
                os.chdir(old)
                written = os.listdir(cwd)
            assert written == [], f"written into the working directory: {written}"
        assert _listing(watched) == before, "the inputs' directory changed"

    def main(self, argv: list[str], watched: str) -> tuple[object, str]:
        """(exit code or Reached, stderr) of main(argv) in an empty working directory."""
        self.capfd.readouterr()
        with self.empty_cwd(watched):
            try:
                code = main(argv)
            except Reached:
                code = Reached
        return code, self.capfd.readouterr().err


def assert_one_line(code, err: str, *names: str) -> str:
    """Exit 2, exactly one stderr line starting `orchestrator:`, naming one of `names`."""
    assert code == 2, f"exit {code!r}, stderr: {err}"
    assert "Traceback" not in err, err
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, f"{len(lines)} stderr lines: {err}"
    line = lines[0]
    assert line.startswith("orchestrator:"), line
    assert any(_names(line, n) for n in names), f"none of {names} named in: {line}"
    return line


def _names(line: str, name: str) -> bool:
    """`line` names `name` (a file, or a dotted key: itself, or its section and leaf both)."""
    if name in line:
        return True
    parts = name.split(".")
    return len(parts) > 1 and parts[0] in line and parts[-1] in line


def judge_config(h: Harness, path: str, overrides: list[str], names: tuple[str, ...], watched: str) -> str:
    """Classify the config at `path` with `overrides` directly (ConfigError or a config whose
    check() passes or raises ConfigError; any other exception fails the test), then through
    main: bad input is one line (exit 2), a valid job reaches training. Returns 'bad' or 'valid'."""
    from orchestrator.trainer import ElasticTrainer

    h.capfd.readouterr()
    with h.empty_cwd(watched):
        try:
            config = JobConfig.from_yaml(path, overrides)
        except ConfigError as exc:
            assert "\n" not in str(exc), str(exc)
            config = None
        valid = False
        if config is not None:
            try:
                ElasticTrainer(config, show_progress=False).check()
                valid = True
            except ConfigError as exc:
                assert "\n" not in str(exc), str(exc)
    code, err = h.main(["run", path, *[f"--set={o}" for o in overrides], "--no-progress"], watched)
    if valid:
        assert code is Reached and "Traceback" not in err, f"a valid config: exit {code!r}, stderr: {err}"
        event("valid")
        return "valid"
    line = assert_one_line(code, err, path, *names)
    event("bad: " + _kind(line, path))
    return "bad"


def _kind(line: str, path: str) -> str:
    """What a line is about, for the statistics: `config error: optimizer.lr`, `config file FILE
    is not UTF-8 text`..."""
    text = re.sub(r"\d+", "N", line.replace(path, "FILE").removeprefix("orchestrator: ").split(" (")[0])
    return ":".join(text.split(":")[:2])[:70]


def write(directory: str, name: str, data) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    return path


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT = closed_port()  # nothing listens there: connections are refused at once

# ---- generators ---------------------------------------------------------------------------------

NUMBERS = st.one_of(
    st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**32, 2**63, -(2**63) - 1, 10**30, 10**400]),
    st.floats(), st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e308, -1e308, 5e-324, 1e-300, 0.5]),
)
WORDS = st.sampled_from(["", " ", "allreduce", "downpour", "easgd", "ring", "sgd", "adam", "rmsprop", "max", "min",
                         "async", "sync", "adaptive", "schedule", "linear", "none", "null", "~", "yes", "no",
                         "true", "on", "1e400", ".nan", "-.inf", "0x1F", "0o17", "1_000", "test_accuracy",
                         "train_loss", "test_r2", "classification", "regression", "builtin:synthetic",
                         "builtin:imagenet", "examples.models:tiny_mlp", "examples.models:nothing",
                         "no_such_module:f", "nocolon", ":", "a:", ":b", "\x00", "\u2028", "\ufeff", "é" * 3])
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, WORDS, st.text(max_size=24))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.one_of(st.text(max_size=10), WORDS), inner, max_size=4), max_leaves=10)
NON_TEXT = st.recursive(st.one_of(st.none(), st.booleans(), NUMBERS),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                        max_leaves=6)


def _config_keys() -> list[str]:
    """Every dotted key of JobConfig (sections, their fields, nested models' fields)."""
    from pydantic import BaseModel
    import typing

    keys: list[str] = []

    def walk(prefix: str, model: type) -> None:
        for name, field in model.model_fields.items():
            key = f"{prefix}.{name}" if prefix else name
            keys.append(key)
            args = [field.annotation, *typing.get_args(field.annotation)]
            sub = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
            if sub is not None:
                walk(key, sub)

    walk("", JobConfig)
    return keys


KEYS = _config_keys()
# keys whose text values name a module to import, a path, a URI: random text there would import
# real modules or list real directories; those get non-text values here (their own tests below)
OUTSIDE = {"model.factory", "task.name", "data.decode", "data.source", "data.test_source", "checkpoint.storage",
           "tracking.tracking_uri"}


def _plausible() -> dict[str, list]:
    """Per key: its default (when it has a plain one) and values of the same kind nearby."""
    from pydantic import BaseModel

    out: dict[str, list] = {}

    def walk(prefix: str, model: type) -> None:
        for name, field in model.model_fields.items():
            key = f"{prefix}.{name}" if prefix else name
            default = None if field.is_required() else field.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):
                walk(key, type(default))
                continue
            if isinstance(default, bool):
                out[key] = [default, not default]
            elif isinstance(default, (int, float)):
                out[key] = [default, default + 1, default * 2, 1, 0.5, 0]
            elif isinstance(default, str) and key not in OUTSIDE:
                out[key] = [default]

    walk("", JobConfig)
    out.update({"strategy.mode": ["allreduce", "downpour", "easgd"], "optimizer.name": ["sgd", "adam", "adagrad"],
                "scaling.replicas": [1, 2, 3], "stop.target_accuracy": [0.5, 1.0],
                "strategy.phases": [[{"mode": "downpour", "until": {"epochs": 1}}, {"mode": "allreduce"}]],
                "faults.slow_replicas": [{0: 0.1}, [{"rank": 1, "factor": 2}]]})
    return out


PLAUSIBLE = _plausible()
UNKNOWN_KEYS = st.one_of(
    st.sampled_from(["optimzer.lr", "optimizer.rate", "bogus", "model.factory.x", "scaling.replicas.n",
                     "stop.target.metric.x", "strategy.phases.0.mode", "data", "__class__", "model.__dict__"]),
    st.from_regex(r"[a-z_]{1,8}(\.[a-z_]{1,8}){0,2}", fullmatch=True))


def _nest(key: str, value) -> dict:
    out: dict = {}
    node = out
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return out


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


@st.composite
def field_settings(draw):
    """A config: GOOD with 1-3 keys (known or unknown) set to hostile values."""
    raw = GOOD
    keys = []
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(KEYS)) if draw(st.integers(0, 7)) else draw(UNKNOWN_KEYS)
        plausible = PLAUSIBLE.get(key, [])
        if plausible and draw(st.integers(0, 2)):  # the field's default or a likely value: many valid configs
            value = draw(st.sampled_from(plausible))
        else:
            value = draw(NON_TEXT if key in OUTSIDE else VALUES)
        raw = _merge(raw, _nest(key, value))
        keys.append(key)
    return raw, keys


# ---- the config file: raw bytes and YAML text -----------------------------------------------------

@pytest.mark.timeout(120)
@hostile(50)
@given(data=st.one_of(
    st.binary(max_size=300),
    st.binary(max_size=60).map(lambda b: b"model:\n  factory: " + b + b"\n"),
    st.sampled_from([b"\xff\xfe\x00\x00", b"\xef\xbb\xbf{}", b"\x00" * 64, b"\xc3\x28", b"PAR1\x00\x00PAR1",
                     gzip.compress(yaml.safe_dump(GOOD).encode()), b"\x1f\x8b", b"\r\n" * 10, b"\t- a\n"]),
))
@example(data=b"model: " + b"[" * 5000 + b"]" * 5000 + b"\n")  # regression: RecursionError traceback
@example(data=b"model:\n" + b"".join(b" " * (i + 1) + b"k%d:\n" % i for i in range(1500)))  # regression: same
@example(data=b"model:\n  factory: caf\xe9:f\n")
def test_config_file_bytes(harness, data):
    d = harness.inputs()
    path = write(d, "job.yaml", data)
    judge_config(harness, path, [], ("config file", "config error:"), d)


YAML_SNIPPETS = st.sampled_from([
    "model: [unclosed", "model: {a: 1", "model:\n\tfactory: x", "- a\n- b", "just text", "42", "3.5", "~", "''",
    "model: &a [*a]", "model:\n  kwargs: &k {x: *k}", "? [a, b]\n: c", "model: !!python/object/apply:os.system ['true']",
    "model: !!binary aGVsbG8=", "model: !custom x", "%YAML 1.1\n---\nmodel: {}", "---\n---\n", "...",
    "model: *undefined", "model: &a x\nmodel: &a y", "model: {factory: a:b}\nmodel: {factory: c:d}",
    "optimizer: {lr: .inf}", "optimizer: {lr: 1e400}", "optimizer: {lr: .NaN}", "data: {seed: 1e30}",
    "scaling: {replicas: 99999999999999999999999999}", "stop: {epochs: 1.5}", "model: 2001-01-01",
    "data: {batch_size: 0x10}", "data: {batch_size: 0o10}", "data: {batch_size: 1_0}", "model: null",
    "task: {name: regression}", "task: {kwargs: {x: 1}}", "data: {seed: -1}", "data: {seed: 18446744073709551616}",
])


@st.composite
def yaml_texts(draw):
    parts = draw(st.lists(st.one_of(YAML_SNIPPETS, st.just(yaml.safe_dump(GOOD)),
                                    st.text(alphabet=st.sampled_from(list("{}[]:,-?&*!|>'\"#%@` \n\tab01.")),
                                            max_size=40)), min_size=1, max_size=3))
    return "\n".join(parts)


LAUGHS = "".join(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]\n" for i in range(1, 10))


@pytest.mark.timeout(120)
@hostile(60)
@given(text=yaml_texts())
@example(text="model:\n  factory: examples.models:tiny_mlp\n  kwargs: &a [*a]\ndata: {source: 'builtin:synthetic'}")
@example(text="model:\n  factory: examples.models:tiny_mlp\n  kwargs:\n    l0: &l0 [x, x, x, x, x, x, x, x, x]\n"
         + "".join("    " + line + "\n" for line in LAUGHS.splitlines())
         + "data: {source: 'builtin:synthetic'}")  # regression: a billion values once expanded
@example(text="task: {kwargs: {x: 1}}\nmodel: {factory: 'examples.models:tiny_mlp'}\n"
         "data: {source: 'builtin:synthetic'}")  # regression: TypeError traceback from the task's constructor
@example(text="data: {seed: -1, source: 'builtin:synthetic'}\nmodel: {factory: 'examples.models:tiny_mlp'}")
@example(text="data: {seed: 100000000000000000000000, source: 'builtin:synthetic'}\n"
         "model: {factory: 'examples.models:tiny_mlp'}")  # regression: both seeds were a ValueError traceback
def test_config_yaml_text(harness, text):
    d = harness.inputs()
    path = write(d, "job.yaml", text)
    judge_config(harness, path, [], ("config file", "config error:"), d)


# ---- wrong types, out-of-range and non-finite values, unknown keys, conflicting options ---------

@pytest.mark.timeout(180)
@hostile(140)
@given(case=field_settings())
@example(case=(_merge(GOOD, {"strategy": {"mode": "easgd", "momentum": 0.5}, "optimizer": {"name": "adam"}}),
               ["strategy.momentum", "optimizer.name"]))
@example(case=(_merge(GOOD, {"strategy": {"mode": "allreduce", "phases": [{"mode": "easgd"}]}}), ["strategy.phases"]))
@example(case=(_merge(GOOD, {"scaling": {"replicas": 2, "min_replicas": 3}}), ["scaling.min_replicas"]))
@example(case=(_merge(GOOD, {"stop": {"target_accuracy": 0.9, "target": {"metric": "test_accuracy", "goal": "max",
                                                                         "value": 0.9}}}), ["stop.target"]))
def test_config_field_values(harness, case):
    raw, keys = case
    d = harness.inputs()
    path = write(d, "job.yaml", yaml.safe_dump(raw))
    judge_config(harness, path, [], tuple(keys) + tuple(k.split(".")[0] for k in keys) + ("config error:",), d)


# ---- --set overrides ------------------------------------------------------------------------------

OVERRIDE_VALUES = st.one_of(
    WORDS, st.text(max_size=20),
    st.sampled_from(["[", "]", "{", "{a: 1", "[1, 28, 28]", "{0: .inf}", "{2: 0.1}", "&a [*a]", "&a {x: *a}",
                     "!!python/object/apply:os.system ['true']", "!!binary aGVsbG8=", "*x", "@", "`", "%", "|\n x",
                     "1e308", "-1e308", "1e-400", "99999999999999999999999", "=", "==", "a=b", "\t", "- 1\n- 2"]),
    NUMBERS.map(str),
)


@st.composite
def overrides(draw):
    out = []
    for _ in range(draw(st.integers(1, 3))):
        shape = draw(st.integers(0, 9))
        if shape == 0:  # malformed: no '=', empty parts
            out.append(draw(st.sampled_from(["optimizer.lr", "=1", ".=1", "a..b=1", ".a=1", "a.=1", " =1", "",
                                             "model.kwargs.=1", "="])))
            continue
        key = draw(st.one_of(st.sampled_from([k for k in KEYS if k not in OUTSIDE]), UNKNOWN_KEYS,
                             st.sampled_from(["model.kwargs.hidden", "model.kwargs.in_features", "task.kwargs.x",
                                              "optimizer.lr.x", "model.factory.x"])))
        out.append(f"{key}={draw(OVERRIDE_VALUES)}")
    return out


@pytest.mark.timeout(150)
@hostile(100)
@given(sets=overrides())
@example(sets=["model.kwargs=&a {x: *a}"])  # regression for the sweep: a cycle, dumped to JSON, was a traceback
@example(sets=["task.kwargs={x: 1}"])  # regression: TypeError traceback
@example(sets=["data.seed=-1"])  # regression: ValueError traceback (numpy's seed)
@example(sets=["data.seed=100000000000000000000000"])  # regression: torch.manual_seed overflow traceback
@example(sets=["optimizer.lr=inf", "optimizer.lr=0.1"])  # the last one wins: valid
def test_set_overrides(harness, sets):
    d = harness.inputs()
    path = write(d, "job.yaml", yaml.safe_dump(GOOD))
    keys = tuple(s.partition("=")[0].strip() for s in sets)
    judge_config(harness, path, sets, keys + tuple(k.split(".")[0] for k in keys) + ("--set", "config error:"), d)


# ---- tracking and checkpoint URIs ------------------------------------------------------------------

@st.composite
def uris(draw):
    scheme = draw(st.sampled_from(["", "http", "https", "HTTP", "file", "sqlite", "sqlite+pysqlite", "postgresql",
                                   "postgresql+psycopg2", "mysql", "mssql", "notascheme", "s3x", "mock", "ftp",
                                   "c", "x-y.z+w"]))
    sep = draw(st.sampled_from(["://", ":", ":/", "::/", ":///", ":////", "//"]))
    host = draw(st.sampled_from(["", f"127.0.0.1:{PORT}", "127.0.0.1", "[::1", "[zz]", "127.0.0.1:notaport",
                                 "127.0.0.1:99999999", "u:p@127.0.0.1:%d" % PORT, "@", "%zz", "h o s t"]))
    path = draw(st.one_of(
        st.sampled_from(["", "x", "mlruns", "runs/ck", "proc/self/x", "mlflow.db", "a" * 300, "a/" * 2100,
                         "x\x00y", "%00", "..", "?q=1", "#frag", "~"]),
        st.text(alphabet=st.sampled_from(list("ab/.:%?#@[]\x00 é")), max_size=12)))
    if scheme in ("", "c") and sep in (":", ":/", "//") and draw(st.booleans()):
        return path  # a plain local path
    return f"{scheme}{sep}{host}/{path}" if host else f"{scheme}{sep}{path}"


@pytest.mark.timeout(150)
@hostile(80)
@given(field=st.sampled_from(["tracking.tracking_uri", "checkpoint.storage"]), uri=uris())
@example(field="tracking.tracking_uri", uri="notascheme::/x")  # regression: MLflow registry exception, exit 1
@example(field="tracking.tracking_uri", uri="http://[::1")  # regression: ValueError traceback
@example(field="tracking.tracking_uri", uri="postgresql+psycopg2://h:notaport/x")  # regression: ValueError traceback
@example(field="tracking.tracking_uri", uri="mysql://127.0.0.1:99999999/x")  # regression: OverflowError
@example(field="tracking.tracking_uri", uri="/tmp/x\x00y")  # regression: passed the check
@example(field="tracking.tracking_uri", uri="sqlite:///" + "a/" * 2100 + "x.db")  # regression: passed the check
@example(field="checkpoint.storage", uri="notascheme::/x")  # regression: a local dir `notascheme::` at training
@example(field="checkpoint.storage", uri="s3:/bucket/x")  # regression: same, a dir `s3:` in the working directory
@example(field="checkpoint.storage", uri="s3://")  # regression: passed the check, no bucket
@example(field="checkpoint.storage", uri="x\x00y")  # regression: passed the check
@example(field="checkpoint.storage", uri="a" * 300)  # regression: passed the check, name too long
@example(field="checkpoint.storage", uri="runs/ck")  # valid: relative, nothing created by the check
def test_tracking_and_checkpoint_uris(harness, field, uri):
    d = harness.inputs()
    path = write(d, "job.yaml", yaml.safe_dump(GOOD))
    outcome = judge_config(harness, path, [f"{field}={uri}"], (field,), d)
    if uri in ("notascheme::/x", "s3:/bucket/x") or "\x00" in uri:
        assert outcome == "bad"


# ---- data files --------------------------------------------------------------------------------------

def _table(rng, rows: int, width: int, label: str):
    import numpy as np
    import pyarrow as pa

    cols = {}
    if label == "int":
        cols["label"] = pa.array(rng.integers(0, 3, rows))
    elif label == "float":
        cols["label"] = pa.array(rng.normal(size=rows))
    elif label == "string":
        cols["label"] = pa.array([f"c{i % 3}" for i in range(rows)])
    elif label == "negative":
        cols["label"] = pa.array(-rng.integers(1, 3, rows))
    elif label == "huge":
        cols["label"] = pa.array(np.full(rows, 2**62, dtype=np.int64))
    for i in range(width):
        cols[f"f{i}"] = pa.array(rng.normal(size=rows).astype(np.float32))
    if label == "nan":
        cols["label"] = pa.array(rng.integers(0, 3, rows))
        cols["f0"] = pa.array(np.full(rows, np.nan, dtype=np.float32))
    if label == "text_feature":
        cols["label"] = pa.array(rng.integers(0, 3, rows))
        cols["f0"] = pa.array(["x"] * rows)
    return pa.table(cols) if cols else pa.table({"other": pa.array(range(rows))})


def _encode(table, fmt: str) -> bytes:
    import pyarrow.csv as pacsv
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    if fmt == "parquet":
        pq.write_table(table, buf)
    elif fmt == "csv":
        pacsv.write_csv(table, buf)
    else:
        feather.write_feather(table, buf)
    return buf.getvalue()


@st.composite
def data_files(draw):
    """(files {relative name: bytes}, the data.source to give, width of the good rows)."""
    import numpy as np

    fmt = draw(st.sampled_from(["parquet", "csv", "arrow"]))
    ext = draw(st.sampled_from({"parquet": [".parquet", ".pq"], "csv": [".csv", ".csv.gz"],
                                "arrow": [".arrow", ".feather", ".ipc"]}[fmt] + [".txt", ""]))
    rows = draw(st.sampled_from([0, 1, 2, 3, 40, 200]))
    width = draw(st.integers(0, 5))
    label = draw(st.sampled_from(["int", "int", "int", "float", "string", "negative", "huge", "nan", "text_feature",
                                  "none"]))
    good = _encode(_table(np.random.default_rng(draw(st.integers(0, 9))), rows, width, label), fmt)
    if ext == ".csv.gz":
        good = gzip.compress(good)
    damage = draw(st.sampled_from(["none", "none", "none", "truncate", "flip", "empty", "random", "prefix"]))
    if damage == "truncate":
        good = good[: draw(st.integers(0, max(0, len(good) - 1)))]
    elif damage == "flip" and good:
        at = draw(st.integers(0, len(good) - 1))
        good = good[:at] + bytes([good[at] ^ 0xFF]) + good[at + 1:]
    elif damage == "empty":
        good = b""
    elif damage == "random":
        good = draw(st.binary(max_size=200))
    elif damage == "prefix":
        good = b"\xff\xfe" + good
    layout = draw(st.sampled_from(["file", "dir", "dir_mixed", "dir_empty", "missing"]))
    name = "rows" + ext
    if layout == "file":
        return {name: good}, name, width
    if layout == "dir":
        return {f"data/{name}": good, "data/_SUCCESS": b"", "data/.hidden": b"x"}, "data", width
    if layout == "dir_mixed":
        return {f"data/{name}": good, "data/other.csv": b"label,f0\n1,2\n"}, "data", width
    if layout == "dir_empty":
        return {"data/_SUCCESS": b""}, "data", width
    return {}, "nothing/here" + ext, width


@pytest.mark.timeout(150)
@hostile(70)
@given(case=data_files(), field=st.sampled_from(["data.source", "data.source", "data.test_source"]))
@example(case=({"rows.csv": b'\xff\xfe"label"\n2\n'}, "rows.csv", 0), field="data.source")  # regression:
# a CSV header that is not UTF-8 was a UnicodeDecodeError traceback
@example(case=({"rows.csv": b'label,f0\n1,\xff\n2,\xfe\n'}, "rows.csv", 1), field="data.source")
def test_data_files(harness, case, field):
    files, source, width = case
    d = harness.inputs()
    for name, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(d, name)), exist_ok=True)
        write(d, name, data)
    raw = {"model": {"factory": "examples.models:tiny_mlp", "kwargs": {"in_features": max(width, 1), "num_classes": 3}},
           "data": {"source": "builtin:synthetic"}}
    if field == "data.test_source":  # a good train file beside the hostile test set
        import numpy as np

        write(d, "train.parquet", _encode(_table(np.random.default_rng(0), 200, max(width, 1), "int"), "parquet"))
        raw["data"]["source"] = os.path.join(d, "train.parquet")
    raw["data"][field.split(".")[1]] = os.path.join(d, source)
    path = write(d, "job.yaml", yaml.safe_dump(raw))
    judge_config(harness, path, [], (field, "data.", os.path.join(d, source), "model.factory", "task.name"), d)


@pytest.mark.parametrize("field", ["data.source", "data.test_source"])
def test_unreadable_data_file(harness, field):
    """A data file under a regular file cannot be read by anyone, root included (CI runs as
    root); a file without read permission cannot be read by anyone else."""
    d = harness.inputs()
    data = write(d, "rows.csv", "label,f0\n1,2\n")
    write(d, "train.csv", "label,f0\n" + "1,2\n0,3\n" * 20)
    unreadable = [os.path.join(data, "rows.csv")] + ([data] if os.geteuid() != 0 else [])
    for path in unreadable:
        raw = _merge(GOOD, {"data": {"source": path} if field == "data.source" else
                            {"source": os.path.join(d, "train.csv"), "test_source": path}})
        job = write(d, "job.yaml", yaml.safe_dump(raw))
        os.chmod(data, 0 if path == data else 0o644)
        try:
            code, err = harness.main(["run", job], d)
        finally:
            os.chmod(data, 0o644)
        assert_one_line(code, err, field)


# ---- checkpoints for `orchestrator resume` --------------------------------------------------------

@st.composite
def checkpoint_dirs(draw):
    """(files {name: bytes} in the run's directory, whether to name the dir, a file in it, ...)."""
    import torch

    files: dict[str, bytes] = {}
    for _ in range(draw(st.integers(0, 3))):
        step = draw(st.sampled_from([0, 1, 7, 10**12]))
        name = draw(st.sampled_from([f"ckpt-{step:09d}.pt", f"ckpt-{step:09d}-epoch_0001.pt", "model.pt",
                                     "ckpt-1.pt", "notes.txt", f"ckpt-{step:09d}-bad tag.pt"]))
        kind = draw(st.sampled_from(["state", "state", "random", "empty", "pickle", "list"]))
        if kind == "state":
            state = {}
            config = draw(st.sampled_from(["good", "good", "bad", "list", "missing"]))
            if config != "missing":
                state["config"] = {"good": GOOD, "bad": {"optimizer": {"lr": -1}}, "list": [1, 2]}[config]
            for key, value in (("run", {"totals": {}}), ("mlflow_run_id", "0123abcd"), ("epoch", 1), ("step", step),
                               ("model", {"w": torch.zeros(2)}), ("optimizer", {})):
                choice = draw(st.sampled_from(["keep", "keep", "keep", "drop", "wrong"]))
                if choice == "keep":
                    state[key] = value
                elif choice == "wrong":
                    state[key] = draw(st.sampled_from([None, 1.5, "x", [1], True]))
            buf = io.BytesIO()
            torch.save(state, buf)
            payload = buf.getvalue()
        elif kind == "random":
            payload = draw(st.binary(max_size=120))
        elif kind == "empty":
            payload = b""
        elif kind == "pickle":  # not loadable with weights_only (a class torch refuses)
            import pickle

            payload = pickle.dumps(Reached)
        else:
            buf = io.BytesIO()
            torch.save([1, 2, 3], buf)
            payload = buf.getvalue()
        cut = draw(st.sampled_from([None, None, 0.5, 0.9]))
        sidecar = {"name": name, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest(), "step": step,
                   "epoch": 1, "tag": "", "wall_time": 1.0}
        if cut is not None:  # truncated after its sidecar was written
            payload = payload[: int(len(payload) * cut)]
        files[name] = payload
        side = draw(st.sampled_from(["good", "good", "missing", "garbage", "wrong_sha", "not_json", "list"]))
        if side == "good":
            files[name + ".json"] = json.dumps(sidecar).encode()
        elif side == "garbage":
            files[name + ".json"] = draw(st.binary(max_size=40))
        elif side == "wrong_sha":
            files[name + ".json"] = json.dumps({**sidecar, "sha256": "0" * 64}).encode()
        elif side == "not_json":
            files[name + ".json"] = b"{bytes: 3"
        elif side == "list":
            files[name + ".json"] = b"[1, 2]"
    target = draw(st.sampled_from(["dir", "dir", "dir", "uri", "file", "missing", "run_id"]))
    return files, target


@pytest.mark.timeout(150)
@hostile(70)
@given(case=checkpoint_dirs())
@example(case=({}, "dir"))  # an empty run directory
@example(case=({"model.pt": b"\x00" * 10}, "file"))  # regression: an MLflow lookup that wrote mlflow.db, 3 lines
@example(case=({}, "run_id"))  # regression: the same (a run id looked up in a store that is not there)
@example(case=({}, "bad_uri"))  # regression: pyarrow's ArrowInvalid traceback
def test_resume_checkpoints(harness, case):
    files, target = case
    d = harness.inputs()
    run_dir = os.path.join(d, "store", "0123abcd")
    os.makedirs(run_dir)
    for name, data in files.items():
        write(run_dir, name, data)
    argv = {"dir": [run_dir], "uri": [f"file://{run_dir}"], "missing": [os.path.join(d, "store", "nope")],
            "file": [os.path.join(run_dir, next(iter(files), ""))] if files else [run_dir + "/"],
            "run_id": ["0123abcd", "--tracking-uri", f"sqlite:///{d}/none/mlflow.db"],
            "bad_uri": ["notascheme://x/0123abcd"]}[target]
    code, err = harness.main(["resume", *argv, "--no-progress"], d)
    event("valid" if code is Reached else "bad")
    if code is Reached:  # a good checkpoint: its config is valid and checks
        from orchestrator.persistence.resume import find_checkpoint

        with harness.empty_cwd(d):
            _, state, _ = find_checkpoint(argv[0])
            assert JobConfig.from_dict(state["config"]) is not None
        return
    assert_one_line(code, err, "resume:", "config error:")


def test_resume_of_a_run_id_with_the_default_store_writes_nothing(harness):
    """Regression: `resume NAME` in a directory without mlflow.db created one (and printed
    MLflow's table creation on two more stderr lines)."""
    d = harness.inputs()
    code, err = harness.main(["resume", "0123456789abcdef"], d)
    line = assert_one_line(code, err, "0123456789abcdef")
    assert "no MLflow store at" in line


def test_resume_reports_skipped_checkpoints_only_when_it_goes_on(harness):
    """A corrupt newest checkpoint before a good one whose config is bad: the one config error
    line, not a 'skipped checkpoint' line before it (regression: two lines)."""
    import torch

    from orchestrator.persistence.checkpoint import CheckpointStore

    d = harness.inputs()
    store = CheckpointStore(os.path.join(d, "store"), "0123abcd", keep=5)
    state = {"config": {"optimizer": {"lr": -1}}, "run": {}, "mlflow_run_id": "0123abcd", "epoch": 1, "step": 1,
             "model": {"w": torch.zeros(1)}}
    store.save(state, 1, 1)
    newest = store.save(state, 2, 1)
    with open(newest, "r+b") as f:
        f.truncate(10)
    code, err = harness.main(["resume", os.path.join(d, "store", "0123abcd")], d)
    assert_one_line(code, err, "optimizer.lr")


# ---- sweep files ------------------------------------------------------------------------------------

@st.composite
def sweep_files(draw):
    spec: dict = {}
    base = draw(st.sampled_from(["base.yaml", "base.yaml", "base.yaml", "missing.yaml", "sweep.yaml", "binary.yaml",
                                 "bad_base.yaml", "", None, 5, ["base.yaml"]]))
    if base is not None:
        spec["base"] = base
    if not draw(st.integers(0, 3)):
        spec["set"] = draw(st.one_of(
            st.dictionaries(st.sampled_from(["stop.epochs", "optimizer.lr", "model.kwargs.hidden", "bogus.key",
                                             "scaling.max_replicas", "data.seed", "a..b", ""]), VALUES, max_size=2),
            VALUES))
    search_keys = st.sampled_from(["optimizer.lr", "strategy.mode", "scaling.replicas", "model.kwargs.hidden",
                                   "data.batch_size", "optimizer", "optimizer.lr.x", "nope.key", "stop.epochs",
                                   "task.name", "", "a..b", "scaling.max_replicas"])
    bounds = st.lists(NUMBERS, min_size=0, max_size=3)
    space = st.one_of(
        st.fixed_dictionaries({"grid": st.lists(VALUES, max_size=4)}),
        st.fixed_dictionaries({"choice": st.lists(VALUES, max_size=4)}),
        st.fixed_dictionaries({"uniform": bounds}), st.fixed_dictionaries({"loguniform": bounds}),
        st.dictionaries(st.sampled_from(["grid", "choice", "uniform", "loguniform", "range"]), VALUES, max_size=3),
        VALUES)
    plausible = st.sampled_from([{"optimizer.lr": {"grid": [0.05, 0.1]}}, {"strategy.mode": {"choice": ["allreduce",
                                 "easgd"]}}, {"optimizer.lr": {"loguniform": [0.01, 0.1]}}, {"scaling.replicas": {"grid": [1, 2]}},
                                 {"model.kwargs.hidden": {"grid": [8, 16]}}])
    search = draw(st.one_of(plausible, plausible, st.dictionaries(search_keys, space, max_size=3), VALUES))
    if draw(st.integers(0, 9)):
        spec["search"] = search
    for key, values in (("num_samples", NUMBERS), ("metric", WORDS), ("goal", WORDS), ("scheduler", WORDS),
                        ("asha", VALUES), ("trial_driver_cpus", NUMBERS), ("max_wall_s", NUMBERS),
                        ("max_concurrent_trials", NUMBERS), ("bogus", VALUES)):
        if not draw(st.integers(0, 9)):
            spec[key] = draw(values)
    return spec


@pytest.mark.timeout(150)
@hostile(70)
@given(spec=sweep_files(), sets=st.lists(st.sampled_from(
    ["stop.epochs=2", "optimizer.lr=-1", "optimzer.lr=1", "data.seed=-5", "model.kwargs=&a {x: *a}",
     "tracking.tracking_uri=notascheme::/x", "checkpoint.storage=s3:/b"]), max_size=2))
@example(spec={"base": "base.yaml", "search": {"optimizer.lr": {"grid": [0.1, 0.2]}}}, sets=[])  # valid
@example(spec={"base": "base.yaml", "set": {"model.kwargs": {"x": 1}}, "search": {"optimizer.lr": {"grid": [0.1]}}},
         sets=["model.kwargs=&a {x: *a}"])  # regression: ValueError (circular reference) traceback
@example(spec={"base": "base.yaml", "search": {"optimizer.lr": {"grid": [0.1]}}},
         sets=["tracking.tracking_uri=notascheme::/x"])  # regression: exit 1 after Ray started
@example(spec={"base": "base.yaml", "search": {"optimizer.lr": {"uniform": [0, float("inf")]}}}, sets=[])
@example(spec={"base": "base.yaml", "search": {"optimizer.lr": {"loguniform": [float("nan"), 1]}}}, sets=[])
def test_sweep_files(harness, spec, sets):
    from orchestrator.sweep import load_sweep

    d = harness.inputs()
    write(d, "base.yaml", yaml.safe_dump(GOOD))
    write(d, "binary.yaml", b"\xff\xfe\x00garbage")
    write(d, "bad_base.yaml", yaml.safe_dump(_merge(GOOD, {"optimizer": {"lr": 0}})))
    path = write(d, "sweep.yaml", yaml.safe_dump(spec))
    harness.capfd.readouterr()
    with harness.empty_cwd(d):
        try:
            load_sweep(path, sets)
            loads = True
        except ConfigError as exc:
            assert "\n" not in str(exc), str(exc)
            loads = False
    code, err = harness.main(["sweep", path, *[f"--set={s}" for s in sets], "--no-progress"], d)
    event("valid" if code is Reached else "bad")
    if code is Reached:  # a valid sweep whose trials' inputs all check: it would start Ray now
        assert loads and "Traceback" not in err, err
        return
    assert_one_line(code, err, "sweep", "config error:", "base config", "--set", path)


# ---- through `python -m orchestrator`: the process's own stderr ------------------------------------

@pytest.mark.timeout(240)
@pytest.mark.full  # ~12 s of CLI processes: make test meets exit 2 in tests/unit/test_cli_errors.py
def test_subprocess_no_traceback_for_hostile_input(tmp_path):
    """The regressions above as a user meets them: exit 2, one line, no traceback."""
    env = dict(os.environ, PYTHONPATH=REPO)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(GOOD))
    deep = tmp_path / "deep.yaml"
    deep.write_text("model: " + "[" * 5000 + "]" * 5000 + "\n")
    (tmp_path / "afile").write_text("not a checkpoint")
    cases = [["run", str(job), "--set", "tracking.tracking_uri=notascheme::/x"],
             ["run", str(deep)],
             ["resume", str(tmp_path / "afile")]]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for argv in cases:
        proc = subprocess.run([sys.executable, "-m", "orchestrator", *argv], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (argv, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("orchestrator:") and "Traceback" not in proc.stderr, proc.stderr
    assert os.listdir(cwd) == []
