"""MLflow tracking from one place (the driver): one run per job, through MlflowClient so a
job never disturbs the caller's active fluent run.

Every write after the run is created goes through one writer thread, in order, so a slow or
failing store never stalls or crashes training: a write that fails is reported once on stderr
and the run goes on. `events.jsonl` is re-logged as each event happens (events are few: start,
one per epoch, checkpoints, stop), so a run that is killed keeps its record.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import queue
import socket
import sys
import threading
import time
from pathlib import Path
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Optional

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from orchestrator.reporting.model_logging import log_pytorch_model
from orchestrator.checks import bounded, one_line, writable_local_dir, writable_local_file
from orchestrator.errors import ConfigError, TrainingError

MAX_BATCH = 900  # MLflow accepts up to 1000 metrics per log_batch
HEALTH_TIMEOUT_S = 3.0  # the check before anything starts
OPEN_TIMEOUT_S = 60.0  # creating the experiment and the run
WRITE_TIMEOUT_S = 60.0  # a write the caller waits for (params, texts)
FILE_TIMEOUT_S = 300.0  # an artifact file (the model)
FINISH_TIMEOUT_S = 60.0  # the writes still queued and the run's end status
DB_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}


def check_store(tracking_uri: Optional[str], field: str = "tracking.tracking_uri") -> None:
    """The tracking store answers (an HTTP server within HEALTH_TIMEOUT_S, a database port) or,
    for a local store (sqlite, file), its directory can be written. ConfigError otherwise (a
    scheme MLflow has no store for, a URI that cannot be parsed); nothing is created."""
    uri = tracking_uri or mlflow.get_tracking_uri()
    field = field if tracking_uri else f"{field} (default {uri})"
    try:
        _check_store(uri, field)
    except ConfigError:
        raise
    except Exception as exc:  # urlparse, sqlalchemy's make_url: a bracket, a port that is not a number
        raise ConfigError(f"config error: {field}: malformed URI {uri!r} ({one_line(exc)})") from None


def _store_scheme(uri: str) -> str:
    """The scheme MLflow picks the store by; ConfigError naming the schemes it has when it has
    no store for it (today such a URI fails only when the run is created)."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    if "\x00" in uri:
        raise ValueError("malformed URI (it holds a NUL byte)")
    try:
        scheme = urllib.parse.urlparse(uri).scheme
    except ValueError as exc:  # an unclosed [ in the host
        raise ValueError(f"malformed URI ({one_line(exc)})") from None
    try:
        _tracking_store_registry.get_store_builder(uri)
    except Exception:
        known = ", ".join(sorted(s for s in _tracking_store_registry._registry if s))
        raise ValueError(f"MLflow has no tracking store for the scheme {scheme!r}; use a local path or one of "
                         f"{known}") from None
    return scheme.lower()


def _check_store(uri: str, field: str) -> None:
    try:
        scheme = _store_scheme(uri)
    except ValueError as exc:
        raise ConfigError(f"config error: {field}: {exc} (got {uri!r})") from None
    backend = scheme.split("+")[0]
    if scheme in ("http", "https"):
        why = _http_unreachable(uri)
        if why:
            raise ConfigError(f"config error: {field}: no MLflow server answers at {uri} ({why})")
    elif backend == "sqlite":
        from sqlalchemy.engine import make_url

        path = make_url(uri).database
        if path and path != ":memory:":
            path = os.path.abspath(path)
            # the directory too: sqlite writes its journal beside the file
            why = writable_local_file(path) or writable_local_dir(os.path.dirname(path))
            if why:
                raise ConfigError(f"config error: {field}: cannot write the MLflow store {uri} ({why})")
    elif scheme in ("", "file"):
        path = urllib.parse.urlparse(uri).path if scheme == "file" else uri
        why = writable_local_dir(path)
        if why:
            raise ConfigError(f"config error: {field}: cannot write the MLflow store {uri} ({why})")
    elif backend in DB_PORTS:
        from sqlalchemy.engine import make_url

        url = make_url(uri)
        host, port = url.host or "localhost", url.port or DB_PORTS[backend]
        try:
            socket.create_connection((host, port), timeout=HEALTH_TIMEOUT_S).close()
        except OSError as exc:
            raise ConfigError(f"config error: {field}: no database answers at {host}:{port} "
                              f"within {HEALTH_TIMEOUT_S:g}s ({exc.strerror or exc})") from None


