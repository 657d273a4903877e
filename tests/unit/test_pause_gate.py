"""The pause gate without Ray: one reason at a time, each close and open sent to the server once."""
import pytest

from orchestrator.fleet.pause import PauseGate


class Server:
    def __init__(self):
        self.calls = []

    def call(self, method, *args, **kw):
        self.calls.append((method, args, kw))


def test_one_reason_holds_the_gate_and_opening_sends_once():
    server = Server()
    gate = PauseGate(lambda: server)
    assert not gate.closed and gate.close("grow") and gate.reason == "grow"
    assert not gate.close("switch") and gate.reason == "grow"  # a switch waits for the grow's pause to end
    gate.open()
    gate.open()  # already open: nothing sent
    assert server.calls == [("pause", (True,), {}), ("pause", (False,), {})] and gate.reason is None
    gate.open(share=True)  # a switch at an epoch boundary still says how the epoch is leased
    assert server.calls[-1] == ("pause", (False,), {"share": True})
    with pytest.raises(ValueError, match="reason must be one of"):
        gate.close("lunch")
