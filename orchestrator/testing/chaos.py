"""Fault injection for chaos tests, the soak and benchmarks: one helper that fires a schedule of
faults, fixed or drawn at random from a seed, the way the world makes them.

    from orchestrator.testing.chaos import Fault, FaultInjector, random_schedule
    faults = [Fault("kill_replica", target=1, at_step=40), Fault("kill_replica", 0, during="repair")]
    with FaultInjector(lambda: trainer.controller, faults) as inj:
        result = trainer.fit()
    inj.fired  # [{"kind", "target", "t_wall", "pid", ...}] in the order they happened

Kinds (all act from outside, on the process, as the real thing would):
- `kill_replica`: SIGKILL the replica's process (the pid Ray reported when it started);
- `hang_replica`: SIGSTOP the replica's process: it stops answering but its sockets stay open,
  as a replica stuck in a system call or a livelocked kernel would;
- `slow_replica`: SIGSTOP, then SIGCONT `duration_s` later: a replica that stalls for a while
  (a noisy neighbour, swapping) and comes back;
- `kill_shard`: SIGKILL a parameter shard's process (the sharded modes);
- `hang_shard`: SIGSTOP a parameter shard's process (never resumed);
- `kill_server`: SIGKILL the partition server's process;
- `hang_server`: SIGSTOP the partition server's process (never resumed: the driver must see it
  stopped answering and put a new one in its place);
- `kill_spare`: SIGKILL an idle pre-started spare's process (`target` is its index);
- `drop_node`: remove a worker node from a `ray.cluster_utils.Cluster` given as `cluster`
  (`target` indexes the cluster's worker nodes that hold a replica of the run).
Triggers, exactly one per fault: `at_step` (once a progress row reports that global step or a
later one: rows come every tracking.log_every_steps steps, sent at once with
tracking.progress_interval_s 0, so the fault lands within log_every_steps of the step; with
`in_epoch`, once a replica reports that step within that epoch, or any step of a later one),
`at_s` (seconds after the replicas started) or `during` (the next time the controller is
carrying out a `repair`, a `switch` or a `resize`: a fault inside a reconfiguration; or
`checkpoint`: while the replicas pause for a checkpoint inside an epoch; or `switch_pause`: once
a replica has paused for a switch and before the switch is carried out).
A fault whose target is a replica hits the process that holds that rank when it fires, so two
faults on the same rank hit the original and then its replacement; a target that does not
exist at that moment (a shard in allreduce, a rank dropped) is taken modulo what exists.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import ray

KINDS = ("kill_replica", "hang_replica", "slow_replica", "kill_shard", "kill_server", "hang_server", "kill_spare", "hang_shard",
         "drop_node")
DURING = ("repair", "switch", "resize", "checkpoint", "switch_pause")
REPLICA_KINDS = ("kill_replica", "hang_replica", "slow_replica")
PID_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Fault:
    kind: str
    target: int = 0  # replica rank, shard index, spare index or worker node index
    at_step: Optional[int] = None
    in_epoch: Optional[int] = None  # with at_step: the step counts within this epoch (its progress rows' step_in_epoch)
    at_s: Optional[float] = None
    during: Optional[str] = None
    duration_s: float = 2.0  # slow_replica: how long the process stays stopped

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {KINDS}, got {self.kind!r}")
        if sum(x is not None for x in (self.at_step, self.at_s, self.during)) != 1:
            raise ValueError("give a fault exactly one of at_step, at_s or during")
        if self.in_epoch is not None and self.at_step is None:
            raise ValueError("in_epoch counts at_step within an epoch: give at_step too")
        if self.during is not None and self.during not in DURING:
            raise ValueError(f"during must be one of {DURING}, got {self.during!r}")


def random_schedule(seed: int, duration_s: float, kinds: tuple[str, ...] = ("kill_replica",),
                    every_s: tuple[float, float] = (5.0, 15.0), targets: int = 2,
                    start_s: float = 5.0) -> list[Fault]:
    """Faults of `kinds` at random times from `start_s` to `duration_s`, each `every_s` (a
    uniform range) after the last, on random targets below `targets`: the same seed gives the
    same schedule."""
    rng = random.Random(seed)
    faults, t = [], start_s
    while True:
        t += rng.uniform(*every_s)
        if t > duration_s:
            return faults
        faults.append(Fault(rng.choice(kinds), target=rng.randrange(targets), at_s=round(t, 2)))


def reconfiguring(ctl: Any) -> Optional[str]:
    """What the controller is reconfiguring right now: `repair`, `switch`, `resize`,
    `checkpoint` (the replicas pausing for a checkpoint inside an epoch), `switch_pause` (a
    replica has paused for a switch not carried out yet) or None."""
    from orchestrator.control.states import Reconfiguring, Running, SwitchPlan

    state = getattr(ctl, "state", None)
    if isinstance(state, Reconfiguring):
        return "switch" if isinstance(state.plan, SwitchPlan) else "repair"
    gate = getattr(getattr(getattr(ctl, "context", None), "fleet", None), "pause", None)
    pause = state.pending.pause if isinstance(state, Running) and getattr(gate, "closed", False) else None
    if pause == "checkpoint":
        return "checkpoint"
    record = getattr(getattr(getattr(ctl, "context", None), "ledger", None), "epoch", None)
    if pause == "switch" and record is not None and record.paused_ranks():
        return "switch_pause"  # a replica has paused for it: the others are still on their way
    elastic = getattr(ctl, "elastic", None)
    if elastic is not None and getattr(elastic, "joining", None) is not None:
        return "resize"
    return None


class FaultInjector:
    """Fires `faults` in order against the controller `controller()` returns (the run's controller, or a
    callable: an ElasticTrainer's controller exists only once fit() runs). `cluster`: the
    `ray.cluster_utils.Cluster` that `drop_node` removes nodes from."""

    POLL_S = 0.005
    GIVE_UP_S = 30.0  # a due fault that cannot fire for this long (its target does not exist) is skipped

    def __init__(self, controller: Any, faults: list[Fault], timeout_s: float = 600.0, cluster: Any = None) -> None:
        self._controller: Callable[[], Any] = controller if callable(controller) else (lambda: controller)
        self.faults = list(faults)
        self.timeout_s = timeout_s
        self.cluster = cluster
        self.fired: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="fault-injector")
        self._stopped: list[tuple[float, int]] = []  # (when to SIGCONT, pid) of slowed replicas

    def _due(self, ctl: Any, fault: Fault, t_start: float) -> bool:
        if fault.at_s is not None:
            return time.monotonic() - t_start >= fault.at_s
        if fault.during is not None:
            return reconfiguring(ctl) == fault.during
        if fault.in_epoch is not None:  # a step of that epoch (or any later epoch's: it was passed unseen)
            rows = list((getattr(ctl, "signals", None) or {}).values())
            return any((r.epoch, r.step_in_epoch) >= (fault.in_epoch, fault.at_step) for r in rows)
        progress = getattr(ctl, "progress", None) or {}
        return bool(progress) and max(progress.values()) >= fault.at_step

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        t_start = None
        pending = list(self.faults)
        last_error: dict[Fault, str] = {}
        failing_since: dict[Fault, float] = {}
        while (pending or self._stopped) and not self._stop.is_set() and time.monotonic() < deadline:
            self._resume_slowed()
            ctl = self._controller()
            group = getattr(ctl, "group", None)
            if not pending or group is None or not group.pids:
                time.sleep(self.POLL_S)
                continue
            t_start = t_start or time.monotonic()
            fault = pending[0]
            if self._due(ctl, fault, t_start):
                try:
                    self.fired.append(self._fire(ctl, fault))
                except Exception as exc:  # e.g. the target is being replaced right now: try again
                    last_error[fault] = f"{type(exc).__name__}: {exc}"
                    since = failing_since.setdefault(fault, time.monotonic())
                    if time.monotonic() - since > self.GIVE_UP_S:  # the rest of the schedule goes on
                        self.fired.append({"kind": fault.kind, "target": fault.target,
                                           "error": f"not fired: {last_error[fault]} for {self.GIVE_UP_S:.0f}s"})
                        pending.pop(0)
                    time.sleep(0.05)
                    continue
                pending.pop(0)
            time.sleep(self.POLL_S)
        for fault in pending:  # the run ended (or the injector was stopped) first
            self.fired.append({"kind": fault.kind, "target": fault.target,
                               "error": "not fired before the end" + (f" ({last_error[fault]})" if fault in last_error else "")})
        self._resume_slowed(everything=True)

    def _resume_slowed(self, everything: bool = False) -> None:
        now = time.monotonic()
        for item in list(self._stopped):
            if everything or now >= item[0]:
                self._stopped.remove(item)
                _signal(item[1], signal.SIGCONT)

    def _fire(self, ctl: Any, fault: Fault) -> dict[str, Any]:
        fired = {"kind": fault.kind, "target": fault.target, "t_wall": time.time(), "t_perf": time.perf_counter(),
                 "step": max((getattr(ctl, "progress", None) or {}).values(), default=0),
                 "during": reconfiguring(ctl)}
        if fault.kind == "drop_node":
            node = self._node_to_drop(ctl, fault.target)
            self.cluster.remove_node(node, allow_graceful=False)
            return {**fired, "node_id": node.node_id}
        pid = self._pid(ctl, fault)
        if fault.kind in ("hang_replica", "hang_server", "hang_shard"):
            os.kill(pid, signal.SIGSTOP)
        elif fault.kind == "slow_replica":
            os.kill(pid, signal.SIGSTOP)
            self._stopped.append((time.monotonic() + fault.duration_s, pid))
        else:
            os.kill(pid, signal.SIGKILL)
        return {**fired, "pid": pid}

    def _pid(self, ctl: Any, fault: Fault) -> int:
        if fault.kind in REPLICA_KINDS:
            ranks = sorted(ctl.group.pids)
            return ctl.group.pids[fault.target if fault.target in ctl.group.pids else ranks[fault.target % len(ranks)]]
        if fault.kind in ("kill_shard", "hang_shard"):
            handles = ctl.shard_group.handles
            handle = handles[fault.target % len(handles)]
        elif fault.kind in ("kill_server", "hang_server"):
            handle = ctl.server.handle
        else:
            if not ctl.group.spares:
                raise ValueError("no spare to kill now")
            handle = ctl.group.spares[fault.target % len(ctl.group.spares)]
        return ray.get(handle.pid.remote(), timeout=PID_TIMEOUT_S)

    def _node_to_drop(self, ctl: Any, target: int) -> Any:
        if self.cluster is None:
            raise ValueError("drop_node needs the FaultInjector's cluster")
        held = set(getattr(ctl.group, "nodes", {}).values())
        nodes = [n for n in self.cluster.list_all_nodes() if n is not self.cluster.head_node and n.node_id in held]
        if not nodes:
            raise ValueError("no worker node holds a replica yet")
        return nodes[target % len(nodes)]

    def __enter__(self) -> "FaultInjector":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._resume_slowed(everything=True)


def kill_process(actor: Any, sig: int = signal.SIGKILL) -> int:
    """Send `sig` (SIGKILL unless told) to the process of an actor that has a `pid()` method
    (replicas, shards, the partition server), as the OOM killer or a lost node would; its pid."""
    pid = ray.get(actor.pid.remote(), timeout=PID_TIMEOUT_S)
    os.kill(pid, sig)
    return pid


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
