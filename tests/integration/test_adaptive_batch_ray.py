"""data.adaptive_batch on real Ray actors and a real gloo group: allreduce's batch grows at epoch
ends when the gradient noise measured across the replicas allows, the learning rate follows it,
a replacement and a resumed run take the grown batch."""
from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.persistence.checkpoint import CheckpointStore
from orchestrator.testing.chaos import Fault
from orchestrator.trainer import ElasticTrainer
from policies.decisions.batch_size import AdaptiveBatch
from tests.conftest import job_config
from tests.integration.test_recovery_ray import events, fit_with

pytestmark = pytest.mark.ray

LR = 0.05


def test_the_batch_grows_with_the_noise_the_rate_follows_and_a_replacement_and_a_resume_keep_it(ray_cluster,
                                                                                                  tmp_path):
    """The main example's CNN on mnist5k from 16 rows a replica, up to 64. At each epoch's end the
    decision is the rule's on the epoch's measured diversity (every growth and every hold); the
    steps of an epoch follow the batch; each growth's rate is the linear rule's (optimizer.lr x
    batch / 16), reached by a ramp that only rises; replica 1 SIGKILLed in epoch 3 is replaced by
    one stepping on the grown batch; the run resumed from its last checkpoint goes on at it."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sections = dict(model={"factory": "examples.models:mnist_cnn"},
                    data={"source": "builtin:mnist5k", "batch_size": {"adaptive": {"min": 16, "max": 64}}},
                    optimizer={"lr": LR}, scaling={"replicas": 2, "cpus_per_replica": 0.5},
                    tracking={"progress_interval_s": 0, "log_every_steps": 1, "tracking_uri": uri},
                    checkpoint={"storage": str(tmp_path / "ck")}, run={"name": "adaptive"})
    # 4,000 train rows in 8 partitions of 500, 4 a replica: 128 steps at 16, 64 at 32, 32 at 64; step 200 is in epoch 3
    result, inj, _, _ = fit_with(job_config(**sections, stop={"epochs": 3}), [Fault("kill_replica", 1, at_step=200)])
    assert inj.fired and result.epochs == 3 and result.final.test_accuracy > 0.9
    ends, grown = events(result, "epoch_end"), events(result, "batch_size_changed")
    rule, batch, after = AdaptiveBatch(16, 64, 2), 16, []
    disturbed = {e["epoch"] for e in events(result, "replica_failed")}  # its figure mixes group sizes: no decision
    for end in ends:  # the rule on the epoch's own figure, every epoch: the growths and the holds
        assert {r: f["batch_rows"] for r, f in end["step_figures"].items()} == {"0": batch, "1": batch}, end
        decided = None if end["epoch"] in disturbed else rule.decide(end["gradient_diversity"], 2, batch)
        changed = [g for g in grown if g["epoch"] == end["epoch"]]
        assert [(g["batch_from"], g["batch_to"]) for g in changed] == ([(batch, decided[0])] if decided else [])
        batch = decided[0] if decided else batch
        after.append(batch)
    assert grown and grown[0]["epoch"] == 1, [(e["epoch"], e["gradient_diversity"]) for e in ends]
    for g in grown:
        assert g["global_batch"] == 2 * g["batch_to"] and g["noise_scale"] >= g["global_batch"], g
        assert g["lr_target"] == pytest.approx(LR * g["batch_to"] / 16) and g["lr_warmup_steps"] == 100, g
    assert [e["steps_by_rank"][0] for e in ends][:2] == [128, 4 * -(-500 // grown[0]["batch_to"])]
    [replaced] = events(result, "replica_replaced")
    assert replaced["ranks"] == [1] and replaced["epoch"] == 3
    client = MlflowClient(uri)
    lrs = [m.value for m in sorted(client.get_metric_history(result.mlflow_run_id, "lr"), key=lambda m: m.step)]
    assert lrs[0] == pytest.approx(LR) and all(b >= a - 1e-9 for a, b in zip(lrs, lrs[1:])) and lrs[-1] > 2 * LR
    sizes = [m.value for m in sorted(client.get_metric_history(result.mlflow_run_id, "batch_size"), key=lambda m: m.step)]
    assert sizes == after, (sizes, after)  # each epoch's end: the batch the next epoch takes

    entry = [e for e in CheckpointStore(str(tmp_path / "ck"), "adaptive", keep=10).list() if e.tag == "epoch_0003"]
    state, _ = CheckpointStore(str(tmp_path / "ck"), "adaptive", keep=10).verify(entry[0])
    assert state["run"]["batch_size"] == batch
    sections.pop("run")
    again = ElasticTrainer(job_config(**sections, stop={"epochs": 4}), show_progress=False, resume=state).fit()
    [end4] = [e for e in events(again, "epoch_end") if e["epoch"] == 4]
    assert {r: f["batch_rows"] for r, f in end4["step_figures"].items()} == {"0": batch, "1": batch}, end4
    assert end4["steps_by_rank"] == [4 * -(-500 // batch)] * 2
