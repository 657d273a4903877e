"""The scaling poll's failures (orchestrator/control/reconfig/elastic.py: Elasticity.tick), without
Ray: the run's real context and Elasticity, whose look at the cluster goes through a lane that
fails as told (test-only). Each distinct failure is said once, an event and a line; training goes
on; a programming error of ours is raised, not swallowed."""
import time
import types

import pytest

from orchestrator.checks import Lane
from orchestrator.control.context import RunContext
from orchestrator.control.reconfig.elastic import Elasticity
from orchestrator.data.in_memory import load_source
from tests.conftest import job_config


class FailingLane(Lane):
    """The cluster's lane, each call failing with the next queued error (test-only: `fail_with`)."""

    def __init__(self) -> None:
        super().__init__("the cluster")
        self.errors: list[BaseException] = []

    def fail_with(self, *errors: BaseException) -> None:
        self.errors.extend(errors)

    def call(self, fn, timeout_s, what):
        raise self.errors.pop(0)


class Heard:
    """What the run reports: its events (a callback) and its lines (the display)."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.lines: list[str] = []

    def on_event(self, event):
        self.events.append(event)

    def line(self, text):
        self.lines.append(text)


def elasticity() -> tuple[Elasticity, FailingLane, Heard]:
    cfg = job_config(scaling={"poll_s": 1e-6})  # every tick polls
    run = RunContext(cfg, load_source(cfg.data.source, cfg.data.seed), None, time.perf_counter())
    heard = Heard()
    run.report.callbacks.append(heard)
    run.report.display = heard
    elastic = Elasticity(cfg.scaling, cfg.data, run.fleet.group, run.fleet.pause, run.fleet.drains, run.report,
                         run.ledger.progress)
    elastic.lane = FailingLane()
    return elastic, elastic.lane, heard


def test_each_distinct_failure_of_the_look_at_the_cluster_is_said_once_and_training_goes_on():
    elastic, lane, heard = elasticity()
    timeout = TimeoutError("the Ray cluster's resources: no answer within 10s")
    lane.fail_with(timeout, TimeoutError(str(timeout)), ConnectionError("the GCS at 10.0.0.1:6379 does not answer"),
                   TimeoutError(str(timeout)))
    for _ in range(4):
        elastic.tick()
        time.sleep(1e-4)
    failed = [e for e in heard.events if e["kind"] == "scaling_poll_failed"]
    assert [e["error"] for e in failed] == [f"TimeoutError: {timeout}",
                                            "ConnectionError: the GCS at 10.0.0.1:6379 does not answer"]
    assert len([line for line in heard.lines if "the GCS" in line or "no answer within 10s" in line]) == 2


def test_a_programming_error_in_the_poll_is_raised_not_swallowed():
    elastic, lane, heard = elasticity()
    lane.fail_with(AttributeError("'NoneType' object has no attribute 'members'"))
    with pytest.raises(AttributeError):
        elastic.tick()
    lane.fail_with(TypeError("unsupported operand type(s) for -: 'dict' and 'int'"))
    with pytest.raises(TypeError):
        elastic.tick()


def test_the_elasticity_holds_the_parts_it_uses_not_the_run():
    """No field of the Elasticity, nor of what its fields hold (to depth 3, closures and callable
    objects included: the group's on_wait, the pause gate's server), is the run's context: it is
    given the scaling and data sections, the group, the pause gate, the drain watch, the reporter
    and the progress dict."""
    from orchestrator.control.controller import Controller
    from orchestrator.reporting.tracking import Tracker

    cfg = job_config()
    ctl = Controller(cfg, load_source(cfg.data.source, cfg.data.seed), Tracker(None, "tests", None), time.perf_counter())
    elastic = ctl.context.fleet.elastic  # as the controller wires it (the group's on_wait set)
    assert elastic.group.on_wait is not None and elastic.pause is ctl.context.fleet.pause

    def reaches_run(obj, depth: int) -> list[str]:
        if isinstance(obj, RunContext):
            return [type(obj).__name__]
        if depth == 0 or isinstance(obj, (type, types.ModuleType)):
            return []
        if isinstance(obj, types.FunctionType):  # a closure: what its cells hold (the group's on_wait)
            values = [c.cell_contents for c in obj.__closure__ or ()]
        elif isinstance(obj, types.MethodType):
            values = [obj.__self__]
        else:
            values = (obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple, set))
                      else vars(obj).values() if hasattr(obj, "__dict__") else ())
        return [path for v in list(values) for path in reaches_run(v, depth - 1)]

    assert not hasattr(elastic, "run")
    assert reaches_run(elastic, 3) == []
