"""The newest checkpoint in memory, on another node than the driver's (`checkpoint.in_memory`).

A periodic checkpoint is serialized once, on the Checkpointer's background thread
(orchestrator/persistence/run_state.py); with `checkpoint.in_memory` the same bytes go first to
the run's `CheckpointKeeper` (actors/checkpoints/keeper.py), a detached actor that outlives the
driver, then to storage (one the run waits on, the interrupted checkpoint, to storage first). A
run started again by name (or with `resume`) asks the keeper of its checkpoint directory and goes
on from the copy in memory when it is of the same MLflow run as the store's newest good
checkpoint and at least as new (orchestrator/persistence/resume.py): nothing is read from storage, and a checkpoint the driver died
before storing, or a storage that was lost with the driver's node, costs nothing
(orchestrator/trainer.py). The copy is checked like a stored one: its length and sha256
against its sidecar, then `torch.load(weights_only=True)`.

The keeper is placed on a node other than the driver's, when the cluster has one (the node with
the most memory that is not being drained), so losing the driver's node does not lose it; on a
one-node cluster it outlives the driver's process, not its node."""
from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Any, Callable, Optional

from orchestrator.checks import bounded, one_line

CALL_TIMEOUT_S = 60.0  # handing a checkpoint to the keeper, fetching it: this, plus BYTES_PER_S's share
BYTES_PER_S = 50e6  # the slowest transfer a hand-over or a fetch is given time for
LOOK_TIMEOUT_S = 10.0  # finding a keeper, asking what it holds
MEMORY_PREFIX = "memory:"  # how a checkpoint held in memory is named where a path would be


def directory_key(directory: str) -> str:
    """A run's checkpoint directory (`<storage>/<run name or id>`) as one string whatever the
    working directory: the keeper's identity, so a later driver finds the keeper of the same directory."""
    return directory.rstrip("/") if "://" in directory else os.path.abspath(directory)


def keeper_name(directory: str) -> str:
    return "checkpoint-keeper-" + hashlib.sha256(directory.encode()).hexdigest()[:24]


def pick_node(nodes: list[dict[str, Any]], driver_node: str, draining: set[str]) -> Optional[str]:
    """The node for a run's keeper: of the alive nodes (`ray.nodes()` rows) not being drained,
    one other than the driver's, the one with the most memory (then the lowest id); None when
    there is no other (the keeper goes beside the driver)."""
    others = [n for n in nodes if n.get("Alive") and n.get("NodeID") != driver_node
              and n.get("NodeID") not in draining]
    if not others:
        return None
    return min(others, key=lambda n: (-float(n.get("Resources", {}).get("memory", 0.0)), n["NodeID"]))["NodeID"]


def label(meta: dict[str, Any]) -> str:
    """Where a checkpoint held in memory is, as the console and the `resumed` event name it."""
    return f"{MEMORY_PREFIX}{meta['name']}@node {str(meta.get('node_id', '?'))[:12]}"


def _handle(directory: str):
    import ray

    from actors.checkpoints.keeper import NAMESPACE

    try:
        return ray.get_actor(keeper_name(directory), namespace=NAMESPACE)
    except ValueError:  # no keeper of that directory
        return None


def transfer_timeout_s(nbytes: Any) -> float:
    return CALL_TIMEOUT_S + (float(nbytes) if isinstance(nbytes, (int, float)) else 0.0) / BYTES_PER_S


