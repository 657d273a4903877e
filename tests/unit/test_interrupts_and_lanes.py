"""A run's interrupt state is its own, and a call repeated with a timeout costs one thread
however often it times out (pure logic, no Ray)."""
from __future__ import annotations

import threading
import time

import pytest

from orchestrator.checks import Lane
from orchestrator.errors import Interrupts


def test_each_run_has_its_own_interrupt_state():
    a, b = Interrupts(), Interrupts()
    with pytest.raises(KeyboardInterrupt):
        a.handler()
    assert a.seen.is_set() and not b.seen.is_set()  # another trainer in the process is not interrupted


def test_an_interrupt_during_a_whole_fan_out_is_raised_once_the_last_call_is_sent():
    runs, sent = Interrupts(), []
    with pytest.raises(KeyboardInterrupt):
        with runs.whole():
            sent.append(1)
            runs.handler()  # the signal lands between two calls of the fan-out
            sent.append(2)
    assert sent == [1, 2] and runs.seen.is_set()
    with runs.whole():  # handled: the next fan-out goes out undisturbed
        sent.append(3)
    assert sent == [1, 2, 3]


def test_a_lane_reuses_one_thread_and_a_stuck_call_costs_one_thread_however_often_it_is_asked():
    lane = Lane("test")
    before = threading.active_count()
    assert [lane.call(lambda i=i: i * 2, 5, "double") for i in range(50)] == [i * 2 for i in range(50)]
    assert threading.active_count() == before + 1  # one thread for all fifty
    with pytest.raises(ValueError):
        lane.call(lambda: int("x"), 5, "parse")  # the call's own error reaches the caller
    release = threading.Event()
    with pytest.raises(TimeoutError, match="no answer within"):
        lane.call(release.wait, 0.2, "stuck")
    for _ in range(20):  # a poll that keeps asking while the dependency is stuck
        with pytest.raises(TimeoutError, match="has not returned yet"):
            lane.call(lambda: 1, 0.2, "look")
    assert threading.active_count() == before + 1
    release.set()
    deadline = time.monotonic() + 5
    while True:  # the stuck call returns on its own; the lane serves again
        try:
            assert lane.call(lambda: "ok", 5, "look") == "ok"
            break
        except TimeoutError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
