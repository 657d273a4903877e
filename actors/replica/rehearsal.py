"""A spare's rehearsal: one forward, backward and optimizer step on a few rows of the data's
sample and a one-member gloo group, so the replica that takes over pays none of the one-time
set-up (torch.optim's first use imports ~1 s of modules; gloo's first group; allocator,
kernels). The model's state is put back as it was."""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from actors.replica.reducer import free_port
from policies.rules.batches import as_tensors, to_device, tree_map
from policies.rules.outputs import run_model


def rehearse(replica: Any, sample: list, rows: int = 32) -> float:
    """The rehearsal on `replica` (a ModelReplica) with `rows` rows of `sample` (a ref wrapped
    in a list). Returns the seconds."""
    t0 = time.perf_counter()
    data = ray.get(sample[0], timeout=replica.cfg["strategy"]["timeout_s"])
    model = replica.model
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x = to_device(as_tensors(tree_map(lambda a: a[:rows].copy(), data["x"])), replica.device)
    y = to_device(as_tensors(tree_map(lambda a: a[:rows].copy(), data["y"])), replica.device)
    model.train()
    replica.task.loss(run_model(model, replica.task, x, y), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    for p in model.parameters():
        p.grad = None
    model.load_state_dict(saved)
    if replica.spec.process_group and replica.device.type == "cpu":
        store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))
        dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=30)).allreduce([torch.zeros(1)]).wait()
    return time.perf_counter() - t0
