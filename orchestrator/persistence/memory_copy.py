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
from policies.messages import KeeperMove

CALL_TIMEOUT_S = 60.0  # handing a checkpoint to the keeper, fetching it: this, plus BYTES_PER_S's share
BYTES_PER_S = 50e6  # the slowest transfer a hand-over or a fetch is given time for
LOOK_TIMEOUT_S = 10.0  # finding a keeper, asking what it holds
MOVE_RETRY_S = 5.0  # a keeper that failed to move off a drained node is tried again this much later
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


def _end(keeper: Any, what: str) -> None:
    """ray.kill the keeper, within LOOK_TIMEOUT_S (TimeoutError, or Ray's error, otherwise)."""
    import ray

    bounded(lambda: ray.kill(keeper, no_restart=True), LOOK_TIMEOUT_S, what)


def end_leftover(directory: str) -> bool:
    """A run that finished without checkpoint.in_memory: a keeper of its checkpoint directory left
    by an earlier driver of the same name (one with it on that died) ends now, so its copy is
    never taken up by a later run of that name. True if one was ended; nothing is looked at when
    this process is not connected to Ray, and a lookup that fails is let be (it expires)."""
    import ray

    if not ray.is_initialized():
        return False
    try:
        keeper = bounded(lambda: _handle(directory), LOOK_TIMEOUT_S, "looking for a keeper left")
        if keeper is None:
            return False
        _end(keeper, "ending the keeper left")
    except Exception:  # the cluster does not answer: the keeper ends in_memory_keep_s after its last touch
        return False
    return True


