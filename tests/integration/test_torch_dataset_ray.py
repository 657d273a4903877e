"""A map-style torch Dataset on real Ray: `ElasticTrainer(config, data=dataset)` with a dataset
that decodes each sample from its own file, read by the replicas' read tasks on their nodes
(threads calling __getitem__), learns, and every train index is used exactly once per epoch."""
from __future__ import annotations

import numpy as np
import pytest

from orchestrator.trainer import ElasticTrainer
from tests.conftest import job_config
from tests.integration.test_loader_ray import ids_of
from tests.torch_datasets import DigitFiles, write_digit_files

pytestmark = pytest.mark.ray


def test_a_torch_dataset_of_files_learns_and_uses_every_index_once_per_epoch(ray_cluster, tmp_path):
    labels = write_digit_files(tmp_path / "digits", 600)  # 600 8x8 digits, one .npy file each
    dataset = DigitFiles(tmp_path / "digits")  # pickled as its directory: each file is read in __getitem__
    epochs = 8
    cfg = job_config(model={"factory": "examples.models:mnist_mlp", "kwargs": {"in_features": 64, "hidden": 64}},
                     data={"batch_size": 16, "partitions": 6, "prefetch_partitions": 1, "loader_workers": 2},
                     optimizer={"lr": 0.05}, stop={"epochs": epochs},
                     scaling={"replicas": 2, "cpus_per_replica": 0.5}, checkpoint={"storage": str(tmp_path / "ck")})
    trainer = ElasticTrainer(cfg, show_progress=False, data=dataset)
    trainer._trace_ids = True
    planned = trainer.check()
    train_ids = sorted(planned.train_plan.items.indices.tolist())
    test_ids = sorted(planned.test_plan.items.indices.tolist())
    assert len(train_ids) == 480 and len(test_ids) == 120 and sorted(train_ids + test_ids) == list(range(600))
    assert planned.num_classes == int(labels.max()) + 1 == 10
    result = trainer.fit()
    assert len(trainer.controller.consumed) == epochs
    for epoch in trainer.controller.consumed:
        assert ids_of(epoch) == train_ids  # every train index exactly once: none missed, none twice
    assert trainer.controller.consumed[0] != trainer.controller.consumed[1]  # reshuffled every epoch
    assert result.rows_per_epoch == [480] * epochs
    assert result.final.test_accuracy >= 0.8, result.final  # ~0.92-0.95 when trained alone in one process
    assert np.isfinite(result.final.train_loss)
