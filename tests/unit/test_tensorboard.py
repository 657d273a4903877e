"""tracking.tensorboard: every metric the tracker logs to MLflow is also a TensorBoard scalar of
the same name and step (a real sqlite MLflow store and real event files, read back here with
the event format's own protobuf; no Ray)."""
from __future__ import annotations

import glob
import os
import struct

import pytest

from mlflow.tracking import MlflowClient

from orchestrator.reporting.tensorboard import TensorBoardScalars
from orchestrator.reporting.tracking import Tracker


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} from the TensorBoard event files under `logdir`."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        i = 0
        while i < len(data):  # a record: length (u64), its crc (u32), the event, its crc (u32)
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_every_metric_row_is_also_a_tensorboard_scalar_of_the_same_name_and_step(tmp_path):
    uri = f"sqlite:///{tmp_path}/runs.db"
    tracker = Tracker(uri, "tb", None)
    tracker.mirror_to(TensorBoardScalars(str(tmp_path / "tb"), tracker.run_id))
    rows = [("train_loss", 2.5, 10), ("test_accuracy", 0.5, 10), ("train_loss", 1.25, 20), ("lr", 0.01, 20)]
    tracker.log_metrics(rows[:2])
    tracker.log_metrics(rows[2:])
    assert tracker.finish("FINISHED", timeout_s=10)
    got = read_scalars(str(tmp_path / "tb" / tracker.run_id))
    client = MlflowClient(uri)
    assert set(got) == {"train_loss", "test_accuracy", "lr"}
    for name, points in got.items():  # TensorBoard keeps float32
        logged = [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, name)]
        assert [s for s, _ in points] == [s for s, _ in logged] == [s for n, _, s in rows if n == name]
        assert [v for _, v in points] == pytest.approx([v for _, v in logged], rel=1e-6)
