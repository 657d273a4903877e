"""The partition server's journal, without Ray: a server started on the journal its dead
predecessor left goes on from the same ledger, and a call sent again (same id) is applied once,
so an epoch is still served exactly once when the server dies between any two calls."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from actors.partitions.server import PartitionServer

Server = PartitionServer.__ray_actor_class__  # the class itself: its methods run in this process

ROWS = [10] * 12


def fresh(path, generation=0, replicas=2, pinned=False):
    return Server(ROWS, replicas, 7, pinned, True, 2, journal=str(path), generation=generation)


def test_a_rebuilt_server_goes_on_from_the_journal(tmp_path):
    path = tmp_path / "ledger.pkl"
    one = fresh(path)
    one.start_epoch(1, [0, 1], call=1)
    got = one.grant(0, [], 1, caller="a:1")
    two = fresh(path, generation=1)  # the first one's process died here
    assert two.status() == replace(one.status(), generation=1)
    assert two.ledger.leased == one.ledger.leased and list(two.ledger.queues[-1]) == list(one.ledger.queues[-1])
    assert two.grant(0, [], 1, caller="a:1") == got  # the call sent again: the same answer, nothing leased twice
    assert two.ledger.leased == one.ledger.leased


def test_a_driver_call_sent_again_is_applied_once(tmp_path):
    path = tmp_path / "ledger.pkl"
    one = fresh(path)
    one.start_epoch(1, [0, 1], call=1)
    held = sorted(p for p, r in one.ledger.leased.items() if r == 1)
    assert one.release(1, [0], call=2) == held
    two = fresh(path, generation=1)
    assert two.release(1, [0], call=2) == held  # answered from the journal, not released twice
    assert two.ledger.redone == one.ledger.redone
    two.start_epoch(1, [0, 1], call=1)  # the epoch's start sent again: it is not begun twice
    assert two.ledger.redone == one.ledger.redone


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("pinned", [False, True])
def test_deaths_between_any_calls_still_serve_each_partition_once(tmp_path, seed, pinned):
    """Two replicas read three epochs; the server dies at random points (before or after it
    answered a call); every call is sent again to the next incarnation; each epoch serves every
    partition exactly once."""
    rng = random.Random(seed)
    path = tmp_path / "ledger.pkl"
    gen = 0
    server = fresh(path, pinned=pinned)
    served = []

    def send(method, *args, **kwargs):
        nonlocal server, gen
        if rng.random() < 0.2:  # died before the call arrived
            gen += 1
            server = fresh(path, gen, pinned=pinned)
        answer = getattr(server, method)(*args, **kwargs)
        if rng.random() < 0.2:  # died after answering, before the caller read it: sent again
            gen += 1
            server = fresh(path, gen, pinned=pinned)
            again = getattr(server, method)(*args, **kwargs)
            assert again == answer
        return answer

    calls = iter(range(1, 10_000))
    for epoch in (1, 2, 3):
        firsts = send("start_epoch", epoch, [0, 1], None, call=next(calls))
        todo = {r: [x["partition"] for x in firsts[r]["leases"]] for r in (0, 1)}
        last = {r: firsts[r]["last"] for r in (0, 1)}
        done = {0: [], 1: []}
        seen = []
        while any(todo.values()) or not all(last.values()):
            r = rng.choice([r for r in (0, 1) if todo[r] or not last[r]])
            if todo[r]:
                p = todo[r].pop(0)
                seen.append(p)
                done[r].append(p)
                continue
            g = send("grant", r, done[r], epoch, caller=f"reader{r}:{next(calls)}")
            done[r] = []
            todo[r] = [x["partition"] for x in g["leases"]]
            last[r] = g["last"] or not g["leases"]
        status = send("finish", done, call=next(calls))
        assert status.complete, status
        assert sorted(seen) == list(range(len(ROWS)))
        served.append(seen)
    assert gen > 0


def test_each_call_is_journaled_once_with_its_answer(tmp_path, monkeypatch):
    """The change a call makes and its answer reach the journal in one write: a server that
    died between two writes would leave a journal whose re-sent grant leases new partitions
    while the first ones stay held by nobody (an epoch that never finishes)."""
    server = fresh(tmp_path / "ledger.pkl")
    writes = []
    real = Server._save

    def save(self):
        writes.append(dict(self.answered))
        real(self)
    monkeypatch.setattr(Server, "_save", save)
    server.start_epoch(1, [0, 1], call=1)
    server.grant(0, [], 1, caller="a:1")
    assert len(writes) == 2
    assert "driver:1" in writes[0] and writes[1]["rank:0"][0] == "a:1"
