"""The driver's view of one parameter shard (`Slot`) and the account of a rebuild once its
clients have replayed (`rebuild_event`): pure, no Ray; orchestrator/fleet/shard_group.py keeps one
Slot per shard."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from policies.messages import FleetEvent


@dataclass
class Slot:
    """The driver's view of shard i."""

    handle: Any
    generation: int = 0
    snapshot_ref: Any = None  # the latest completed snapshot (the driver owns the object)
    snapshot_version: int = 0
    pending_snapshot: Optional[tuple] = None  # (version ref, snapshot ref)
    last_snapshot_at: float = 0.0
    ping: Any = None
    ping_at: float = 0.0  # when the outstanding ping was sent
    answered_at: float = 0.0  # when the newest answered ping was sent (0: none yet)
    known_version: Optional[int] = None  # the newest version the driver saw
    state: str = "up"  # up | dead | starting
    dead_at: float = 0.0
    detected_by: str = ""
    version_at_death: Optional[int] = None
    rebuilt_from: int = 0
    starting: Any = None  # status ref of a new incarnation
    recovery_s: float = 0.0
    settling: bool = False
    settle_deadline: float = 0.0
    info: Any = None  # pending recovery_info ref


def rebuild_event(i: int, slot: Slot, info: dict[str, Any], now: float) -> Optional[FleetEvent]:
    """Shard i's `shard_rebuilt` event from its new incarnation's recovery_info, or None while
    it should wait for its clients' replay (something is missing, or no client has reconnected
    yet, and `slot.settle_deadline` is not reached). lost_updates = the newest version the
    driver or a client saw - (snapshot + replayed + resent), plus log entries clients dropped."""
    seen = max(slot.version_at_death or 0, info["seen"])
    # an update the dead incarnation applied but never acknowledged (killed between the two)
    # is re-sent and applied once in the new lineage: resent updates account for versions too
    unreplayed = max(0, seen - (info["restored_from"] + info["replayed"] + info["resent"]))
    lost = unreplayed + info["dropped"]
    # until a client has reconnected, the newest version known is the driver's last ping,
    # which can be as old as the snapshot: no client yet is no evidence that nothing is missing
    if (lost or not info.get("clients")) and now < slot.settle_deadline:
        return None
    event = {"shard": i, "generation": slot.generation, "detected_by": slot.detected_by,
             "snapshot_version": slot.rebuilt_from, "version_at_death": seen if seen else slot.version_at_death,
             "replayed_updates": info["replayed"], "resent_updates": info["resent"], "lost_updates": lost,
             "recovery_s": round(slot.recovery_s, 3)}
    if lost:
        event["lost_causes"] = {k: v for k, v in (
            ("dropped_from_full_log", info["dropped"]),
            ("not_replayed_within_settle_s", unreplayed)) if v}
    return FleetEvent("shard_rebuilt", event,
                      f"shard {i} died and was rebuilt from its snapshot ({lost} acknowledged updates lost)")
