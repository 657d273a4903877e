"""Records tests/data/decisions_kill_switch_grow.jsonl, the run tests/unit/test_decision_log.py
replays: examples/mnist_phases.yaml (downpour until step 100, then allreduce) at 2 replicas with
room for 3 (a grow), checkpoint.every_steps 20 (checkpoints inside epochs), replica 1's process
SIGKILLed at step 40. Run from the repository's root, on a machine with 2 free cores:

    .venv/bin/python tests/data/record_decisions.py tests/data/decisions_kill_switch_grow.jsonl
"""
import sys, tempfile
import ray
from orchestrator.config import JobConfig
from orchestrator.trainer import ElasticTrainer
from orchestrator.testing.chaos import Fault, FaultInjector
from orchestrator.control.decide import read_jsonl, replay

tmp = tempfile.mkdtemp()
ray.init(num_cpus=4, logging_level="WARNING")
cfg = JobConfig.from_yaml("examples/mnist_phases.yaml", [
    "scaling.cpus_per_replica=0.5", "tracking.progress_interval_s=0", "tracking.log_every_steps=2",
    "stop.epochs=5", "stop.at_target=false", "scaling.replicas=2", "scaling.max_replicas=3",
    "scaling.poll_s=0.5", "scaling.grow_after=1", "checkpoint.every_steps=20",
    "strategy.phases=[{mode: downpour, n_push: 4, optimizer: {lr: 0.0125, momentum: 0.5}, until: {steps: 100}}, "
    "{mode: allreduce, until: {epochs: 3}}, {mode: easgd, tau: 8, momentum: 0.9}]",
    f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db", f"checkpoint.storage={tmp}/ck"])
trainer = ElasticTrainer(cfg, show_progress=False)
with FaultInjector(lambda: trainer.controller, [Fault("kill_replica", 1, at_step=40)]) as inj:
    result = trainer.fit()
print("fired", inj.fired)
print([(e["kind"], e.get("to") or e.get("direction")) for e in result.events if e["kind"] in ("mode_switch", "resize", "replica_replaced", "checkpoint")])
text = trainer.controller.context.ledger.decisions.jsonl()
recs = read_jsonl(text)
print(len(recs), "records; kinds", sorted({r["exit"]["kind"] for r in recs}), "mismatches", replay(recs))
open(sys.argv[1], "w").write(text)
ray.shutdown()
