"""CheckpointKeeper: a run's newest checkpoint held in memory (`checkpoint.in_memory`), by a
detached actor the driver's death does not take along. It holds one serialized checkpoint (the
bytes the store would write, and their sidecar: step, epoch, tag, length, sha256) and answers
whoever asks for it: the run started again by name or `resume` goes on from it when it is at
least as new as the store's newest good checkpoint (orchestrator/persistence/memory_copy.py).

Its life: the driver that made it touches it every `keep_s / 4`; `keep_s` without a touch,
a hold or a fetch (its driver died and nobody started the run again) and it ends itself, so a
lost run never holds a node's memory for longer. The run's final checkpoint ends it (`ray.kill`)."""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

import ray

NAMESPACE = "elastic-orchestrator"  # the keepers' Ray namespace: a job finds the keeper of a job before it
CHECK_S = 5.0  # how often a keeper looks whether it was left alone for keep_s


@ray.remote(num_cpus=0, max_restarts=0)
class CheckpointKeeper:
    def __init__(self, directory: str, keep_s: float) -> None:
        self.directory, self.keep_s = directory, keep_s
        self.meta: Optional[dict[str, Any]] = None
        self.data: Optional[bytes] = None
        self.last_contact = time.monotonic()
        threading.Thread(target=self._expire, name="keeper expiry", daemon=True).start()

    def _expire(self) -> None:
        while time.monotonic() - self.last_contact < self.keep_s:
            time.sleep(min(CHECK_S, self.keep_s / 4))
        try:
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        finally:  # the kill did not come through (the control plane away): the process ends anyway
            time.sleep(30)
            os._exit(0)

    def hold(self, meta: dict[str, Any], data: bytes) -> dict[str, Any]:
        """Keep this checkpoint instead of the one before; returns where it is held."""
        self.meta, self.data, self.last_contact = dict(meta), data, time.monotonic()
        return {"node_id": ray.get_runtime_context().get_node_id(), "bytes": len(data)}

    def peek(self) -> Optional[dict[str, Any]]:
        """The held checkpoint's sidecar, without its bytes; None: nothing held yet."""
        self.last_contact = time.monotonic()
        return None if self.meta is None else dict(self.meta)

    def fetch(self) -> Optional[tuple[dict[str, Any], bytes]]:
        """The held checkpoint's sidecar (with the node holding it) and its bytes; None: nothing held yet."""
        self.last_contact = time.monotonic()
        return None if self.meta is None else ({**self.meta, "node_id": ray.get_runtime_context().get_node_id()},
                                               self.data)

    def touch(self) -> None:
        self.last_contact = time.monotonic()

    def pid(self) -> int:
        return os.getpid()
