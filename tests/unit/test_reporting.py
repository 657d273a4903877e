"""The run's reporter: callbacks see every event and metric row; a failing callback is dropped,
never the run."""
import time

from orchestrator.reporting.reporter import Reporter


class Recorder:
    def __init__(self):
        self.events, self.rows = [], []

    def on_event(self, event):
        self.events.append(event)

    def on_metrics(self, rows):
        self.rows += rows


class Broken:
    def on_event(self, event):
        raise RuntimeError("callback bug")


def test_callbacks_get_events_and_metrics_and_a_broken_one_is_dropped(capsys):
    reporter = Reporter(None, None, time.perf_counter())
    recorder, broken = Recorder(), Broken()
    reporter.callbacks += [broken, recorder]
    reporter.event("replica_failed", rank=1, cause="died")
    reporter.metrics([("replicas_alive", 2, 10)])
    reporter.event("replica_replaced", ranks=[1])
    assert [e["kind"] for e in recorder.events] == ["replica_failed", "replica_replaced"]
    assert recorder.events[0]["rank"] == 1 and recorder.events[0]["t_wall"] > 0
    assert recorder.rows == [("replicas_alive", 2, 10)]
    assert reporter.callbacks == [recorder]
    assert "callback bug" in capsys.readouterr().err