def look(directory: str, wanted: Callable[[dict[str, Any]], str] = lambda meta: "") \
        -> tuple[Optional[dict[str, Any]], Optional[dict[str, Any]], str]:
    """(the sidecar, the state, "") of the checkpoint the keeper of `directory` holds; (None,
    None, why) when there is none, it cannot be read, or `wanted(sidecar)` says why it is not
    wanted (asked before its bytes are fetched). Needs a connected Ray."""
    import ray

    try:
        keeper = bounded(lambda: _handle(directory), LOOK_TIMEOUT_S, "looking for the checkpoint keeper")
        if keeper is None:
            return None, None, "no checkpoint keeper"
        meta = ray.get(keeper.peek.remote(), timeout=LOOK_TIMEOUT_S)
        if meta is None:
            return None, None, "its keeper holds nothing yet"
        unwanted = wanted(meta)
        if unwanted:
            return None, None, unwanted
        held = ray.get(keeper.fetch.remote(), timeout=transfer_timeout_s(meta.get("bytes")))
    except Exception as exc:  # gone with its node, expired meanwhile, a cluster that does not answer
        return None, None, f"its keeper did not answer ({one_line(exc)})"
    if held is None:
        return None, None, "its keeper holds nothing yet"
    from orchestrator.persistence.checkpoint import decode_payload

    meta, data = held
    state, why = decode_payload(data, meta)
    return (meta, state, "") if state is not None else (None, None, f"the copy in memory is unusable: {why}")