def store_missing(tracking_uri: Optional[str]) -> Optional[str]:
    """Why a local tracking store (an sqlite file, a file store's directory) is not there, or
    None (it is, or the store is not local). Opening a missing one creates it."""
    uri = tracking_uri or mlflow.get_tracking_uri()
    scheme = urllib.parse.urlparse(uri).scheme.lower()
    if scheme.split("+")[0] == "sqlite":
        from sqlalchemy.engine import make_url

        path = make_url(uri).database
        if path and path != ":memory:" and not os.path.isfile(path):
            return f"no MLflow store at {uri}"
        if not path or path == ":memory:":
            return f"{uri} is an empty in-memory store"
    elif scheme in ("", "file"):
        path = urllib.parse.urlparse(uri).path if scheme == "file" else uri
        if not os.path.isdir(path):
            return f"no MLflow store at {uri}"
    return None


def check_store_to_read(tracking_uri: Optional[str], what: str) -> None:
    """A store runs are only read from, which opening must leave as it is: a local one must be
    there (MLflow creates a missing one) and already be an MLflow store (MLflow would create its
    tables in any other sqlite file, its trash folder in any other directory); any other must
    answer (check_store). ConfigError starting with `what` otherwise; nothing is created."""
    uri = tracking_uri or mlflow.get_tracking_uri()
    why = store_missing(uri)
    scheme = urllib.parse.urlparse(uri).scheme.lower()
    if why is None and scheme.split("+")[0] == "sqlite":
        import sqlite3

        from sqlalchemy.engine import make_url

        try:
            path = urllib.parse.quote(os.path.abspath(make_url(uri).database))
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
                tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.Error as exc:
            tables, why = set(), f"{uri} cannot be read as an MLflow store ({one_line(exc)})"
        if why is None and not {"experiments", "runs", "alembic_version"} <= tables:
            why = f"{uri} is not an MLflow store (it lacks MLflow's tables)"
    elif why is None and scheme in ("", "file"):
        path = urllib.parse.urlparse(uri).path if scheme == "file" else uri
        if not os.path.isdir(os.path.join(path, ".trash")):
            why = f"{uri} is not an MLflow file store (it has no .trash folder)"
    elif why is None:
        check_store(tracking_uri, "--tracking-uri")
    if why:
        raise ConfigError(f"{what}: {why}")


def _http_unreachable(uri: str) -> Optional[str]:
    """None if something answers GET <uri>/health within HEALTH_TIMEOUT_S, else why not."""
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=HEALTH_TIMEOUT_S):
            return None
    except urllib.error.HTTPError as exc:  # it answered; 5xx is a server (or proxy) that cannot serve
        return f"HTTP {exc.code} from /health" if exc.code >= 500 else None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            return f"no answer within {HEALTH_TIMEOUT_S:g}s"
        return getattr(reason, "strerror", None) or str(reason) or type(reason).__name__


