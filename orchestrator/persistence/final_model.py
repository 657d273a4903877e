"""The trained model as a loadable MLflow model: built on the driver from the config's factory,
loaded with the run's final state, logged as `runs:/<run id>/model` (and registered when
tracking.register_as names a registered model)."""
from __future__ import annotations

import sys
import time
from typing import Any, Optional, Union

import numpy as np
import torch

from orchestrator.config import JobConfig
from orchestrator.data.in_memory import Dataset
from orchestrator.data.planning import StreamedDataset
from orchestrator.models import build_model
from policies.rules.batches import tree_map

EXAMPLE_ROWS = 5  # test rows kept with the model as its input example


def trained_model(config: JobConfig, state_dict: dict[str, Any]) -> torch.nn.Module:
    """The config's model (same factory and kwargs) holding `state_dict`, in eval mode."""
    model = build_model(config.model.factory, config.model.kwargs, config.data.seed)
    model.load_state_dict(state_dict)
    return model.eval()


def input_example(dataset: Union[Dataset, StreamedDataset], rows: int = EXAMPLE_ROWS) -> Any:
    """A few decoded rows (in memory: the test split's first; a file source: its first), shaped
    as the model takes them: an array, or a dict of arrays."""
    return tree_map(np.ascontiguousarray, dataset.example(rows).x)


def log_trained_model(tracker: Any, config: JobConfig, dataset: Union[Dataset, StreamedDataset],
                      state_dict: dict[str, Any]) -> Optional[float]:
    """Log the run's final model to its MLflow run (see Tracker.log_model); the seconds it took,
    or None when it was not logged (said on stderr; model.pt holds the state either way)."""
    t = time.perf_counter()
    try:
        model = trained_model(config, state_dict)
    except Exception as exc:
        print(f"orchestrator: tracking: model: not logged ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
        return None
    if not tracker.log_model(model, input_example(dataset), register_as=config.tracking.register_as):
        return None
    return time.perf_counter() - t
