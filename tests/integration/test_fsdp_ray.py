"""fsdp on real Ray actors and a real gloo group: allreduce's steps with the parameters, gradients
and optimizer state split across the replicas; a SIGKILLed replica's slice comes back from the
last checkpoint; a resumed run re-shards the checkpoint; a model over a replica's memory budget
is refused for allreduce and trains with fsdp."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from orchestrator.fleet.model_state import whole_state
from orchestrator.control.states import Running
from orchestrator.errors import ConfigError
from orchestrator.models import build_model
from orchestrator.persistence.checkpoint import CheckpointStore
from orchestrator.testing.chaos import Fault
from orchestrator.trainer import ElasticTrainer
from policies.rules.fsdp import estimate_bytes
from tests.conftest import job_config
from tests.integration.test_allreduce_ray import _controller
from tests.integration.test_recovery_ray import events, fit_with

pytestmark = pytest.mark.ray


@pytest.mark.full  # make test: the rule against the same reference without Ray (tests/unit/test_fsdp.py)
def test_fsdp_steps_equal_one_process_on_the_union_of_the_batches(ray_cluster):
    """One epoch of fsdp over 2 replicas: the whole model gathered from them equals one process
    applying SGD with momentum to the mean gradient of each step's rows (the traced row ids),
    and every train row is used once."""
    cfg = job_config(strategy={"mode": "fsdp", "timeout_s": 30}, scaling={"replicas": 2, "cpus_per_replica": 0.5},
                     data={"batch_size": 16}, optimizer={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4})
    ctl, dataset = _controller(cfg)
    try:
        assert isinstance(ctl.step(), Running)
        ctl.run_epoch()
        parts = ctl.group.call(ctl.group.ranks, "export_state", what="state")
        state = whole_state(ctl.group, ctl.group.ranks, "state", 60.0)
    finally:
        ctl.shutdown()
    assert [p["rank"] for p in parts] == [0, 1] and state["step"] > 5  # each its own slices, joined
    row = {int(i): k for k, i in enumerate(dataset.train.ids)}
    model = build_model(cfg.model.factory, cfg.model.kwargs, cfg.data.seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    consumed = ctl.consumed[0]
    assert len(consumed[0]) == len(consumed[1]) == state["step"]  # lock step
    for step in range(len(consumed[0])):
        idx = [row[i] for rank in (0, 1) for i in consumed[rank][step]]
        model.zero_grad()
        F.cross_entropy(model(torch.from_numpy(dataset.train.x[idx])), torch.from_numpy(dataset.train.y[idx])).backward()
        opt.step()
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(state["model"][name].numpy(), value.numpy(), rtol=1e-4, atol=1e-5)
    seen = [i for steps in consumed.values() for step in steps for i in step]
    assert sorted(seen) == sorted(int(i) for i in dataset.train.ids)


WIDE = {"factory": "examples.models:wide_mlp", "kwargs": {"hidden": 256, "depth": 4}}  # 206,852 parameters, 0.83 MB


def test_a_model_over_the_budget_trains_with_fsdp_survives_a_kill_and_resumes(ray_cluster, tmp_path):
    """AdamW on a 0.2M-parameter MLP needs 3.3 MB a replica whole (parameters, gradients, two
    moments): with a 2.5 MB budget allreduce is refused before anything starts; fsdp on 2
    replicas holds half of it each (measured on the replicas' tensors) and trains. Replica 1
    SIGKILLed in epoch 2 is replaced and every replica goes on from the newest checkpoint (one
    taken inside the epoch); the
    run reaches its accuracy, and a run resumed from its checkpoint re-shards it and goes on."""
    # every step's progress sent at once and a partition boundary every ~3 steps: the driver sees
    # checkpoint.every_steps come due early in epoch 1 and the replicas pause soon after it (with
    # rows every 10 steps sent once a second and 4 partitions a replica, a slow host could see
    # the first due only when the epoch was ending, and take no checkpoint inside it)
    sections = dict(model=WIDE, optimizer={"name": "adamw", "lr": 1e-3, "weight_decay": 0.0},
                    data={"batch_size": 64, "partitions": 16},
                    scaling={"replicas": 2, "cpus_per_replica": 0.5, "memory_per_replica_mb": 2.5},
                    checkpoint={"storage": str(tmp_path / "ck")}, run={"name": "fsdp"},
                    tracking={"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "log_every_steps": 1,
                              "progress_interval_s": 0})
    model = build_model(WIDE["factory"], WIDE["kwargs"], 0)
    spec = {"name": "adamw", "lr": 1e-3, "weight_decay": 0.0}
    whole, split = estimate_bytes(model, spec, 2, split=False) / 1e6, estimate_bytes(model, spec, 2, split=True) / 1e6
    assert whole > 2.5 > split
    with pytest.raises(ConfigError, match=rf"allreduce needs {whole:.1f} MB a replica .* over the budget of 2.5 MB; "
                                          rf"strategy.mode fsdp splits them .*\({split:.1f} MB a replica at 2 replicas\)"):
        ElasticTrainer(job_config(**sections), show_progress=False).fit()

    # written on the training path (checkpoint.background false): a background write a newer one
    # overtakes is given up unwritten, and which ones are depends on the host's speed
    cfg = job_config(**{**sections, "checkpoint": {"storage": str(tmp_path / "ck"), "every_steps": 5,
                                                   "background": False}},
                     strategy={"mode": "fsdp", "timeout_s": 30}, stop={"epochs": 2})
    result, inj, _, _ = fit_with(cfg, [Fault("kill_replica", 1, at_step=45)])  # 26 steps an epoch
    assert inj.fired and result.epochs == 2
    [failed] = events(result, "replica_failed")
    [replaced] = events(result, "replica_replaced")
    assert failed["epoch"] == replaced["epoch"] == 2 and replaced["ranks"] == [1]
    per_epoch = events(result, "epoch_end")[0]["steps_by_rank"][0]
    # checkpoints inside an epoch too (checkpoint.every_steps: the replicas paused at a partition
    # boundary, the whole model gathered from both); the replicas went on from one of them, taken
    # after epoch 1's end and before the kill (which one: how the pauses fell)
    taken = [(e["epoch"], e["step"]) for e in events(result, "checkpoint")]
    assert any(epoch == 0 and step < per_epoch for epoch, step in taken), taken
    assert replaced["state_from"] == "checkpoint" and per_epoch <= replaced["resumed_from_step"] < 45, replaced
    assert replaced["resumed_from_step"] in [step for _, step in taken], (replaced, taken)
    assert result.final.test_accuracy > 0.9
    measured = [e["replica_state_mb"] for e in events(result, "epoch_end")]
    assert all(0.45 * whole <= m <= 0.55 * whole for m in measured), (measured, whole)

    store = CheckpointStore(str(tmp_path / "ck"), "fsdp", keep=10)
    [entry] = [e for e in store.list() if e.tag == "epoch_0002"]
    state, _ = store.verify(entry)
    sections.pop("run")
    again = ElasticTrainer(job_config(**sections, strategy={"mode": "fsdp", "timeout_s": 30}, stop={"epochs": 3}),
                           show_progress=False, resume=state).fit()
    assert again.epochs == 3 and again.final.test_accuracy >= result.final.test_accuracy - 0.02
    [end3] = [e for e in events(again, "epoch_end") if e["epoch"] == 3]
    assert end3["steps_by_rank"] == [per_epoch, per_epoch]
