"""Finding the checkpoint a resume starts from, without Ray."""
import pytest
import torch

from orchestrator.checkpoint import CheckpointStore
from orchestrator.config import JobConfig
from orchestrator.errors import ConfigError
from orchestrator.resume import find_checkpoint


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
