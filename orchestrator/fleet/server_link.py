"""The driver's side of the partition server: one named actor at a time, rebuilt from its journal
when its process dies or stops answering, so the epoch's ledger outlives it.

- The server rewrites a journal file (in a private directory on the driver's node, where the
  server runs) after every call that changes its state, before it answers
  (actors/partitions/server.py).
- Every driver call carries an id; the replicas' grant calls carry their own. A call sent again
  to a rebuilt server is applied once.
- The driver pings the server while it waits on anything (`poll`). A call or ping that meets a
  dead process, or a ping unanswered for `hang_s` (the process is stopped), starts the next
  incarnation: it is named `<name>-g<n>` (actors/incarnation.py), reads the journal and gets
  every driver call not yet answered, sent again. The replicas look the new name up themselves
  when their own grant call fails.
- What it did is one `server_rebuilt` event per rebuild: how it was seen, the epoch, the
  partitions the ledger held as served, and the seconds from detection to the new server
  answering. Nothing acknowledged is lost: the journal holds every answered call.
"""
from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import ray
from ray.exceptions import RayActorError

from actors.incarnation import incarnation_name
from orchestrator.errors import TrainingError
from orchestrator.fleet.outcomes import DIED, HUNG, RAISED, gather, outcome_of
from policies.messages import FleetEvent

START_TIMEOUT_S = 60.0  # a rebuilt server's process starts and reads its journal within this
REBUILDS_PER_CALL = 5  # a call that meets this many dead or stopped incarnations in a row ends the run


@dataclass
class Call:
    id: int
    method: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    ref: Any = None


class ServerLink:
    def __init__(self, rows: list[int], replicas: int, seed: int, pinned: bool, shuffle: bool, max_grant: int,
                 placement: Any, hang_s: float, timeout_s: float, backups: bool = False) -> None:
        self.args = (rows, replicas, seed, pinned, shuffle, max_grant, backups)
        self.dir = tempfile.mkdtemp(prefix="eo-ledger-")
        self.journal = os.path.join(self.dir, "ledger.pkl")
        self.name = f"eo-{uuid.uuid4().hex[:12]}-partitions"
        self.namespace = ray.get_runtime_context().namespace
        self.placement, self.hang_s, self.timeout_s = placement, hang_s, timeout_s  # timeout_s: strategy.timeout_s
        self.generation, self.handle = -1, None
        self.pending: dict[int, Call] = {}  # sent, answer not read yet: sent again to a rebuilt server
        self.events: list[dict] = []
        self._ids = itertools.count(1)
        self._ping: Any = None
        self._ping_at = 0.0
        self._start()

    def _start(self) -> None:
        from actors.partitions.server import PartitionServer

        while True:
            self.generation += 1
            try:
                self.handle = PartitionServer.options(
                    name=incarnation_name(self.name, self.generation), namespace=self.namespace, max_restarts=0,
                    scheduling_strategy=self.placement).remote(*self.args, journal=self.journal,
                                                               generation=self.generation)
                return
            except ValueError:  # the name is held (an incarnation left behind): the next one
                continue

    def address(self):
        """What a replica's reader needs to reach the server, and its successors."""
        from actors.partitions.server import ServerAddress

        return ServerAddress(self.handle, self.name, self.namespace, self.generation)

    # ---- calls ------------------------------------------------------------------------------
    def send(self, method: str, *args, **kwargs) -> Call:
        call = Call(next(self._ids), method, args, kwargs)
        self._send(call)
        self.pending[call.id] = call
        return call

    def _send(self, call: Call) -> None:
        call.ref = getattr(self.handle, call.method).remote(*call.args, call=call.id, **call.kwargs)

    def result(self, call: Call, what: str = "partition server", timeout_s: Optional[float] = None) -> Any:
        """`call`'s answer. A server that died, or does not answer within hang_s (it answers in
        milliseconds when it runs: it is taken for stopped and killed), is rebuilt and the call
        sent again, at most REBUILDS_PER_CALL times in a row; past that, or when the server
        refused the call, a TrainingError naming `what`."""
        timeout_s = min(self.timeout_s if timeout_s is None else timeout_s, self.hang_s)
        rebuilds = 0
        while True:
            out = gather({"server": call.ref}, timeout_s)["server"]  # ok | died | hung | raised, as a value
            if out.status in (DIED, HUNG):
                rebuilds += 1
                if rebuilds > REBUILDS_PER_CALL:
                    raise TrainingError(f"{what}: the partition server died or stopped {REBUILDS_PER_CALL} times "
                                        "during one call")
                stopped = out.status == HUNG
                self._rebuild(f"no answer to a call for {timeout_s:.0f}s" if stopped else "call", kill=stopped)
                continue
            self.pending.pop(call.id, None)
            if out.status == RAISED:
                raise TrainingError(f"{what}: {out.detail}")
            return out.value

    def call(self, method: str, *args, what: str = "partition server", timeout_s: Optional[float] = None, **kwargs) -> Any:
        return self.result(self.send(method, *args, **kwargs), what, timeout_s)

    # ---- watching -----------------------------------------------------------------------------
    def poll(self) -> list[FleetEvent]:
        """Never waits: look at the last ping's answer (a dead server is rebuilt, one silent for
        hang_s is killed and rebuilt), send the next; the rebuilds' events since the last poll."""
        now = time.monotonic()
        if self._ping is not None:
            if ray.wait([self._ping], timeout=0, fetch_local=True)[0]:
                try:
                    ray.get(self._ping, timeout=0)
                    self._ping = None
                except RayActorError as exc:
                    if outcome_of(exc).status == DIED:
                        self._rebuild("ping")
                    else:  # not known gone: asked again, silent since the first unanswered ping
                        self._ping = self.handle.incarnation.remote()
            if self._ping is not None and now - self._ping_at > self.hang_s:
                self._rebuild(f"no answer to a ping for {self.hang_s:.0f}s", kill=True)
        if self._ping is None:
            self._ping, self._ping_at = self.handle.incarnation.remote(), now
        events, self.events = self.events, []
        return events

    def _rebuild(self, detected_by: str, kill: bool = False) -> None:
        """The next incarnation, from the journal; every unanswered driver call sent to it again."""
        t0 = time.monotonic()
        if kill:
            try:
                ray.kill(self.handle, no_restart=True)
            except Exception:
                pass
        self._ping = None
        self._start()
        started = gather({"server": self.handle.status.remote()}, START_TIMEOUT_S)["server"]
        if not started.ok:  # died, hung (no answer within START_TIMEOUT_S, or unreachable) or raised
            raise TrainingError(f"partition server: its incarnation {self.generation} did not start within "
                                f"{START_TIMEOUT_S:.0f}s ({started.status}: {started.detail})")
        status = started.value
        for call_id in sorted(self.pending):
            self._send(self.pending[call_id])
        took = round(time.monotonic() - t0, 3)
        self.events.append(FleetEvent("server_rebuilt", {
            "generation": self.generation, "detected_by": detected_by, "epoch": status.epoch,
            "partitions_done": len(status.done), "calls_resent": len(self.pending), "recovery_s": took},
            f"partition server died ({detected_by}); rebuilt from its journal in {took:.2f}s, epoch {status.epoch} "
            f"with {len(status.done)} partitions served kept"))

    def shutdown(self) -> None:
        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)
