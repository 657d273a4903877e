"""The checkpoint store (orchestrator/persistence/checkpoint.py) on a local path and a file:// URI, and
when an epoch end checkpoints (policies/decisions/checkpointing.py). No Ray."""
import json
import os

import pytest
import torch

from orchestrator.persistence.checkpoint import CheckpointStore, load_checkpoint
from policies.decisions.checkpointing import due


def state(step):
    return {"model": {"w": torch.full((4, 3), float(step))}, "optimizer": None, "step": step, "epoch": step // 10,
            "mlflow_run_id": "run1", "config": {"checkpoint": {"keep": 3}}}


@pytest.fixture(params=["path", "uri"])
def storage(request, tmp_path):
    root = tmp_path / "ck"
    return str(root) if request.param == "path" else f"file://{root}"


def run_dir(tmp_path):
    return tmp_path / "ck" / "run1"


def test_round_trip(storage, tmp_path):
    store = CheckpointStore(storage, "run1", keep=3)
    path = store.save(state(10), step=10, epoch=1, tag="epoch_0001")
    assert path == f"{storage}/run1/ckpt-000000010-epoch_0001.pt"
    assert sorted(os.listdir(run_dir(tmp_path))) == ["ckpt-000000010-epoch_0001.pt", "ckpt-000000010-epoch_0001.pt.json"]
    meta = json.loads((run_dir(tmp_path) / "ckpt-000000010-epoch_0001.pt.json").read_text())
    assert meta["bytes"] == os.path.getsize(run_dir(tmp_path) / "ckpt-000000010-epoch_0001.pt")
    assert (meta["step"], meta["epoch"], meta["tag"]) == (10, 1, "epoch_0001") and len(meta["sha256"]) == 64
    [entry] = store.list()
    assert (entry.name, entry.step, entry.tag, entry.path) == ("ckpt-000000010-epoch_0001.pt", 10, "epoch_0001", path)
    got, loaded = store.latest_good()
    assert got == path and store.skipped == []
    assert torch.equal(loaded["model"]["w"], state(10)["model"]["w"]) and loaded["mlflow_run_id"] == "run1"
    assert torch.equal(load_checkpoint(path)["model"]["w"], loaded["model"]["w"])  # plain torch.save payloads


def test_an_empty_or_missing_directory_has_no_checkpoint(storage):
    store = CheckpointStore(storage, "run1", keep=3)
    assert store.list() == [] and store.latest_good() is None and store.skipped == []


