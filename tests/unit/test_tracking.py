"""Tracking: events reach the MLflow run as they happen; a slow or failing store never stalls
or crashes the run; ending a run is bounded in time."""
import json
import threading
import time

from mlflow.tracking import MlflowClient

from orchestrator.reporting.tracking import Tracker


def events_in_run(uri, run_id, tmp_path):
    path = MlflowClient(uri).download_artifacts(run_id, "events.jsonl", str(tmp_path / f"dl{time.monotonic_ns()}"))
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_events_are_in_the_run_as_they_happen(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri, "events", None)
    t0 = time.perf_counter()
    tracker.event("started", t0, replicas=2)
    assert tracker.flush(10)
    assert [e["kind"] for e in events_in_run(uri, tracker.run_id, tmp_path)] == ["started"]
    tracker.event("epoch_end", t0, epoch=1)
    assert tracker.flush(10)
    assert [e["kind"] for e in events_in_run(uri, tracker.run_id, tmp_path)] == ["started", "epoch_end"]
    assert MlflowClient(uri).get_run(tracker.run_id).info.status == "RUNNING"
    tracker.event("ended", t0, status="KILLED")
    assert tracker.finish("KILLED", timeout_s=10)
    assert MlflowClient(uri).get_run(tracker.run_id).info.status == "KILLED"
    assert events_in_run(uri, tracker.run_id, tmp_path)[-1] == {**tracker.events[-1], "status": "KILLED"}


class Flaky:
    """An MlflowClient stand-in whose writes fail or hang."""

    def __init__(self, client, hang: threading.Event):
        self.client, self.hang, self.calls = client, hang, []
        self.ending, self.ended = threading.Event(), threading.Event()  # set_terminated called, returned

    def log_text(self, *a, **k):
        self.calls.append("log_text")
        raise ConnectionError("store went away")

    def log_batch(self, *a, **k):
        self.calls.append("log_batch")
        raise ConnectionError("store went away")

    def set_terminated(self, *a, **k):
        self.ending.set()
        self.hang.wait(30)  # until the test lets it go (30 s: a guard, should the test fail first)
        self.ended.set()


def test_a_failing_or_hanging_store_never_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    warnings = []
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "flaky", None, warn=warnings.append)
    hang = threading.Event()
    tracker.client = Flaky(tracker.client, hang)
    t0 = time.perf_counter()
    for epoch in range(3):  # none of these raises
        tracker.log_metrics([("test_accuracy", 0.5, epoch)])
        tracker.event("epoch_end", t0, epoch=epoch)
    tracker.log_text("x", "result.json")
    assert tracker.flush(10)
    assert len(tracker.events) == 3 and "log_batch" in tracker.client.calls
    kinds = sorted(w.split(":")[1].strip() for w in warnings)
    assert kinds == ["events.jsonl", "metrics", "result.json"], warnings  # each kind reported once
    assert tracker.finish("KILLED", timeout_s=0.5) is False  # the store hangs: the caller does not
    flaky = tracker.client
    # finish() came back while the store still held the call: it did not wait for the store
    assert flaky.ending.wait(30), "set_terminated was never called"
    assert not flaky.ended.is_set(), "finish() returned only once the hanging store let go"
    assert any("ending the run as KILLED" in w for w in warnings)
    hang.set()
    assert flaky.ended.wait(30), "the call did not go on in the background"  # the write is not abandoned


def test_a_sqlite_stores_artifacts_go_beside_it(tmp_path):
    """A new experiment in a sqlite store keeps its artifacts in mlruns/ beside the database,
    not in the working directory (MLflow's default), so a store in a temporary directory leaves
    nothing behind elsewhere."""
    from orchestrator.reporting.tracking import Tracker, artifacts_beside

    assert artifacts_beside(f"sqlite:///{tmp_path}/m.db", "my exp") == (tmp_path / "mlruns" / "my_exp").as_uri()
    assert artifacts_beside("http://127.0.0.1:5000", "x") is None
    tracker = Tracker(f"sqlite:///{tmp_path}/m.db", "beside", None)
    tracker.log_text("hello", "note.txt")
    tracker.finish("FINISHED")
    assert (tmp_path / "mlruns" / "beside" / tracker.run_id / "artifacts" / "note.txt").read_text() == "hello"