class MemoryCopy:
    """The driver's side of its run's keeper: made at the first checkpoint (found again if a
    driver before this one made it), handed every periodic checkpoint, touched every keep_s / 4
    while the driver lives, released by the final one."""

    def __init__(self, directory: str, keep_s: float) -> None:
        self.directory, self.keep_s = directory, keep_s
        self.keeper: Any = None
        self.node: Optional[str] = None  # the keeper's node, as its last hold said
        self._lock = threading.Lock()  # a hold, a move and a release, one at a time
        self._stop = threading.Event()
        self._toucher: Optional[threading.Thread] = None
        self._mover: Optional[threading.Thread] = None
        self._unmovable: Optional[str] = None  # a node the keeper could not be moved off (not tried again)
        self._moves: list[dict[str, Any]] = []
        self._moves_lock = threading.Lock()  # not _lock: the training loop asks for moves while one goes on

    def _open(self) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from actors.checkpoints.keeper import NAMESPACE, CheckpointKeeper
        from orchestrator.fleet.drains import draining_nodes

        try:  # (hold bounds this whole call)
            draining = set(draining_nodes())
        except Exception:  # no drain view: placed as if nothing were drained
            draining = set()
        node = pick_node(ray.nodes(), ray.get_runtime_context().get_node_id(), draining)
        # hard: Ray places a 0-CPU actor on a random node whatever a soft affinity asks (seen: 7 of
        # 12 elsewhere, the driver's node among them); a node gone meanwhile fails the start at once
        placement = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)} if node else {}
        return CheckpointKeeper.options(name=keeper_name(self.directory), namespace=NAMESPACE, lifetime="detached",
                                        get_if_exists=True, **placement).remote(self.directory, self.keep_s)

    def hold(self, meta: dict[str, Any], data: bytes) -> dict[str, Any]:
        """Hand the keeper this checkpoint: {"in_memory": node id} or {"in_memory_failed": why}.
        A keeper that died (its node lost, expired) is made again at once, once; one that did not
        answer in time is made again at the next checkpoint."""
        with self._lock:
            return self._hold(meta, data)

    def _hold(self, meta: dict[str, Any], data: bytes) -> dict[str, Any]:
        import ray
        from ray.exceptions import ActorUnschedulableError, RayActorError

        why = ""
        for _ in range(2):
            try:
                if self.keeper is None:
                    self.keeper = bounded(self._open, LOOK_TIMEOUT_S, "starting the checkpoint keeper")
                    self._touch_on()
                held = ray.get(self.keeper.hold.remote(meta, data), timeout=transfer_timeout_s(len(data)))
                self.node = held["node_id"]
                return {"in_memory": held["node_id"]}
            except (RayActorError, ActorUnschedulableError) as exc:  # it died, its node went: a new one, once
                self.keeper, self.node, why = None, None, one_line(exc)
            except Exception as exc:  # no answer in time, a cluster that does not answer
                self.keeper, self.node = None, None
                return {"in_memory_failed": one_line(exc)}
        return {"in_memory_failed": why}

    def move_off(self, draining: dict[str, Any]) -> None:
        """The keeper's node is being drained (`draining`: node id -> deadline, the run's drain
        view): its copy moves to another node before the deadline, on a thread of its own (the
        training loop does not wait); `moves()` says what came of it. Not tried again off a node
        it could not leave (no other node: the next checkpoint, after the node went, makes a new
        keeper elsewhere)."""
        node = self.node
        if node is None or node not in draining or node == self._unmovable or self._stop.is_set():
            return
        if self._mover is not None and self._mover.is_alive():
            return
        self._mover = threading.Thread(target=self._move, args=(node, set(draining)), name="keeper move", daemon=True)
        self._mover.start()

    def moves(self) -> list[dict[str, Any]]:
        """What each move since the last call came to: {"from", "to", "move_s", "bytes"} or
        {"from", "failed": why}."""
        with self._moves_lock:
            out, self._moves = self._moves, []
        return out

    def _move(self, node: str, draining: set[str]) -> None:
        import ray

        t = time.perf_counter()
        with self._lock:
            if self.node != node or self.keeper is None:  # moved, lost or released meanwhile
                return
            try:
                if pick_node(bounded(ray.nodes, LOOK_TIMEOUT_S, "listing the nodes"),
                             ray.get_runtime_context().get_node_id(), draining) is None:
                    raise RuntimeError("no other node to hold it")
                peeked = ray.get(self.keeper.peek.remote(), timeout=LOOK_TIMEOUT_S)
                held = None if peeked is None else \
                    ray.get(self.keeper.fetch.remote(), timeout=transfer_timeout_s(peeked.get("bytes")))
                # the name is the keeper's identity: the old one goes before the new one starts
                # (a driver lost in these seconds leaves storage's newest to go on from)
                old, self.keeper, self.node = self.keeper, None, None
                bounded(lambda: ray.kill(old, no_restart=True), LOOK_TIMEOUT_S, "ending the keeper on the drained node")
                bounded(self._name_free, LOOK_TIMEOUT_S, "waiting for the drained keeper's name")
                to, nbytes = None, 0
                if held is not None:  # (nothing held yet: the next checkpoint makes the keeper elsewhere)
                    meta, data = held
                    outcome = self._hold({k: v for k, v in meta.items() if k != "node_id"}, data)
                    if "in_memory" not in outcome:
                        raise RuntimeError(outcome.get("in_memory_failed", "not held"))
                    to, nbytes = outcome["in_memory"], len(data)
                moved = {"from": node, "to": to, "move_s": round(time.perf_counter() - t, 3), "bytes": nbytes}
            except Exception as exc:  # the keeper stays (or is made again at the next checkpoint)
                self._unmovable = node
                moved = {"from": node, "failed": one_line(exc)}
        with self._moves_lock:
            self._moves.append(moved)

    def _name_free(self) -> None:
        while _handle(self.directory) is not None:
            time.sleep(0.1)

    def _touch_on(self) -> None:
        if self._toucher is not None:
            return

        def touch() -> None:
            while not self._stop.wait(self.keep_s / 4):
                keeper = self.keeper
                if keeper is not None:
                    keeper.touch.remote()  # fire and forget: a keeper gone is made again at the next hold

        self._toucher = threading.Thread(target=touch, name="keeper touch", daemon=True)
        self._toucher.start()

    def release(self) -> dict[str, Any]:
        """The run finished: the keeper ends (a keeper of an earlier driver too). Never raises
        (the run's final checkpoint is stored already): {} or {"in_memory_failed": why}; a keeper
        not ended here ends in_memory_keep_s later."""
        import ray

        self.close()
        with self._lock:
            keeper, self.keeper, self.node = self.keeper, None, None
        try:
            keeper = keeper or bounded(lambda: _handle(self.directory), LOOK_TIMEOUT_S, "finding the keeper")
            if keeper is not None:
                bounded(lambda: ray.kill(keeper, no_restart=True), LOOK_TIMEOUT_S, "ending the keeper")
        except Exception as exc:  # gone already, or the cluster does not answer
            return {} if isinstance(exc, ValueError) else {"in_memory_failed": f"not ended: {one_line(exc)}"}
        return {}

    def close(self) -> None:
        """The driver's run ended without finishing (an error, an interrupt): touches stop, the
        keeper keeps the copy for keep_s more."""
        self._stop.set()
