"""The partition server on real Ray: every row once per epoch whoever runs or dies (file
sources streamed by the replicas' readers); file, file:// and in-memory sources train alike."""
from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from orchestrator.testing.chaos import Fault, FaultInjector
from orchestrator.control.controller import Controller
from orchestrator.control.states import Errored
from actors.partitions.reading import read_partition
from orchestrator.data.loading import load_dataset
from orchestrator.reporting.tracking import Tracker
from orchestrator.trainer import ElasticTrainer
from tests.conftest import job_config
from tests.integration.test_allreduce_ray import StepWatch

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory):
    """1,500 rows of 4-class blobs with an id column, as three Parquet files."""
    d = tmp_path_factory.mktemp("blobs")
    rng = np.random.default_rng(0)
    n, dim = 1500, 8
    y = rng.integers(0, 4, n)
    x = (rng.normal(size=(n, dim)) + 3 * np.eye(4, dim)[y]).astype(np.float32)
    table = pa.table({"row_id": np.arange(50_000, 50_000 + n), "label": y,
                      "features": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), dim)})
    for i in range(3):
        pq.write_table(table.slice(i * 500, 500), d / f"part-{i}.parquet")
    return d


def blob_job(source, **sections):
    data = {"source": str(source), "id_column": "row_id", "batch_size": 16}
    data.update(sections.pop("data", {}))
    return job_config(model={"factory": "examples.models:tiny_mlp", "kwargs": {"in_features": 8}}, data=data, **sections)


def expected_ids(directory, cfg):
    """The train and test row ids of a Parquet directory planned with cfg.data, worked out here
    from the files (sorted paths, rows in order: the global position) and the row hash alone."""
    from actors.partitions.reading import held_out_mask

    ids = np.concatenate([pq.read_table(p, columns=[cfg.data.id_column]).column(0).to_numpy()
                          for p in sorted(directory.glob("*.parquet"))])
    test = held_out_mask(np.arange(len(ids)), cfg.data.seed, cfg.data.test_fraction)
    return sorted(ids[~test]), sorted(ids[test])


def ids_of(consumed_epoch):
    return sorted(i for steps in consumed_epoch.values() for step in steps for i in step)


@pytest.mark.full  # make test: every row once per epoch through a kill, below
@pytest.mark.parametrize("replicas", [1, 3])  # 2 replicas: every other Ray test
def test_every_row_exactly_once_per_epoch(ray_cluster, parquet_dir, tmp_path, replicas):
    cfg = blob_job(parquet_dir, strategy={"mode": "downpour"}, stop={"epochs": 2},
                   scaling={"replicas": replicas, "cpus_per_replica": 0.5, "shards": 1},
                   checkpoint={"storage": str(tmp_path)})
    trainer = ElasticTrainer(cfg, show_progress=False)
    trainer._trace_ids = True
    train_ids, _ = expected_ids(parquet_dir, cfg)
    assert trainer.check().train_rows == len(train_ids)
    result = trainer.fit()
    assert result.final.test_accuracy > 0.85  # asynchronous, 2 epochs: a sanity bound (3 replicas gave 0.897 once)
    for epoch in trainer.controller.consumed:
        assert ids_of(epoch) == train_ids  # every row once: none missed, none twice
    assert trainer.controller.consumed[0] != trainer.controller.consumed[1]  # reshuffled


@pytest.mark.full
def test_allreduce_serves_every_partition_once_in_lock_step(ray_cluster, parquet_dir, tmp_path):
    cfg = blob_job(parquet_dir, stop={"epochs": 1}, scaling={"replicas": 2, "cpus_per_replica": 0.5},
                   checkpoint={"storage": str(tmp_path)})
    trainer = ElasticTrainer(cfg, show_progress=False)
    trainer._trace_ids = True
    train_ids, _ = expected_ids(parquet_dir, cfg)
    result = trainer.fit()
    assert ids_of(trainer.controller.consumed[0]) == train_ids  # every row once: no ragged end dropped
    assert result.rows_per_epoch == [len(train_ids)]
    steps = [len(s) for s in trainer.controller.consumed[0].values()]
    assert steps[0] == steps[1]


