"""fsdp's state on its way out of and into the replicas, in slices: no replica gathers or
receives the whole model's parameters and optimizer state (each still builds the model whole
once, before it shards it).

Out (`slices`, a replica's own call, no collective): each split tensor (a DTensor cut in dim 0,
FSDP2's Shard(0)) leaves as a `Slice`, the rows this replica holds and the whole tensor's
shape; what is not split (buffers, Adam's step count) leaves as it is. The driver joins the
members' slices in group-rank order (`join`): one whole state, FQN-keyed, the same as
`get_model_state_dict` / `get_optimizer_state_dict` with full_state_dict give, so checkpoints
and the final model are plain state dicts.

In (`load_sliced`): a whole state, its tensors sent one object each (the driver's
`by_reference`), is read tensor by tensor after the model is sharded over its new group; each
replica keeps the rows its group rank holds (`rows_of`: torch.chunk's cut, as DTensor's and
FSDP2's) and lets the whole tensor go before it reads the next, then loads its slices through
torch.distributed.checkpoint's sharded state dicts. A replica's peak is its slices plus the
largest tensor whole; the group may differ from the one that wrote the state (a resize, a
recovery: resharding is the cut, nothing more).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Slice:
    """A replica's rows of a tensor split in dim 0 across its group, and the whole tensor's shape."""
    local: torch.Tensor
    shape: tuple[int, ...]


def rows_of(n: int, rank: int, size: int) -> tuple[int, int]:
    """The rows [start, end) of an n-row tensor that group rank `rank` of `size` holds:
    torch.chunk's cut (chunks of ceil(n / size) rows; the last ranks may hold none)."""
    chunk = -(-n // size) if n else 0
    start = min(rank * chunk, n)
    return start, min(start + chunk, n)


def _walk(tree: Any, leaf: Callable[[Any], Any]) -> Any:
    if isinstance(tree, dict):
        return {k: _walk(v, leaf) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_walk(v, leaf) for v in tree)
    return leaf(tree)


def slices(tree: Any) -> Any:
    """`tree` (a sharded state dict) with each DTensor as this replica's `Slice` and every tensor
    on the CPU: views of the replica's own tensors, not copies (a GPU's are copied), so it
    holds nothing more while they are sent; the caller asks while the replica is paused (a
    checkpoint, a grow, a move), and the reply is serialized before it steps again."""
    def leaf(v: Any) -> Any:
        if hasattr(v, "to_local"):
            return Slice(v.to_local().detach().cpu(), tuple(v.shape))
        return v.detach().cpu() if torch.is_tensor(v) else v
    return _walk(tree, leaf)


def join(parts: list[Any]) -> Any:
    """The members' `slices` (in group-rank order) as one whole tree: a Slice's rows
    concatenated (and checked against the whole shape), anything else group rank 0's."""
    first = parts[0]
    if isinstance(first, dict):
        return {k: join([p[k] for p in parts]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(join([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, Slice):
        whole = torch.cat([p.local for p in parts], dim=0)
        if tuple(whole.shape) != first.shape:
            raise ValueError(f"the members' slices make {tuple(whole.shape)}, not the tensor's {first.shape}")
        return whole
    return first


def by_reference(tree: Any, put: Callable[[torch.Tensor], Any]) -> Any:
    """`tree` with each tensor of one dimension or more replaced by `put(tensor)` (an object
    store ref): a replica loading it reads one tensor at a time."""
    return _walk(tree, lambda v: put(v) if torch.is_tensor(v) and v.dim() > 0 else v)


def resolved(tree: Any, fetch: Callable[[Any], Any]) -> Any:
    """`tree` with every leaf passed through `fetch` (an object store ref: its tensor)."""
    return _walk(tree, fetch)


def _like(whole: torch.Tensor, current: Any, rank: int, size: int) -> Any:
    """`whole` as `current` holds it: a DTensor split in dim 0 gets this rank's rows, anything else all of it."""
    if not hasattr(current, "to_local"):
        return whole.to(current.device) if torch.is_tensor(current) else whole
    from torch.distributed.tensor import DTensor

    start, end = rows_of(whole.shape[0], rank, size)
    local = whole[start:end].to(current.to_local().device, current.dtype).clone()
    return DTensor.from_local(local, current.device_mesh, current.placements, run_check=False,
                              shape=current.shape, stride=current.stride())


def load_sliced(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                rank: int, size: int, fetch: Callable[[Any], Any]) -> None:
    """Load a whole state (FQN-keyed model and optimizer state dicts, tensors or refs `fetch`
    resolves) into a model sharded over a group of `size` in which this replica is `rank`: one
    tensor fetched at a time, its rows kept."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    current = get_model_state_dict(model)
    sd = {name: _like(fetch(state["model"][name]), now, rank, size) for name, now in current.items()}
    set_model_state_dict(model, sd, options=StateDictOptions(strict=True))
    del sd, current
    saved = state.get("optimizer")
    if saved is None:
        return
    params = dict(model.named_parameters())
    per_param = {}
    for name, entries in saved["state"].items():
        p = params[name]
        per_param[name] = {}
        for key, v in entries.items():
            v = fetch(v)
            split = torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) == tuple(p.shape)  # a moment: cut like its parameter
            per_param[name][key] = _like(v, p, rank, size) if split else v
    set_optimizer_state_dict(model, optimizer, {"state": per_param, "param_groups": saved["param_groups"]},
                             options=StateDictOptions(strict=True))
