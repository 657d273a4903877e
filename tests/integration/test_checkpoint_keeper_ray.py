"""The checkpoint keeper (checkpoint.in_memory) on real Ray actors: a checkpoint handed to it comes
back whole through the lookup a run started again makes, a keeper that died (its process
SIGKILLed, as a lost node does) is made again at the next checkpoint, one nobody touches ends itself
after keep_s, and release ends it. A run going on from a keeper's copy: tests/e2e/test_resume_e2e.py."""
from __future__ import annotations

import time

import pytest
import ray
import torch

from actors.checkpoints.keeper import NAMESPACE
from orchestrator.persistence.checkpoint import CheckpointStore
from orchestrator.persistence.memory_copy import MemoryCopy, keeper_name, look
from orchestrator.testing.chaos import kill_process

pytestmark = pytest.mark.ray


def alive(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
        return True
    except ValueError:
        return False


def gone_within(name: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(name) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not alive(name)


def test_a_keeper_gives_back_what_it_holds_is_made_again_after_a_kill_and_ends_unheard_or_released(ray_cluster, tmp_path):
    directory = f"{tmp_path}/run"
    copy = MemoryCopy(directory, keep_s=3600.0)
    assert look(directory) == (None, None, "no checkpoint keeper")
    state = {"model": {"w": torch.arange(6.0)}, "step": 3}
    data, meta = CheckpointStore.serialized(state, step=30, epoch=1, tag="epoch_0001")
    held = copy.hold(meta, data)
    assert held == {"in_memory": ray.get_runtime_context().get_node_id()}  # one node: beside the driver
    back_meta, back, why = look(directory)
    assert why == "" and back_meta["name"] == meta["name"] and torch.equal(back["model"]["w"], state["model"]["w"])

    kill_process(copy.keeper)  # SIGKILL, as a lost node does
    assert gone_within(keeper_name(directory), 60)
    data2, meta2 = CheckpointStore.serialized({**state, "step": 4}, step=40, epoch=2, tag="epoch_0002")
    assert "in_memory" in copy.hold(meta2, data2)  # the dead one noticed, a new one made
    assert look(directory)[1]["step"] == 4
    copy.release()
    assert gone_within(keeper_name(directory), 60) and look(directory)[2] == "no checkpoint keeper"

    lonely = MemoryCopy(f"{tmp_path}/lonely", keep_s=1.0)
    lonely.hold(meta, data)
    lonely.close()  # its driver is gone: nobody touches it any more
    assert gone_within(keeper_name(f"{tmp_path}/lonely"), 60)


def test_a_keeper_that_stops_answering_is_ended_and_never_holds_up_storage(ray_cluster, tmp_path, monkeypatch):
    """A keeper alive but silent (its process SIGSTOPped, as a frozen node leaves it): a hand-over
    not answered in time says so and ends that keeper, and the next checkpoint's hand-over makes
    a new one that holds it (before, the same silent keeper was found again by its name and every
    checkpoint waited the whole timeout). A hand-over waiting on a silent keeper when a
    checkpoint the run waits on comes (`hurry`: the interrupted one) stops waiting at once
    instead of after its timeout, and that keeper is ended too."""
    import signal
    import threading

    from orchestrator.persistence import memory_copy

    directory = f"{tmp_path}/silent"
    copy = MemoryCopy(directory, keep_s=3600.0)
    state = {"model": {"w": torch.arange(4.0)}, "step": 1}
    data, meta = CheckpointStore.serialized(state, step=10, epoch=1, tag="epoch_0001")
    assert "in_memory" in copy.hold(meta, data)
    monkeypatch.setattr(memory_copy, "CALL_TIMEOUT_S", 3.0)
    kill_process(copy.keeper, signal.SIGSTOP)
    data2, meta2 = CheckpointStore.serialized({**state, "step": 2}, step=20, epoch=2, tag="epoch_0002")
    out = copy.hold(meta2, data2)
    assert "did not answer in 3s: ended" in out.get("in_memory_failed", ""), out
    assert copy.keeper is None and gone_within(keeper_name(directory), 60)
    data3, meta3 = CheckpointStore.serialized({**state, "step": 3}, step=30, epoch=3, tag="epoch_0003")
    assert "in_memory" in copy.hold(meta3, data3)  # a new keeper, not the silent one found again
    assert look(directory)[1]["step"] == 3

    monkeypatch.setattr(memory_copy, "CALL_TIMEOUT_S", 3600.0)  # only hurry ends the next wait
    kill_process(copy.keeper, signal.SIGSTOP)
    outcome: dict = {}
    handing = threading.Thread(target=lambda: outcome.update(copy.hold(meta2, data2)), daemon=True)
    handing.start()
    time.sleep(1.0)
    copy.hurry()
    handing.join(60)
    copy.hurry(False)
    assert not handing.is_alive() and "a checkpoint the run waits on came first" in outcome.get("in_memory_failed", ""), outcome
    assert gone_within(keeper_name(directory), 60)
    assert "in_memory" in copy.hold(meta3, data3)
    copy.release()
    assert gone_within(keeper_name(directory), 60)


def test_a_named_run_finishing_without_in_memory_ends_the_keeper_an_earlier_driver_left(ray_cluster, tmp_path):
    """A named run's driver with checkpoint.in_memory on died and left its keeper; the run went on
    with in_memory off and finished: its final checkpoint ends that keeper (before, it lived on for
    in_memory_keep_s, and a later run of the name with in_memory on and no stored checkpoint took
    its stale copy up). A finish with no keeper left says nothing of one."""
    from orchestrator.persistence.memory_copy import directory_key
    from orchestrator.persistence.run_state import Checkpointer

    left = MemoryCopy(directory_key(f"{tmp_path}/nightly"), keep_s=3600.0)
    data, meta = CheckpointStore.serialized({"model": {"w": torch.ones(3)}, "step": 2}, step=20, epoch=1, tag="epoch_0001")
    assert "in_memory" in left.hold(meta, data)
    left.close()  # its driver died: nobody touches it
    name = keeper_name(directory_key(f"{tmp_path}/nightly"))
    assert alive(name)
    ck = Checkpointer(str(tmp_path), keep=3, run_name="nightly")  # the same name, in_memory off
    ck.write({"step": 9, "model": {}, "finished": True}, "final", 9, 2, "mlflow-id", named="model.pt")
    [final] = ck.written()
    assert final.fields["in_memory_released"] and gone_within(name, 60), final
    again = Checkpointer(str(tmp_path), keep=3, run_name="nightly")
    again.write({"step": 10, "model": {}, "finished": True}, "final", 10, 2, "mlflow-id", named="model.pt")
    assert "in_memory_released" not in again.written()[0].fields
