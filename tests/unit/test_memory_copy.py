"""checkpoint.in_memory without Ray: where a keeper goes, how a copy in memory is checked before a
run goes on from it, and the Checkpointer handing each checkpoint to memory before storage (the
final one ending the keeper instead). The keeper on real Ray actors: tests/e2e/test_resume_e2e.py."""
import hashlib
import os
import pickle

import pytest
import torch

from orchestrator.persistence.checkpoint import CheckpointStore, decode_payload
from orchestrator.persistence.memory_copy import MemoryCopy, directory_key, keeper_name, pick_node
from orchestrator.persistence.run_state import Checkpointer


def node(node_id, memory, alive=True):
    return {"NodeID": node_id, "Alive": alive, "Resources": {"memory": memory}}


def test_the_keeper_goes_to_the_roomiest_other_node_not_being_drained_else_beside_the_driver():
    nodes = [node("d", 9e9), node("a", 2e9), node("b", 4e9), node("c", 8e9, alive=False), node("e", 7e9)]
    assert pick_node(nodes, "d", draining=set()) == "e"
    assert pick_node(nodes, "d", draining={"e"}) == "b"
    assert pick_node(nodes + [node("f", 4e9)], "d", draining={"e"}) == "b"  # a tie: the lower id
    assert pick_node([node("d", 9e9)], "d", draining=set()) is None
    assert pick_node([node("d", 9e9), node("a", 1e9)], "d", draining={"a"}) is None


def test_a_copy_in_memory_is_used_only_when_it_matches_its_sidecar_and_loads_weights_only():
    state = {"model": {"w": torch.arange(4.0)}, "step": 7}
    data, meta = CheckpointStore.serialized(state, step=12, epoch=2, tag="epoch_0002")
    back, why = decode_payload(data, meta)
    assert why == "" and torch.equal(back["model"]["w"], state["model"]["w"]) and back["step"] == 7
    assert decode_payload(data[:-1], meta) == (None, f"{len(data) - 1} bytes, the sidecar says {len(data)} "
                                                     "(truncated or overwritten)")
    flipped = data[:-5] + bytes([data[-5] ^ 1]) + data[-4:]
    assert decode_payload(flipped, meta)[1] == "sha256 differs from the sidecar's (corrupt)"
    evil = pickle.dumps(os.system)  # not a weights-only payload
    refused, why = decode_payload(evil, {**meta, "bytes": len(evil), "sha256": hashlib.sha256(evil).hexdigest()})
    assert refused is None and why.startswith("torch.load(weights_only=True) refused it")


def test_a_keeper_is_named_by_its_checkpoint_directory_wherever_the_driver_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    here = directory_key("runs/checkpoints/nightly")
    assert here == f"{tmp_path}/runs/checkpoints/nightly" == directory_key(f"{tmp_path}/runs/checkpoints/nightly/")
    assert directory_key("s3://bucket/ck/n/") == "s3://bucket/ck/n"
    assert keeper_name(here) == keeper_name(f"{tmp_path}/runs/checkpoints/nightly") != keeper_name("s3://bucket/ck/n")


class RecordingCopy(MemoryCopy):
    """A MemoryCopy that records what the Checkpointer hands it (test-only) instead of calling a keeper."""

    def __init__(self, directory, keep_s, log):
        super().__init__(directory, keep_s)
        self.log = log

    def hold(self, meta, data):
        stored = os.path.exists(os.path.join(self.directory, meta["name"]))
        self.log.append(("hold", meta["name"], stored, decode_payload(data, meta)[0]["step"]))
        return {"in_memory": "node-x"}

    def release(self):
        self.log.append(("release",))
        return {}


