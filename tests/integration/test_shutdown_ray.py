"""Shutdown in every state: a real SIGTERM (what `ray job stop` and schedulers send; Ctrl-C takes
the same path) delivered to the driver while it is starting, running an epoch, between epochs,
repairing, switching modes, growing, shrinking and checkpointing (and SIGINT, Ctrl-C, while
repairing and switching). Each time: fit() ends with
KeyboardInterrupt, the MLflow run is KILLED with its `ended` event, a final checkpoint is written
(in every state once the replicas exist: while starting it holds the initial model, epoch 0),
and every actor, placement group and replica process of the run is gone.

The signal is sent by the driver to itself from a hook at the point of the state (a wrapped
method or an event callback), so it lands exactly there; the handler, the interrupt and the
clean-up are the real ones."""
from __future__ import annotations

import os
import signal
import time

import pytest
import ray
from mlflow.tracking import MlflowClient

from orchestrator.control import running
from orchestrator.control.reconfig import phase_switch
from orchestrator.testing.chaos import Fault, FaultInjector
from orchestrator.persistence.checkpoint import CheckpointStore
from orchestrator.fleet.replica_group import ReplicaGroup
from orchestrator.trainer import ElasticTrainer
from tests.conftest import job_config

pytestmark = pytest.mark.ray

RUN_CLASSES = ("ModelReplica", "ParameterShard", "PartitionServer")


SENT = {"signal": signal.SIGTERM}  # what the armed points send (a test may choose SIGINT: Ctrl-C)


def sigterm_self() -> None:
    os.kill(os.getpid(), SENT["signal"])


def signal_on_call(monkeypatch, owner, name: str, nth: int = 1) -> dict:
    """Wrap owner.name: its nth call sends SIGTERM to this process first."""
    original = getattr(owner, name)
    seen = {"calls": 0, "fired": False}

    def wrapped(*args, **kwargs):
        seen["calls"] += 1
        if seen["calls"] == nth and not seen["fired"]:
            seen["fired"] = True
            sigterm_self()
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)
    return seen


class SignalOnEvent:
    """A reporting callback: SIGTERM once the run emits an event of `kind` (matching `where`)."""

    def __init__(self, kind: str, **where):
        self.kind, self.where, self.fired = kind, where, False

    def on_event(self, event: dict) -> None:
        if not self.fired and event["kind"] == self.kind and all(event.get(k) == v for k, v in self.where.items()):
            self.fired = True
            sigterm_self()


def alive_run_actors() -> set[str]:
    from ray.util.state import list_actors

    return {a.actor_id for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10000, timeout=30)
            if a.class_name in RUN_CLASSES}