def test_a_killed_replica_leaves_every_row_once_plus_the_reported_redo(ray_cluster, parquet_dir):
    cfg = blob_job(parquet_dir, strategy={"mode": "downpour"}, data={"batch_size": 4, "partitions": 30},
                   faults={"slow_replicas": {0: 0.004, 1: 0.004, 2: 0.004}}, tracking={"log_every_steps": 5, "progress_interval_s": 0},
                   scaling={"replicas": 3, "cpus_per_replica": 0.5, "shards": 1}, stop={"epochs": 3},
                   fault_tolerance={"max_replica_restarts": 0})  # the dead replica is dropped, not replaced
    dataset = load_dataset(cfg.data)
    watch = StepWatch()
    ctl = Controller(cfg, dataset, Tracker(None, "tests", None), time.perf_counter(), display=watch, trace_ids=True)

    try:
        ctl.step()
        with FaultInjector(ctl, [Fault("kill_replica", 2, at_step=30)]):
            assert not isinstance(ctl.run_epoch(), Errored)  # the epoch finishes without replica 2
        status = ray.get(ctl.server.handle.status.remote(), timeout=30)
        ctl.run_epoch()  # and the next epoch runs on the survivors
    finally:
        ctl.shutdown()
    train_ids, _ = expected_ids(parquet_dir, cfg)
    by_dead = [i for p, rank in status.done.items() if rank == 2
               for i in read_partition(dataset.train_plan, int(p))["ids"]]
    survivors = ctl.consumed[0]
    assert set(survivors) == {0, 1}
    assert sorted(ids_of(survivors) + by_dead) == train_ids
    assert ctl.redone and all(r["from_rank"] == 2 and r["epoch"] == 1 for r in ctl.redone)
    redone = {r["partition"] for r in ctl.redone}
    assert all(status.done[p] in (0, 1) for p in redone)  # served again, by a survivor
    assert ids_of(ctl.consumed[1]) == train_ids
    lost = [e for e in ctl.tracker.events if e["kind"] == "replica_dropped"]
    assert lost and lost[0]["ranks"] == [2] and lost[0]["partitions_served_again"]


@pytest.mark.full  # three runs; make test trains files, URIs' plans (unit) and in-memory data in other runs
def test_path_uri_and_in_memory_sources_train_the_same(ray_cluster, parquet_dir, tmp_path):
    """A path and its file:// URI plan and train identically; the same rows in memory (split
    by a seeded permutation, not the row hash) learn as well."""
    one_file = parquet_dir / "part-0.parquet"
    table = pq.read_table(one_file)
    x = table.column("features").combine_chunks().flatten().to_numpy().reshape(-1, 8)
    y = table.column("label").to_numpy()
    accuracies = []
    for source, data in ((str(one_file), None), (f"file://{one_file}", None), ("in-memory", (x, y))):
        cfg = blob_job(source, data={"id_column": None if data else "row_id"}, stop={"epochs": 1},
                       scaling={"replicas": 2, "cpus_per_replica": 0.5}, checkpoint={"storage": str(tmp_path)})
        accuracies.append(ElasticTrainer(cfg, show_progress=False, data=data).fit().final.test_accuracy)
    assert accuracies[0] == accuracies[1] and min(accuracies) > 0.9, accuracies


def test_readers_see_every_partition_once_and_an_unreported_epoch_cannot_be_followed(ray_cluster):
    """The server and two readers on their own: the epoch's first grants computed on the driver
    are the server's, grants of one or two partitions, the last completions reported by the
    next epoch's start, a request that overtakes its epoch's start is told to retry, and a start
    is refused (naming what is left) when an epoch's last completions never arrive."""
    import torch

    from actors.partitions.reader import PartitionReader
    from actors.partitions.server import PartitionServer
    from policies.decisions.leases import first_grant_messages

    parts, rows = 9, 10
    refs = [ray.put({"x": np.full((rows, 2), p, np.float32), "y": np.zeros(rows, np.int64),
                     "ids": np.arange(rows) + rows * p}) for p in range(parts)]
    server = PartitionServer.remote([rows] * parts, 2, 0, False, True)
    try:
        readers = [PartitionReader(server, refs, r, 4, True, torch.device("cpu"), 30) for r in range(2)]
        unreported: dict = {}
        for epoch in (1, 2):
            assert ray.get(server.grant.remote(0, [], epoch), timeout=30) == {"retry": True}  # not started yet
            first = ray.get(server.start_epoch.remote(epoch, [0, 1], unreported), timeout=30)
            assert first == first_grant_messages([rows] * parts, 2, 0, False, True, epoch, [0, 1])
            assert all(1 <= len(first[r]["leases"]) <= 2 for r in (0, 1))
            streams = [readers[r].partitions(first[r]) for r in (0, 1)]
            seen, live = [], [0, 1]
            while live:  # the two readers take turns, one partition each
                for r in list(live):
                    item = next(streams[r], None)
                    if item is None:
                        live.remove(r)
                        continue
                    lease, part = item
                    assert lease["epoch"] == epoch
                    for x, _, idx in readers[r].batches(lease, part):
                        assert (x[:, 0] == lease["partition"]).all()
                        seen += part["ids"][idx.numpy()].tolist()
            assert sorted(seen) == list(range(parts * rows))  # every row once
            unreported = {r: readers[r].unreported for r in (0, 1)}
            assert sum(map(len, unreported.values())) >= 1
        with pytest.raises(ray.exceptions.RayTaskError, match="epoch 2 is not finished"):
            ray.get(server.start_epoch.remote(3, [0, 1]), timeout=30)  # epoch 2's last completions withheld
        with pytest.raises(ray.exceptions.RayTaskError, match="epoch 3 could not start: epoch 2 is not finished"):
            ray.get(server.grant.remote(0, [], 3), timeout=30)  # a replica that began epoch 3 learns why
        status = ray.get(server.finish.remote(unreported), timeout=30)
        assert status.complete and status.epoch == 2 and len(status.done) == parts
    finally:
        ray.kill(server)
