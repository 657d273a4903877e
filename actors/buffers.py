"""How flat parameter buffers cross the object store: numpy arrays on the wire, tensors in
the model (shared by the shards and their clients)."""
from __future__ import annotations

import warnings

import numpy as np
import torch


def array_view(array: np.ndarray) -> torch.Tensor:
    """A tensor over an array from the object store (read-only, zero-copy); we only read it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def host_array(t: torch.Tensor) -> np.ndarray:
    """The shard boundary: a flat tensor as a numpy array (copied off a GPU, a view on the CPU)."""
    return t.detach().cpu().numpy()