class MemoryCopy:
    """The driver's side of its run's keeper: made at the first checkpoint (found again if a
    driver before this one made it), handed every periodic checkpoint, touched every keep_s / 4
    while the driver lives, released by the final one, moved off a node being drained."""

    def __init__(self, directory: str, keep_s: float) -> None:
        self.directory, self.keep_s = directory, keep_s
        self.keeper: Any = None
        self.node: Optional[str] = None  # the keeper's node, as its last hold said
        self._lock = threading.Lock()  # the keeper's calls (a hold, a move, a release), one at a time
        self._stop = threading.Event()  # touches stop (the run ended)
        self._released = threading.Event()  # the run finished: nothing to keep
        self._toucher: Optional[threading.Thread] = None
        self._mover: Optional[threading.Thread] = None
        self._moving = False  # a move holds _lock: a hold meanwhile leaves its checkpoint in _newest
        self._newest: Optional[tuple[dict[str, Any], bytes]] = None  # for the keeper once the move is made
        self._retry_at = 0.0  # a failed move is tried again from then (monotonic)
        self._unmovable: Optional[str] = None  # a node with no other to move to (not tried again)
        self._moves: list[KeeperMove] = []
        self._small = threading.Lock()  # _moving, _newest and _moves: never held across a remote call
        self._hurry = threading.Event()  # set while a checkpoint the run waits on waits for the writer

    def _open(self, avoid: frozenset = frozenset()) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from actors.checkpoints.keeper import NAMESPACE, CheckpointKeeper
        from orchestrator.fleet.drains import draining_nodes

        try:  # (hold bounds this whole call)
            draining = set(draining_nodes())
        except Exception:  # no drain view: placed as if nothing but `avoid` were drained
            draining = set()
        node = pick_node(ray.nodes(), ray.get_runtime_context().get_node_id(), draining | avoid)
        # hard: Ray places a 0-CPU actor on a random node whatever a soft affinity asks (seen: 7 of
        # 12 elsewhere, the driver's node among them); a node gone meanwhile fails the start at once
        placement = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)} if node else {}
        return CheckpointKeeper.options(name=keeper_name(self.directory), namespace=NAMESPACE, lifetime="detached",
                                        get_if_exists=True, **placement).remote(self.directory, self.keep_s)

    def hold(self, meta: dict[str, Any], data: bytes) -> dict[str, Any]:
        """Hand the keeper this checkpoint: {"in_memory": node id} or {"in_memory_failed": why}.
        A keeper that died (its node lost, expired) is made again at once, once; one alive that did
        not answer in time (a stopped process, a node out of memory), or whose hand-over a
        checkpoint the run waits on cut short (`hurry`), is ended, and a new one is made at the next
        checkpoint. While the keeper moves off a drained node this returns at once: the moved
        keeper holds this checkpoint (the newest one handed)."""
        while True:
            with self._small:
                if self._moving:
                    self._newest = (meta, data)
                    return {"in_memory_failed": "the keeper is moving off a node being drained: "
                                                "it holds this checkpoint once moved"}
            if self._lock.acquire(timeout=0.1):
                break
            if self._hurry.is_set():  # a move or a release holds the keeper: storage does not wait for it
                return {"in_memory_failed": "a checkpoint the run waits on came first"}
        try:
            return self._hold(meta, data)
        finally:
            self._lock.release()

    def _hold(self, meta: dict[str, Any], data: bytes, avoid: frozenset = frozenset()) -> dict[str, Any]:
        import ray
        from ray.exceptions import ActorUnschedulableError, RayActorError

        why = ""
        for _ in range(2):
            try:
                if self.keeper is None:
                    self.keeper = bounded(lambda: self._open(avoid), LOOK_TIMEOUT_S, "starting the checkpoint keeper")
                    self._touch_on()
                ref = self.keeper.hold.remote(meta, data)
                silent = self._unanswered(ref, transfer_timeout_s(len(data)))
                if silent:
                    return {"in_memory_failed": self._end_silent(silent)}
                held = ray.get(ref, timeout=LOOK_TIMEOUT_S)
                self.node = held["node_id"]
                return {"in_memory": held["node_id"]}
            except (RayActorError, ActorUnschedulableError) as exc:  # it died, its node went: a new one, once
                self.keeper, self.node, why = None, None, one_line(exc)
            except Exception as exc:  # no answer in time, a cluster that does not answer
                self.keeper, self.node = None, None
                return {"in_memory_failed": one_line(exc)}
        return {"in_memory_failed": why}

    def hurry(self, on: bool = True) -> None:
        """While a checkpoint the run waits on (the interrupted one, one before the driver's node
        goes) waits for the background writer (on), a hand-over waiting on the keeper stops
        waiting (that keeper is ended: a new one holds the next checkpoint), so storage never
        waits behind a keeper; off once the writer is done."""
        (self._hurry.set if on else self._hurry.clear)()

    def _unanswered(self, ref: Any, timeout_s: float) -> str:
        """Wait for the keeper's answer `ref`: "" once it came, else why it did not (no answer in
        timeout_s, or `hurry` meanwhile)."""
        import ray

        deadline = time.monotonic() + timeout_s
        while not ray.wait([ref], timeout=max(0.0, min(0.25, deadline - time.monotonic())))[0]:
            if time.monotonic() >= deadline:
                return f"the keeper did not answer in {timeout_s:.0f}s"
            if self._hurry.is_set():
                return "a checkpoint the run waits on came first"
        return ""

    def _end_silent(self, why: str) -> str:
        """End the keeper that did not answer (it may be alive: a stopped process), so the next
        hand-over makes a new one instead of waiting on it again; why, for the checkpoint's event."""
        keeper, self.keeper, self.node = self.keeper, None, None
        try:
            _end(keeper, "ending the silent keeper")
        except Exception as exc:  # gone already, or the cluster does not answer: a new one is made anyway
            return f"{why}; ending it failed: {one_line(exc)}"
        return f"{why}: ended, a new one holds the next checkpoint"

    def move_off(self, draining: dict[str, Any]) -> None:
        """The keeper's node is being drained (`draining`: node id -> deadline, the run's drain
        view): its copy moves to another node before the deadline, on a thread of its own (the
        training loop does not wait, nor does a checkpoint: see hold); `moves()` says what came of
        it. A move that failed is tried again MOVE_RETRY_S later; none is tried off a node when
        there is no other (the next checkpoint after the node went makes a keeper elsewhere)."""
        node = self.node
        if node is None or node not in draining or node == self._unmovable or self._released.is_set() \
                or time.monotonic() < self._retry_at or (self._mover is not None and self._mover.is_alive()):
            return
        self._mover = threading.Thread(target=self._move, args=(node, frozenset(draining)), name="keeper move",
                                       daemon=True)
        self._mover.start()

    def moves(self) -> list[KeeperMove]:
        """What each move since the last call came to (KeeperMove: where to, or why it failed)."""
        with self._small:
            out, self._moves = self._moves, []
        return out

    def _move(self, node: str, draining: frozenset) -> None:
        import ray

        t = time.perf_counter()
        with self._lock:
            if self.node != node or self.keeper is None or self._released.is_set():  # moved, lost, released meanwhile
                return
            with self._small:
                self._moving, self._newest = True, None
            held = carrying = None  # the fetched copy; the copy being handed to a new keeper
            try:
                if pick_node(bounded(ray.nodes, LOOK_TIMEOUT_S, "listing the nodes"),
                             ray.get_runtime_context().get_node_id(), draining) is None:
                    self._unmovable = node
                    raise RuntimeError("no other node to hold it")
                peeked = ray.get(self.keeper.peek.remote(), timeout=LOOK_TIMEOUT_S)
                if peeked is not None:
                    meta, data = ray.get(self.keeper.fetch.remote(), timeout=transfer_timeout_s(peeked.get("bytes")))
                    held = ({k: v for k, v in meta.items() if k != "node_id"}, data)
                # the name is the keeper's identity: the old one goes before the new one starts
                # (a driver lost in these seconds leaves storage's newest to go on from)
                old, self.keeper, self.node = self.keeper, None, None
                _end(old, "ending the keeper on the drained node")
                self._wait_name_free(LOOK_TIMEOUT_S)
                moved = {"node": node, "to": None, "bytes": 0}
                while True:  # the fetched copy, or the newest checkpoint handed meanwhile
                    with self._small:
                        newest, self._newest = self._newest, None
                        if (newest is None and held is None) or self._released.is_set():  # (no new keeper)
                            self._moving = False
                            break
                    carrying, held = newest or held, None
                    outcome = self._hold(*carrying, avoid=draining)
                    if outcome.get("in_memory") in (None, *draining):
                        raise RuntimeError(outcome.get("in_memory_failed") or "made on a node being drained")
                    moved.update(to=outcome["in_memory"], bytes=len(carrying[1]))
                    carrying = None
                moved.update(move_s=round(time.perf_counter() - t, 3), done_wall=round(time.time(), 3))
            except Exception as exc:  # before the kill the keeper stays (tried again later); after it, the
                moved = {"node": node, "failed": one_line(exc)}  # copy is handed once more, else none is kept
                self._retry_at = time.monotonic() + MOVE_RETRY_S
                with self._small:
                    newest, self._newest, self._moving = self._newest, None, False
                # the newest checkpoint handed while the move went on, else the copy the move was
                # carrying or had fetched (it may be one storage never got: not dropped), to the
                # old keeper if it is still there, else a new one
                newest = newest or carrying or held
                if newest is not None:
                    self._hold(*newest, avoid=draining)
        with self._small:
            self._moves.append(KeeperMove(**moved))

    def _wait_name_free(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while bounded(lambda: _handle(self.directory), LOOK_TIMEOUT_S, "looking for the keeper") is not None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ended keeper's name was still taken after {timeout_s:g}s")
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
        self._released.set()
        self.close()
        with self._lock:
            keeper, self.keeper, self.node = self.keeper, None, None
        try:
            keeper = keeper or bounded(lambda: _handle(self.directory), LOOK_TIMEOUT_S, "finding the keeper")
            if keeper is not None:
                _end(keeper, "ending the keeper")
        except Exception as exc:  # gone already, or the cluster does not answer
            return {} if isinstance(exc, ValueError) else {"in_memory_failed": f"not ended: {one_line(exc)}"}
        return {}

    def close(self) -> None:
        """The driver's run ended without finishing (an error, an interrupt): touches stop, the
        keeper keeps the copy for keep_s more."""
        self._stop.set()
