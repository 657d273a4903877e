"""TensorBoard scalars beside MLflow (`tracking.tensorboard: DIR`): every metric the run logs to
MLflow (the same names and steps) is also written as a TensorBoard scalar, in
`DIR/<run.name or the MLflow run id>/` (a resumed run goes on in the same directory), through
tensorboardX's SummaryWriter (it comes with Ray). Written in the tracker's writer thread, so a
slow disk never holds a step back; closed when the MLflow run ends."""
from __future__ import annotations

import os
from typing import Any


class TensorBoardScalars:
    def __init__(self, directory: str, run_dir: str) -> None:
        from tensorboardX import SummaryWriter

        self.logdir = os.path.join(os.path.abspath(directory), run_dir)
        self.writer: Any = SummaryWriter(logdir=self.logdir)

    def scalars(self, rows: list[tuple[str, float, int]]) -> None:
        for name, value, step in rows:
            self.writer.add_scalar(name, float(value), int(step))

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