def test_keep_leaves_the_newest_by_step(storage, tmp_path):
    store = CheckpointStore(storage, "run1", keep=2)
    for step in (30, 10, 20, 40):  # by step, not by the order written
        store.save(state(step), step=step, epoch=step // 10)
    assert [e.step for e in store.list()] == [30, 40]
    assert sorted(os.listdir(run_dir(tmp_path))) == ["ckpt-000000030.pt", "ckpt-000000030.pt.json",
                                                     "ckpt-000000040.pt", "ckpt-000000040.pt.json"]


def test_the_same_step_is_ordered_by_when_it_was_written(storage):
    store = CheckpointStore(storage, "run1", keep=2)
    store.save(state(1), step=50, epoch=5, tag="epoch_0005")
    store.save(state(2), step=50, epoch=5, tag="final")
    store.save(state(3), step=50, epoch=5, tag="interrupted")
    assert [e.tag for e in store.list()] == ["final", "interrupted"]
    path, loaded = store.latest_good()
    assert path.endswith("ckpt-000000050-interrupted.pt") and loaded["step"] == 3


def test_a_truncated_newest_checkpoint_is_skipped(storage, tmp_path):
    store = CheckpointStore(storage, "run1", keep=3)
    older = store.save(state(10), step=10, epoch=1)
    store.save(state(20), step=20, epoch=2)
    newest = run_dir(tmp_path) / "ckpt-000000020.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    path, loaded = store.latest_good()
    assert path == older and loaded["step"] == 10
    [(name, why)] = store.skipped
    assert name == "ckpt-000000020.pt" and "truncated" in why


def test_a_corrupt_checkpoint_of_the_right_length_is_skipped(storage, tmp_path):
    store = CheckpointStore(storage, "run1", keep=3)
    older = store.save(state(10), step=10, epoch=1)
    store.save(state(20), step=20, epoch=2)
    newest = run_dir(tmp_path) / "ckpt-000000020.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    assert store.latest_good()[0] == older
    assert "sha256" in store.skipped[0][1]


def test_a_payload_without_its_sidecar_is_not_trusted(storage, tmp_path):
    store = CheckpointStore(storage, "run1", keep=3)
    older = store.save(state(10), step=10, epoch=1)
    store.save(state(20), step=20, epoch=2)
    os.remove(run_dir(tmp_path) / "ckpt-000000020.pt.json")  # as if the process died between the two writes
    [_, entry] = store.list()
    assert entry.step == 20 and entry.meta is None
    assert store.latest_good()[0] == older
    assert store.skipped == [("ckpt-000000020.pt", "no sidecar ckpt-000000020.pt.json (its write did not finish)")]
    os.remove(run_dir(tmp_path) / "ckpt-000000010.pt.json")
    assert store.latest_good() is None and len(store.skipped) == 2


def test_a_sidecar_of_another_payload_is_not_trusted(storage, tmp_path):
    store = CheckpointStore(storage, "run1", keep=3)
    older = store.save(state(10), step=10, epoch=1)
    store.save(state(20), step=20, epoch=2)
    d = run_dir(tmp_path)
    (d / "ckpt-000000020.pt").write_bytes((d / "ckpt-000000010.pt").read_bytes())
    (d / "ckpt-000000020.pt.json").write_text((d / "ckpt-000000010.pt.json").read_text())
    assert store.latest_good()[0] == older and "not this payload" in store.skipped[0][1]


def test_a_payload_torch_refuses_is_skipped(storage, tmp_path):
    """Length and sha256 match (the sidecar was written for these bytes) but weights_only
    loading refuses the pickle: not trusted."""
    store = CheckpointStore(storage, "run1", keep=3)
    older = store.save(state(10), step=10, epoch=1)
    store.save({"model": object.__new__(Exotic)}, step=20, epoch=2)
    assert store.latest_good()[0] == older
    assert store.skipped[0][0] == "ckpt-000000020.pt" and "weights_only" in store.skipped[0][1]


class Exotic:
    pass


def test_a_temp_file_left_by_a_crash_is_ignored(storage, tmp_path):
    store = CheckpointStore(storage, "run1", keep=1)
    path = store.save(state(10), step=10, epoch=1)
    d = run_dir(tmp_path)
    (d / ".ckpt-000000020.pt.0123456789ab.tmp").write_bytes(b"half a checkpoint")
    (d / "notes.txt").write_text("not a checkpoint")
    assert [e.step for e in store.list()] == [10]
    assert store.latest_good()[0] == path and store.skipped == []
    store.save(state(30), step=30, epoch=3)  # pruning leaves files it does not own alone
    assert sorted(os.listdir(d)) == [".ckpt-000000020.pt.0123456789ab.tmp", "ckpt-000000030.pt",
                                     "ckpt-000000030.pt.json", "notes.txt"]


def test_pruning_removes_orphan_sidecars(storage, tmp_path):
    store = CheckpointStore(storage, "run1", keep=2)
    store.save(state(10), step=10, epoch=1)
    os.remove(run_dir(tmp_path) / "ckpt-000000010.pt")  # a deletion cut short after the payload went
    store.save(state(20), step=20, epoch=2)
    assert sorted(os.listdir(run_dir(tmp_path))) == ["ckpt-000000020.pt", "ckpt-000000020.pt.json"]


def test_names_and_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(str(tmp_path), "run1", keep=0)
    with pytest.raises(ValueError, match="run_name"):
        CheckpointStore(str(tmp_path), "a/b", keep=1)
    store = CheckpointStore(str(tmp_path), "run1", keep=1)
    with pytest.raises(ValueError, match="tag"):
        store.save(state(1), step=1, epoch=0, tag="a-b")
    with pytest.raises(ValueError, match="step"):
        store.save(state(1), step=-1, epoch=0)
    assert not (tmp_path / "run1").exists()


def test_due_every_epochs_or_every_seconds():
    assert not due(1, now_s=100.0, last_s=0.0, every_epochs=0, every_s=0)  # both off
    assert [due(e, 0.0, 0.0, every_epochs=2, every_s=0) for e in (1, 2, 3, 4)] == [False, True, False, True]
    assert not due(1, now_s=9.9, last_s=0.0, every_epochs=0, every_s=10)
    assert due(1, now_s=10.0, last_s=0.0, every_epochs=0, every_s=10)
    assert not due(2, now_s=15.0, last_s=10.0, every_epochs=0, every_s=10)  # measured from the last checkpoint
    assert due(3, now_s=15.0, last_s=10.0, every_epochs=3, every_s=10)  # either rule
