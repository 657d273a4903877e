"""The soak: each mode trains mnist5k for a while with a fault every 5-15 s (4-8 s in the short
form) drawn at random from a seed (replica SIGKILLs, stalls and hangs, spare, shard and partition server SIGKILLs, a
stopped partition server), on the shared Ray
cluster. Checks: the run ends well past a level far below its plateau, no wait ran past its bound (the
run did not fail; the only hangs are the injected ones), no acknowledged update lost without a
cause, and every actor and process of the run gone at the end. Each run's numbers go to
runs/soak/<mode>-seed<seed>.json (docs/reliability.md).

Short form: 35 s per mode, its three faults by ~19 s; both forms run with -m soak (-k short: the short
one). Long form (docs/reliability.md):
    EO_SOAK_S=600 .venv/bin/python -m pytest tests/chaos -m soak -s
A seed that fails becomes a fixed case in SEEDS."""
from __future__ import annotations

import json
import os
import time

import pytest

from orchestrator.testing.chaos import FaultInjector, random_schedule
from orchestrator.config import JobConfig
from orchestrator.trainer import ElasticTrainer
from tests.conftest import REPO
from tests.integration.test_shutdown_ray import alive_run_actors, pid_alive, wait_gone, watched

pytestmark = pytest.mark.ray

SHORT_S = 35.0
SHORT_EVERY_S = (4.0, 8.0)
LONG_EVERY_S = (5.0, 15.0)
SERVER = ("kill_server", "hang_server")
KINDS = {
    "allreduce": ("kill_replica", "kill_replica", "slow_replica", "hang_replica", "kill_spare", *SERVER),
    "downpour": ("kill_replica", "kill_replica", "slow_replica", "hang_replica", "kill_spare", "kill_shard", *SERVER),
    "easgd": ("kill_replica", "kill_replica", "slow_replica", "hang_replica", "kill_spare", "kill_shard", *SERVER),
}
SEEDS = {"allreduce": 8, "downpour": 1, "easgd": 1}  # short form: each seed draws a replica kill, a hang and a server stop
RECOVERED_BY = {"replica_replaced", "replica_dropped", "shard_rebuilt", "spare_replaced", "server_rebuilt"}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def soak(mode: str, seed: int, duration_s: float, tmp_path, every_s: tuple[float, float] = LONG_EVERY_S) -> dict:
    faults = random_schedule(seed, duration_s - 15, KINDS[mode], every_s=every_s, targets=2, start_s=3.0)
    cfg = JobConfig.from_yaml(os.path.join(REPO, "examples", f"mnist_{mode}.yaml"), [
        "scaling.cpus_per_replica=0.5", "fault_tolerance.spares=1", "fault_tolerance.hang_timeout_s=8",
        "fault_tolerance.max_replica_restarts=1000", "checkpoint.every_epochs=1", "tracking.progress_interval_s=0", "tracking.log_every_steps=5",
        "stop.epochs=100000", "stop.at_target=false", f"stop.max_wall_s={duration_s}",
        f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db", f"checkpoint.storage={tmp_path}/ck"])
    before = alive_run_actors()
    trainer = ElasticTrainer(cfg, show_progress=False)
    controller, pids = watched(trainer)

    t0, t0_wall = time.perf_counter(), time.time()
    with FaultInjector(controller, faults, timeout_s=duration_s + 120) as injector:
        result = trainer.fit()
    wall_s = time.perf_counter() - t0
    wait_gone(lambda: alive_run_actors() - before, "actors")
    wait_gone(lambda: {p for p in pids if pid_alive(p)}, "replica processes")
    events = result.events
    recoveries = [e.get("recovery_s") for e in events if e["kind"] in RECOVERED_BY and e.get("recovery_s") is not None]
    fired = [f for f in injector.fired if "error" not in f]
    by_kind: dict[str, int] = {}
    for f in fired:
        by_kind[f["kind"]] = by_kind.get(f["kind"], 0) + 1
    rebuilt = [e for e in events if e["kind"] == "shard_rebuilt"]
    report = {
        "mode": mode, "seed": seed, "duration_s": duration_s, "wall_s": round(wall_s, 1),
        "faults_scheduled": len(faults), "faults_fired": len(fired), "fired_by_kind": by_kind,
        "not_fired": [f for f in injector.fired if "error" in f],
        "replica_failed_by_cause": _count(e["cause"] for e in events if e["kind"] == "replica_failed"),
        "recovered_by_kind": _count(e["kind"] for e in events if e["kind"] in RECOVERED_BY),
        "recovery_s_p50": percentile(recoveries, 0.5), "recovery_s_p95": percentile(recoveries, 0.95),
        "recovery_s_max": max(recoveries, default=None),
        "lost_updates": sum(e["lost_updates"] for e in rebuilt),
        "lost_causes": [e.get("lost_causes") for e in rebuilt if e["lost_updates"]],
        "time_to_target_s": result.time_to_target_s, "final_test_accuracy": result.final.test_accuracy,
        "epochs": result.epochs, "stop_reason": result.stop_reason,
        "accuracy_by_epoch": [round(e["test_accuracy"], 4) for e in events if e["kind"] == "epoch_end"],
        "disturbances": [(e["kind"], e.get("epoch"), e.get("rank", e.get("ranks")), e.get("cause"), e.get("state_from"))
                         for e in events if e["kind"] in ("replica_failed", "replica_replaced", "shard_rebuilt")],
        "faults": [(f["kind"], f.get("target"), round(f["t_wall"] - t0_wall, 2) if "t_wall" in f else None)
                   for f in injector.fired],  # seconds since fit() was called
        "timeline": [(e["t"], e["kind"], e.get("epoch"), e.get("rank", e.get("ranks"))) for e in events
                     if e["kind"] not in ("checkpoint",)],  # when each event came, seconds since fit()
    }
    out = os.path.join(REPO, "runs", "soak")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{mode}-seed{seed}.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))
    return report


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