def live_placement_groups() -> set[str]:
    return {pg for pg, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"}


def wait_gone(check, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        left = check()
        if not left:
            return
        assert time.monotonic() < deadline, f"{what} left after the run: {left}"
        time.sleep(0.5)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


SMALL = {"tracking": {"progress_interval_s": 0, "log_every_steps": 2}, "data": {"batch_size": 8},
         "stop": {"epochs": 40, "target_accuracy": None}, "scaling": {"replicas": 2, "cpus_per_replica": 0.5}}


def watched(trainer) -> tuple:
    """(a controller callable for FaultInjector, the set it fills with every replica pid seen)."""
    pids: set[int] = set()

    def controller():
        ctl = trainer.controller
        if ctl is not None:
            pids.update(ctl.group.pids.values())
        return ctl

    return controller, pids


def cfg_for(tmp_path, **sections):
    raw = {k: dict(v) for k, v in SMALL.items()}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    raw["checkpoint"] = {"storage": str(tmp_path / "ck"), **raw.get("checkpoint", {})}
    return job_config(**raw)


def arm(state: str, monkeypatch, tmp_path):
    """The run's config, the callbacks, the faults and whether a final checkpoint is expected."""
    faults, callbacks = [], []
    if state == "starting":  # the process group forming, before any step
        signal_on_call(monkeypatch, ReplicaGroup, "form", nth=1)
        return cfg_for(tmp_path), callbacks, faults, True  # the replicas hold the initial model: epoch 0
    if state == "running":  # mid-epoch: the replicas' streams open
        signal_on_call(monkeypatch, running, "read_item", nth=12)
        return cfg_for(tmp_path), callbacks, faults, True
    if state == "between_epochs":
        callbacks.append(SignalOnEvent("epoch_end", epoch=2))
        return cfg_for(tmp_path), callbacks, faults, True
    if state == "repairing":  # the failure policy has decided; the replacement is being made
        callbacks.append(SignalOnEvent("failure_decision"))
        faults.append(Fault("kill_replica", 1, at_step=30))
        return cfg_for(tmp_path), callbacks, faults, True
    if state == "shrinking":  # no restart budget: the dead replica is dropped
        callbacks.append(SignalOnEvent("failure_decision"))
        faults.append(Fault("kill_replica", 1, at_step=30))
        return cfg_for(tmp_path, fault_tolerance={"max_replica_restarts": 0}), callbacks, faults, True
    if state == "switching":  # inside allreduce -> easgd after its commit point: the new mode's model being evaluated
        signal_on_call(monkeypatch, phase_switch, "evaluate", nth=2)
        phases = [{"mode": "allreduce", "until": {"epochs": 1}}, {"mode": "easgd", "tau": 4}]
        return cfg_for(tmp_path, strategy={"phases": phases}), callbacks, faults, True
    if state == "growing":  # 1 -> 2 replicas: the newcomer's process group forming
        signal_on_call(monkeypatch, ReplicaGroup, "form", nth=2)
        scaling = {"replicas": 1, "max_replicas": 2, "poll_s": 0.5, "grow_after": 1}
        return cfg_for(tmp_path, scaling=scaling), callbacks, faults, True
    if state == "checkpointing":  # a periodic checkpoint being saved
        signal_on_call(monkeypatch, CheckpointStore, "save_serialized", nth=2)
        return cfg_for(tmp_path, checkpoint={"every_epochs": 1}), callbacks, faults, True
    raise AssertionError(state)


@pytest.mark.full  # make test: SIGTERM to a run stepping, through the CLI (tests/e2e/test_cli_e2e.py)
@pytest.mark.parametrize("state,sig", [
    (s, signal.SIGTERM)
    for s in ("starting", "running", "between_epochs", "repairing", "shrinking", "switching", "growing", "checkpointing")]
    + [("repairing", signal.SIGINT)])  # one handler takes both signals
def test_sigterm_in_every_state_ends_killed_and_leaves_nothing(ray_cluster, tmp_path, monkeypatch, state, sig):
    monkeypatch.setitem(SENT, "signal", sig)
    actors_before, groups_before = alive_run_actors(), live_placement_groups()
    cfg, callbacks, faults, checkpoint_expected = arm(state, monkeypatch, tmp_path)
    trainer = ElasticTrainer(cfg, callbacks=callbacks, show_progress=False)
    controller, pids = watched(trainer)

    handlers_before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with FaultInjector(controller, faults) as injector:
        with pytest.raises(KeyboardInterrupt):
            trainer.fit()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers_before  # put back
    assert len(injector.fired) == len(faults)
    ctl = trainer.controller
    pids.update(ctl.group.pids.values())

    client = MlflowClient()
    run = client.get_run(ctl.tracker.run_id)
    assert run.info.status == "KILLED"
    events = ctl.tracker.events
    assert [e["status"] for e in events if e["kind"] == "ended"] == ["KILLED"]
    interrupted = tmp_path / "ck" / run.info.run_id / "interrupted.pt"
    if checkpoint_expected:
        assert interrupted.exists(), [e for e in events if e["kind"] in ("checkpoint", "ended")]
        path, saved = CheckpointStore(str(tmp_path / "ck"), run.info.run_id, keep=100).latest_good()
        assert path.endswith("-interrupted.pt") and saved["mlflow_run_id"] == run.info.run_id
        if state == "switching":  # the replicas run easgd on probation: a run resumed from it is on probation too
            assert saved["probation"]["mode"] == "allreduce" and saved["probation"]["until"] >= 1, saved.get("probation")
    else:
        assert not interrupted.exists()
    wait_gone(lambda: alive_run_actors() - actors_before, "actors")
    wait_gone(lambda: live_placement_groups() - groups_before, "placement groups")
    wait_gone(lambda: {p for p in pids if pid_alive(p)}, "replica processes")
