"""The pause gate without Ray: one pause at a time, each close and open sent to the server once."""
from orchestrator.fleet.pause import PauseGate


class Server:
    def __init__(self):
        self.calls = []

    def call(self, method, *args, **kw):
        self.calls.append((method, args, kw))


def test_one_pause_holds_the_gate_and_opening_sends_once():
    server = Server()
    gate = PauseGate(server)
    assert not gate.closed and gate.close() and gate.closed
    assert not gate.close()  # closed already (a switch waits for a grow's pause to end): nothing sent
    gate.open()
    gate.open()  # already open: nothing sent
    assert server.calls == [("pause", (True,), {}), ("pause", (False,), {})] and not gate.closed
    gate.open(share=True)  # a switch at an epoch boundary still says how the epoch is leased
    assert server.calls[-1] == ("pause", (False,), {"share": True})
    assert gate.close(timeout_s=5.0) and server.calls[-1] == ("pause", (True,), {"timeout_s": 5.0})
