"""The fleet's EpochReader without Ray (orchestrator/fleet/epoch_reader.py): the epoch's open
streams and their hang clocks. Which streams have an item waiting is Ray's `wait`, exercised by
every Ray test that runs an epoch."""
import time

from orchestrator.fleet.epoch_reader import EpochReader


def test_a_member_is_silent_only_while_its_stream_is_open_and_unheard_past_the_limit():
    reader = EpochReader()
    reader.open(0, "stream-0")
    reader.open(1, "stream-1")
    now = time.perf_counter()
    assert reader.silent(5.0, now=now + 1.0) == []
    silent = reader.silent(5.0, now=now + 6.0)
    assert [r for r, _ in silent] == [0, 1] and all(s > 5.0 for _, s in silent)
    reader.ended(1)  # its last item came: no longer read, so never silent
    assert [r for r, _ in reader.silent(5.0, now=now + 6.0)] == [0]
    reader.restart_clocks()  # a state that read no stream (a repair): silence counts from now
    assert reader.silent(5.0, now=time.perf_counter() + 1.0) == []
    reader.lost(0)
    assert reader.streams == {} and 0 not in reader.heard


def test_the_servers_start_call_is_handed_once_and_a_new_epoch_clears_everything():
    reader = EpochReader()
    reader.open(2, "stream-2")
    reader.started = "start_epoch call"
    assert reader.take_started() == "start_epoch call" and reader.take_started() is None
    reader.started = "next"
    reader.clear()
    assert (reader.streams, reader.heard, reader.started) == ({}, {}, None)
