"""The run's contexts (orchestrator/control/context.py), without Ray: the deciders are passed in,
and the ones passed are those the run uses and checkpoints."""
import time

from orchestrator.control.context import RunContext, make_policies
from orchestrator.data.in_memory import load_source
from policies.decisions.failure import FailurePolicy
from tests.conftest import job_config


def test_policies_passed_in_are_the_runs_and_its_checkpoint_holds_their_state():
    cfg = job_config(fault_tolerance={"max_replica_restarts": 3})
    dataset = load_source(cfg.data.source, cfg.data.seed)
    given = make_policies(cfg, cfg.headline_metric(), cfg.task.build(), dataset)
    given.failure = FailurePolicy(0, 0.0, 1)  # no restart at all, whatever the config says
    given.failure.restarts = 2  # and a budget already spent
    ctx = RunContext(cfg, dataset, None, time.perf_counter(), policies=given)
    assert ctx.policies is given and ctx.policies.failure.max_restarts == 0
    saved = ctx.position.save()
    assert saved["failure"]["restarts"] == 2 and saved["policy"] == given.switch.state_dict()
    default = RunContext(cfg, dataset, None, time.perf_counter())
    assert default.policies.failure.max_restarts == 3 and default.position.save()["failure"]["restarts"] == 0