def test_a_background_checkpoint_is_in_memory_before_it_is_stored_and_the_final_one_ends_the_keeper(tmp_path, monkeypatch):
    log = []
    monkeypatch.setattr("orchestrator.persistence.run_state.MemoryCopy",
                        lambda directory, keep_s: RecordingCopy(directory, keep_s, log))
    ck = Checkpointer(str(tmp_path), keep=3, run_name="r", in_memory_keep_s=60.0)
    ck.write({"step": 5, "model": {}}, "epoch_0001", 5, 1, "mlflow-id", wait=False)
    ck.drain(30)
    ck.write({"step": 7, "model": {}}, "interrupted", 7, 1, "mlflow-id", named="interrupted.pt")  # waited on
    ck.write({"step": 9, "model": {}, "finished": True}, "final", 9, 2, "mlflow-id", named="model.pt")
    assert log == [("hold", "ckpt-000000005-epoch_0001.pt", False, 5),  # in memory before storage
                   ("hold", "ckpt-000000007-interrupted.pt", True, 7),  # one the run waits on: storage first
                   ("release",)]
    assert ck.memory.directory == f"{tmp_path}/r"
    outcomes = ck.written()
    assert outcomes[0].fields["in_memory"] == outcomes[1].fields["in_memory"] == "node-x"
    assert "in_memory" not in outcomes[2].fields
    assert CheckpointStore(str(tmp_path), "r", keep=3).latest_good()[1]["step"] == 9  # stored as without memory
    plain = Checkpointer(str(tmp_path), keep=3, run_name="q")
    plain.write({"step": 1, "model": {}}, "epoch_0001", 1, 1, "mlflow-id")
    assert plain.memory is None and "in_memory" not in plain.written()[0].fields


def test_a_run_goes_on_from_memory_only_from_its_own_run_at_least_as_new_as_storage(tmp_path, monkeypatch):
    """resume.newer_in_memory's decisions, the keeper's lookup (`memory_copy.look`, which needs
    Ray) replaced by what a keeper would answer: its sidecar judged before its bytes are fetched."""
    from orchestrator.config import JobConfig
    from orchestrator.errors import ConfigError
    from orchestrator.persistence.resume import newer_in_memory

    config = JobConfig.from_dict({"run": {"name": "nightly"}, "checkpoint": {"storage": str(tmp_path),
                                                                            "in_memory": True}})
    held = {"model": {}, "step": 7, "epoch": 2, "mlflow_run_id": "run-a", "config": config.model_dump(mode="json"),
            "run": {}}
    fetched, asked = [], []

    def keeper(state, step):
        def look(directory, wanted=lambda meta: ""):
            asked.append(directory)
            meta = {"name": CheckpointStore.name_for(step, "epoch_0002"), "step": step, "node_id": "abcdef0123456789"}
            why = wanted(meta)
            if why:
                return None, None, why
            fetched.append(step)
            return meta, state, ""
        monkeypatch.setattr("orchestrator.persistence.memory_copy.look", look)

    stored_path = f"{tmp_path}/nightly/{CheckpointStore.name_for(40, 'epoch_0001')}"
    stored = {**held, "epoch": 1}
    keeper(held, 80)
    where, state, why = newer_in_memory(config, stored_path, stored)
    assert where == "memory:ckpt-000000080-epoch_0002.pt@node abcdef012345" and why == ""
    assert state["from_memory"] == where and asked == [f"{tmp_path}/nightly"]
    assert newer_in_memory(config, None)[1] is not None  # the store has none: the copy is what there is

    keeper(held, 20)  # older than storage's step 40: not even fetched
    assert newer_in_memory(config, stored_path, stored)[2].startswith("the store's ckpt-000000040-epoch_0001.pt is newer")
    assert fetched == [80, 80]

    keeper({**held, "mlflow_run_id": "run-b"}, 80)  # another run's copy under the same directory
    assert "is of MLflow run run-b, the store's checkpoints of run-a" in newer_in_memory(config, stored_path, stored)[2]

    keeper({**held, "finished": True}, 80)
    with pytest.raises(ConfigError, match="run nightly already finished"):
        newer_in_memory(config, stored_path, stored)
    keeper({**held, "config": {**held["config"], "optimizer": {**held["config"]["optimizer"], "lr": 0.5}}}, 80)
    with pytest.raises(ConfigError, match="started with another config"):
        newer_in_memory(config, stored_path, stored)
