"""Sharded modes' reference model on a replica: the shards' parameters (Downpour's server copy,
EASGD's center) and the replicas' averaged buffers, loaded into the replica's model for good
(`load_reference`: a switch, a newcomer) or for the length of an evaluation or a checkpoint
(`reference_loaded`: the replica's own parameters put back after)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def load_reference(replica: Any) -> None:
    """The shards' reference parameters and averaged buffers into the model: straight into the
    flat parameter buffer when the replica has one, else through a temporary one."""
    with torch.no_grad():
        if getattr(replica.worker, "holds_reference", False):
            pass  # hogwild: the parameters are the shared vector already
        elif replica.flat is not None:
            replica.client.pull(replica.flat.params)
        else:
            params = [p for p in replica.model.parameters() if p.requires_grad]
            flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=replica.device)
            replica.client.pull(flat)
            offset = 0
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        if replica.has_buffers:
            buffers = dict(replica.model.named_buffers())
            for name, value in replica.client.buffers().items():
                buffers[name].copy_(torch.from_numpy(value))


@contextlib.contextmanager
def reference_loaded(replica: Any) -> Iterator[None]:
    """The reference loaded while the block runs (allreduce and the other unsharded modes:
    every replica already holds it, nothing moves; hogwild's direct replicas: the parameters
    are the shared vector already, only the averaged buffers move)."""
    if replica.flat is None:
        yield
        return
    direct = getattr(replica.worker, "holds_reference", False)
    local = None if direct else replica.flat.params.clone()
    local_buffers = {name: b.detach().clone() for name, b in replica.model.named_buffers()}
    if not direct:
        replica.client.pull(replica.flat.params)
    reference_buffers = replica.client.buffers() if local_buffers else {}
    buffers = dict(replica.model.named_buffers())
    for name, value in reference_buffers.items():
        buffers[name].detach().copy_(torch.from_numpy(value))
    try:
        yield
    finally:
        if local is not None:
            replica.flat.params.copy_(local)
        for name, value in local_buffers.items():
            buffers[name].detach().copy_(value)
