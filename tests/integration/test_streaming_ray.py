"""A file source streamed on real Ray: the driver only plans it, each replica reads its granted
partitions on its own node; every train row once per epoch and no test row trained on; a file
that turns out unreadable mid-epoch fails the run with an error naming it."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from orchestrator.errors import TrainingError
from orchestrator.trainer import ElasticTrainer
from tests.integration.test_loader_ray import blob_job, expected_ids, ids_of

pytestmark = pytest.mark.ray


def write_blobs(directory, files=3, rows_per_file=400, row_group=90):
    """4-class blobs with an id column, several files of several row groups each (the last
    row group of each file is short, so partitions start and end inside row groups)."""
    directory.mkdir(exist_ok=True)
    rng = np.random.default_rng(1)
    n, dim = files * rows_per_file, 8
    y = rng.integers(0, 4, n)
    x = (rng.normal(size=(n, dim)) + 3 * np.eye(4, dim)[y]).astype(np.float32)
    table = pa.table({"row_id": np.arange(70_000, 70_000 + n), "label": y,
                      "features": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), dim)})
    paths = []
    for i in range(files):
        paths.append(directory / f"part-{i}.parquet")
        pq.write_table(table.slice(i * rows_per_file, rows_per_file), paths[-1], row_group_size=row_group)
    return paths


def test_allreduce_streams_every_train_row_once_and_no_test_row(ray_cluster, tmp_path):
    d = tmp_path / "blobs"
    write_blobs(d)
    cfg = blob_job(d, data={"partitions": 6, "prefetch_partitions": 1}, stop={"epochs": 2},
                   scaling={"replicas": 2, "cpus_per_replica": 0.5}, checkpoint={"storage": str(tmp_path / "ck")})
    trainer = ElasticTrainer(cfg, show_progress=False)
    trainer._trace_ids = True
    train_ids, test_ids = expected_ids(d, cfg)
    planned = trainer.check()
    assert planned.train_rows == len(train_ids) and planned.test_rows == len(test_ids)
    result = trainer.fit()
    for epoch in trainer.controller.consumed:
        assert ids_of(epoch) == train_ids  # every train row exactly once
        assert set(ids_of(epoch)).isdisjoint(test_ids)  # and never a test row
    assert result.rows_per_epoch == [len(train_ids)] * 2
    assert result.final.test_accuracy > 0.9


def test_a_file_unreadable_mid_epoch_fails_the_run_naming_it(ray_cluster, tmp_path):
    d = tmp_path / "blobs"
    paths = write_blobs(d)
    cfg = blob_job(d, data={"partitions": 6}, stop={"epochs": 1},
                   scaling={"replicas": 2, "cpus_per_replica": 0.5, "min_replicas": 2},
                   fault_tolerance={"max_replica_restarts": 0}, checkpoint={"storage": str(tmp_path / "ck")})
    trainer = ElasticTrainer(cfg, show_progress=False)
    trainer.check()  # planned from the footers while the files were whole
    paths[2].write_bytes(b"not parquet any more" * 100)  # then the last file is overwritten
    with pytest.raises(TrainingError) as exc:
        trainer.fit()
    message = str(exc.value)
    assert f"data.source: cannot read {paths[2]}" in message, message
    assert "Traceback" not in message.splitlines()[0]
