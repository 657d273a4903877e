"""Finding the checkpoint a resume starts from, without Ray."""
import pytest
import torch

from orchestrator.persistence.checkpoint import CheckpointStore
from orchestrator.config import JobConfig
from orchestrator.errors import ConfigError
from orchestrator.persistence.resume import find_checkpoint


def state(step, config):
    return {"model": {"w": torch.ones(2) * step}, "optimizer": None, "step": step, "epoch": step // 10,
            "mlflow_run_id": "run1", "config": config, "run": {"totals": {"epochs": step // 10}}}


def test_the_newest_good_checkpoint_is_found_and_a_truncated_one_skipped(tmp_path):
    config = JobConfig.from_yaml("examples/mnist_phases.yaml").model_dump(mode="json")
    store = CheckpointStore(str(tmp_path), "run1", keep=5)
    store.save(state(10, config), step=10, epoch=1, tag="epoch_0001")
    newest = store.save(state(20, config), step=20, epoch=2, tag="epoch_0002")
    with open(newest, "r+b") as f:  # a crash mid-write: half the payload
        f.truncate(f.seek(0, 2) // 2)
    path, found, skipped = find_checkpoint(str(tmp_path / "run1"))
    assert found["step"] == 10 and path.endswith("epoch_0001.pt")
    assert [name for name, _ in skipped] == ["ckpt-000000020-epoch_0002.pt"]
    # the config a run in phases was saved with loads back as it was given
    assert JobConfig.from_dict(found["config"]).strategy.modes() == ["downpour", "allreduce", "easgd"]


def test_nothing_to_resume_from_is_one_clear_line(tmp_path):
    (tmp_path / "run2").mkdir()
    with pytest.raises(ConfigError, match="no usable checkpoint in .*run2 \\(none written\\)"):
        find_checkpoint(str(tmp_path / "run2"))
    with pytest.raises(ConfigError, match="neither a checkpoint directory nor an MLflow run id"):
        find_checkpoint("0123456789abcdef", f"sqlite:///{tmp_path}/mlflow.db")


def named(tmp_path, name="nightly", *overrides):
    return JobConfig.from_yaml("examples/mnist_allreduce.yaml",
                               [f"checkpoint.storage={tmp_path}", f"run.name={name}", *overrides])


def test_a_named_run_without_checkpoints_starts_and_one_with_them_goes_on_from_the_newest(tmp_path):
    from orchestrator.persistence.resume import named_checkpoint

    config = named(tmp_path)
    assert named_checkpoint(config) == (None, None, [])  # a new name: a fresh run
    store = CheckpointStore(str(tmp_path), "nightly", keep=5)
    saved = config.model_dump(mode="json")
    store.save(state(10, saved), step=10, epoch=1, tag="epoch_0001")
    store.save(state(20, saved), step=20, epoch=2, tag="epoch_0002")
    path, found, skipped = named_checkpoint(config)
    assert found["step"] == 20 and path.endswith("epoch_0002.pt") and skipped == []
    # other stop rules are allowed (train longer), and a copy in memory or none; the same name is the same directory
    assert named_checkpoint(named(tmp_path, "nightly", "stop.epochs=30"))[1]["step"] == 20
    assert named_checkpoint(named(tmp_path, "nightly", "checkpoint.in_memory=true"))[1]["step"] == 20
    assert named_checkpoint(named(tmp_path, "other")) == (None, None, [])


def test_a_named_run_refuses_a_finished_run_and_a_changed_config_naming_the_keys(tmp_path):
    from orchestrator.persistence.resume import named_checkpoint

    config = named(tmp_path)
    store = CheckpointStore(str(tmp_path), "nightly", keep=5)
    store.save(state(10, config.model_dump(mode="json")), step=10, epoch=1, tag="epoch_0001")
    with pytest.raises(ConfigError, match=r"optimizer.lr 0.05 -> 0.1.*only stop.\* and checkpoint.in_memory\* may change"):
        named_checkpoint(named(tmp_path, "nightly", "optimizer.lr=0.1"))
    store.save({**state(20, config.model_dump(mode="json")), "finished": True}, step=20, epoch=2, tag="final")
    with pytest.raises(ConfigError, match=r"run nightly already finished \(epoch 2, MLflow run run1;.*"
                                          r"nothing is retrained. Give another --name"):
        named_checkpoint(config)


@pytest.mark.parametrize("name", ["", "a/b", "../up", "-flag", "x" * 129, "sp ace"])
def test_a_run_name_that_is_not_one_directory_name_is_refused(name):
    with pytest.raises(ConfigError, match="run.name"):
        JobConfig.from_dict({"run": {"name": name}})
