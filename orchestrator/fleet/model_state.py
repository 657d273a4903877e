"""The whole model held by the replicas, as one state: gathered from the members (fsdp's split
state joined from every member's slices) and handed to many replicas to load (one object in the
store, or each tensor its own). Used by checkpoints, repairs, grows and evacuations alike."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from orchestrator.fleet.replica_group import ReplicaGroup


def whole_state(group: "ReplicaGroup", ranks: list[int], what: str, timeout_s: float) -> dict[str, Any]:
    """Split state (fsdp): the model's state whole, joined from every member's slices (each
    member's own call, no collective: a lost one is MemberLost; policies/rules/split_state.py),
    or, before the model was sharded, the whole state the first member holds."""
    import ray

    from policies.rules.split_state import join, resolved

    parts = group.call(ranks, "export_state", what=what)
    first = parts[0]
    loaded = [p for p in parts if "whole" in p]
    if loaded:  # loaded and not sharded yet (every member re-shards it): its tensors may still be the driver's refs
        whole = resolved(loaded[0]["whole"], lambda x: ray.get(x, timeout=timeout_s)
                         if isinstance(x, ray.ObjectRef) else x)
    else:
        whole = join([p["slices"] for p in sorted(parts, key=lambda p: p["rank"])])
    return {"model": whole["model"], "optimizer": whole["optimizer"], "step": first["step"], "worker": None,
            "recipe": first["recipe"]}


def for_loading(state: Optional[dict[str, Any]], split_state: bool) -> Any:
    """`state` as load_state's argument to many replicas: one object in the store, or with split
    state (fsdp, `split_state`) each tensor its own, so a replica reads one tensor at a time and
    keeps its rows."""
    import ray

    if state is None or not split_state:
        return ray.put(state)
    from policies.rules.split_state import by_reference

    return {**state, "model": by_reference(state["model"], ray.put),
            "optimizer": by_reference(state["optimizer"], ray.put)}