class _Writer:
    """One daemon thread that performs the run's writes in the order they were asked for."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._warn = warn
        self._warned: set[str] = set()
        threading.Thread(target=self._loop, name="mlflow writer", daemon=True).start()

    def post(self, what: str, fn: Callable[[], Any]) -> threading.Event:
        done = threading.Event()
        self._jobs.put((what, fn, done))
        return done

    def call(self, what: str, fn: Callable[[], Any], timeout_s: float) -> bool:
        """Post and wait up to timeout_s; False (and a warning) when it has not happened by then."""
        if self.post(what, fn).wait(timeout_s):
            return True
        self._say(what, f"MLflow did not answer within {timeout_s:g}s; it is still tried in the background")
        return False

    def _loop(self) -> None:
        while True:
            what, fn, done = self._jobs.get()
            try:
                fn()
            except Exception as exc:  # a tracking hiccup never ends the run
                self._say(what, one_line(exc)[:300])
            finally:
                done.set()

    def _say(self, what: str, why: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            self._warn(f"tracking: {what}: {why}")


def _stderr(line: str) -> None:
    print(f"orchestrator: {line}", file=sys.stderr, flush=True)


def _read_events(client: MlflowClient, run_id: str) -> list[dict[str, Any]]:
    """The events a run's events.jsonl holds (none if it has none)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(run_id, "events.jsonl", tmp)
        except Exception:  # no events were written
            return []
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]


def artifacts_beside(tracking_uri: str, experiment: str) -> Optional[str]:
    """Where a new experiment's artifacts go: for a sqlite file store, a `mlruns` directory beside
    the database (MLflow's own default is `./mlruns` in the working directory, wherever the
    database is); for any other store, its own default (None)."""
    if not tracking_uri.startswith("sqlite:///") or tracking_uri.endswith(":memory:"):
        return None
    path = os.path.abspath(tracking_uri.removeprefix("sqlite:///").split("?")[0])
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in experiment) or "experiment"
    return Path(os.path.dirname(path), "mlruns", slug).as_uri()