LEARNED = 0.93  # far below every mode's plateau (downpour wanders at 0.96-0.975 on this test split)
TRAINED = 0.85  # the final model is a trained one (an untrained one is ~0.1)


def check(report: dict) -> None:
    # learned well through the faults; how soon a run first crosses 97% near its plateau is luck.
    # Asynchronous modes dip from one epoch to the next (downpour once 0.974 then 0.923 in its last
    # epoch), so the level is judged on the best of the last three evaluations, not one alone
    assert max(report["accuracy_by_epoch"][-3:]) >= LEARNED, report
    assert report["final_test_accuracy"] >= TRAINED, report
    injected_hangs = report["fired_by_kind"].get("hang_replica", 0)
    assert report["replica_failed_by_cause"].get("hung", 0) <= injected_hangs, report  # no other wait ran out
    assert report["lost_updates"] == 0 or all(report["lost_causes"]), report
    assert report["faults_fired"] >= 1 and not report["not_fired"], report


@pytest.mark.soak
@pytest.mark.parametrize("mode", ["allreduce", "downpour", "easgd"])
def test_soak_short(ray_cluster, tmp_path, mode):
    """Opt-in with the long form (-m soak): in `make test-all` the chaos tests
    (tests/e2e/test_chaos_e2e.py) kill replicas, shards and the server in all three modes on
    fixed schedules, and tests/integration hang and stop them one at a time."""
    check(soak(mode, SEEDS[mode], SHORT_S, tmp_path, SHORT_EVERY_S))


LONG_S = float(os.environ.get("EO_SOAK_S", "600"))


@pytest.mark.soak
@pytest.mark.timeout(LONG_S + 600)  # the soak's own length, then start-up, the end and the checks
@pytest.mark.parametrize("mode", ["allreduce", "downpour", "easgd"])
def test_soak_long(ray_cluster, tmp_path, mode):
    check(soak(mode, SEEDS[mode], LONG_S, tmp_path))