class Tracker:
    def __init__(self, tracking_uri: Optional[str], experiment: str, run_name: Optional[str],
                 warn: Callable[[str], None] = _stderr, run_id: Optional[str] = None) -> None:
        """`run_id`: reopen that run (a resumed job): it is marked RUNNING again and its
        events.jsonl is read back, so the events go on after the ones it holds."""
        self.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        self.client = MlflowClient(self.tracking_uri)
        self.resumed = run_id is not None
        previous: list[dict[str, Any]] = []

        def open_run() -> tuple[str, str]:
            if run_id is not None:
                run = self.client.get_run(run_id)
                self.client.update_run(run_id, status="RUNNING")
                previous.extend(_read_events(self.client, run_id))
                return run.info.experiment_id, run_id
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(
                experiment, artifact_location=artifacts_beside(self.tracking_uri, experiment))
            return exp_id, self.client.create_run(exp_id, run_name=run_name).info.run_id

        try:
            self.experiment_id, self.run_id = bounded(open_run, OPEN_TIMEOUT_S, f"MLflow at {self.tracking_uri}")
        except TimeoutError as exc:
            raise TrainingError(f"tracking: {exc}") from None
        self.events: list[dict[str, Any]] = previous
        self._writer = _Writer(warn)
        self._events_written = len(previous)  # how many of self.events the run's events.jsonl holds
        self.mirror: Any = None  # tracking.tensorboard: the same scalars to TensorBoard (mirror_to)

    def mirror_to(self, mirror: Any) -> None:
        """Also write every metric row to `mirror` (scalars(rows), close() when the run ends),
        in the writer thread, after the row's MLflow write."""
        self.mirror = mirror

    def log_params(self, params: dict[str, Any]) -> None:
        items = [Param(k, json.dumps(v) if isinstance(v, (list, dict)) else str(v)) for k, v in params.items()]
        for i in range(0, len(items), 90):
            chunk = items[i : i + 90]
            self._writer.call("params", lambda c=chunk: self.client.log_batch(self.run_id, params=c), WRITE_TIMEOUT_S)

    def set_tags(self, tags: dict[str, Any]) -> None:
        rows = [RunTag(k, str(v)) for k, v in tags.items()]
        self._writer.call("tags", lambda: self.client.log_batch(self.run_id, tags=rows), WRITE_TIMEOUT_S)

    def log_metrics(self, rows: list[tuple[str, float, int]]) -> None:
        """(key, value, step) rows, batched; written in the background."""
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(s)) for k, v, s in rows]
        for i in range(0, len(metrics), MAX_BATCH):
            chunk = metrics[i : i + MAX_BATCH]
            self._writer.post("metrics", lambda c=chunk: self.client.log_batch(self.run_id, metrics=c))
        if self.mirror is not None:
            self._writer.post("tensorboard", lambda r=list(rows): self.mirror.scalars(r))

    def event(self, kind: str, t0: float, **fields: Any) -> dict[str, Any]:
        """Record an event (for the result) with seconds since fit(); the run's events.jsonl is
        re-logged in the background so it holds every event so far."""
        ev = {"t": round(time.perf_counter() - t0, 3), "kind": kind, **fields}
        self.events.append(ev)
        self._writer.post("events.jsonl", self._write_events)
        return ev

    def _write_events(self) -> None:
        n = len(self.events)
        if n > self._events_written:  # a later event's write already covered this one
            self.client.log_text(self.run_id, "".join(json.dumps(e) + "\n" for e in self.events[:n]), "events.jsonl")
            self._events_written = n

    def log_text(self, text: str, name: str) -> None:
        self._writer.call(name, lambda: self.client.log_text(self.run_id, text, name), WRITE_TIMEOUT_S)

    def log_file(self, path: str, timeout_s: float = FILE_TIMEOUT_S) -> None:
        self._writer.call(os.path.basename(path), lambda: self.client.log_artifact(self.run_id, path), timeout_s)

    def log_dir(self, local: str, artifact_path: str, timeout_s: float = FILE_TIMEOUT_S) -> None:
        """Every file under the local directory `local` as artifacts under `artifact_path`; waits."""
        self._writer.call(artifact_path, lambda: self.client.log_artifacts(self.run_id, local, artifact_path), timeout_s)

    def log_model(self, model: Any, input_example: Any, register_as: Optional[str] = None,
                  timeout_s: float = FILE_TIMEOUT_S) -> bool:
        """The trained model as an MLflow model named `model` (`runs:/<run id>/model`), with
        `input_example` and the signature it implies; registered as `register_as` when given.
        Waits up to timeout_s; True once it is logged. A failure is reported once, like every
        write (model.pt keeps the state either way)."""
        logged: list[bool] = []

        def write() -> None:
            log_pytorch_model(self, model, input_example, register_as)
            logged.append(True)

        self._writer.call("model", write, timeout_s)
        return bool(logged)

    def stored(self) -> threading.Event:
        """Set once every write asked for so far is done (a checkpoint written in the background
        waits for it)."""
        return self._writer.post("flush", lambda: None)

    def flush(self, timeout_s: float = FINISH_TIMEOUT_S) -> bool:
        """Wait up to timeout_s for every write asked for so far."""
        return self._writer.post("flush", lambda: None).wait(timeout_s)

    def finish(self, status: str, timeout_s: float = FINISH_TIMEOUT_S) -> bool:
        """Write what is queued and events.jsonl, then end the run with `status` (FINISHED,
        FAILED, KILLED); waits up to timeout_s (the writes go on in the background after that)."""
        self._writer.post("events.jsonl", self._write_events)
        if self.mirror is not None:
            self._writer.post("tensorboard", self.mirror.close)
        return self._writer.call(f"ending the run as {status}", lambda: self.client.set_terminated(self.run_id, status),
                                 timeout_s)

    def where(self) -> str:
        return f"MLflow run {self.run_id} (experiment {self.experiment_id}) at {self.tracking_uri}"


def environment_tags() -> dict[str, str]:
    import ray
    import torch

    return {"ray_version": ray.__version__, "torch_version": torch.__version__,
            "python_version": platform.python_version(), "host_cpus": str(os.cpu_count())}
