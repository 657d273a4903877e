"""Models as the ecosystem writes them (policies/rules/outputs.py), without Ray: `forward` may
return a tensor, a tuple (predictions first), a dict or a Hugging Face `ModelOutput`, and with
task `model_loss` the model gets the labels and its own loss is the loss. In every mode's update
rule one step on each kind of model moves the parameters exactly as the tensor model's step does;
evaluation, the checks before a run and the MLflow signature read the predictions."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from transformers.utils import ModelOutput

from orchestrator.errors import ConfigError
from policies.rules.outputs import own_loss, predictions, run_model
from policies.rules.recipe import Recipe
from policies.rules.sharding import FlatParams
from policies.rules.tasks import Classification, ModelLoss
from tests.conftest import job_config
from tests.unit.local_shards import LocalShardClient
from tests.unit.test_allreduce_rule import ThreadSum


@dataclass
class Out(ModelOutput):
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None


class Net(torch.nn.Module):
    """One small classifier; `kind` says how its forward hands the logits back. With `labels=`
    (task model_loss) it computes its own cross-entropy, as a Hugging Face model does."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
        self.kind = kind

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None):
        logits = self.body(x)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        if self.kind == "tensor":
            assert labels is None
            return logits
        if self.kind == "tuple":
            return (logits, logits.detach() * 0) if loss is None else (loss, logits)
        if self.kind == "dict":
            return {"logits": logits, "hidden": logits.detach()} | ({} if loss is None else {"loss": loss})
        return Out(loss=loss, logits=logits)


KINDS = ("tensor", "tuple", "dict", "model_output")
CASES = [(k, "classification") for k in KINDS] + [(k, "model_loss") for k in KINDS[1:]]


def task_of(name: str):
    return Classification() if name == "classification" else ModelLoss(causal=False)


def batches(n: int = 3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(10, 6, generator=g), torch.randint(0, 3, (10,), generator=g)) for _ in range(n)]


def _allreduce(m, task):
    from policies.rules.allreduce import AllReduceWorker

    return AllReduceWorker(m, torch.optim.SGD(m.parameters(), lr=0.1), 256, ThreadSum(1).for_rank(0), task=task)


def _downpour(m, task):
    from policies.rules.downpour import DownpourWorker

    flat = FlatParams(list(m.parameters()))
    client = LocalShardClient(flat.params.clone(), 2, optimizer="sgd", lr=0.1)
    return DownpourWorker(m, flat, client, rank=0, lr=0.1, task=task)


def _easgd(m, task):
    from policies.rules.easgd import EasgdWorker

    flat = FlatParams(list(m.parameters()))
    return EasgdWorker(m, flat, torch.optim.SGD(m.parameters(), lr=0.1), LocalShardClient(flat.params.clone(), 1),
                       replicas=1, alpha=0.3, tau=2, task=task)


def _local_sgd(m, task):
    from policies.rules.local_sgd import LocalSgdWorker

    return LocalSgdWorker(m, torch.optim.SGD(m.parameters(), lr=0.1), ThreadSum(1).for_rank(0), period=2, task=task)


def _gossip(m, task):
    from policies.rules.gossip import GossipWorker

    return GossipWorker(m, torch.optim.SGD(m.parameters(), lr=0.1), ThreadSum(1).for_rank(0), task=task)


def _hogwild(m, task):
    import os

    from policies.rules.hogwild import HogwildWorker

    flat = FlatParams(list(m.parameters()))
    shared = flat.params.detach().clone()  # the shard's vector, held by this (live) process
    return HogwildWorker(m, flat, torch.optim.SGD(m.parameters(), lr=0.1), lambda: (shared, os.getpid()), None,
                         task=task)


def _sandblaster(m, task):
    from policies.rules.gradient_tasks import SandblasterWorker
    from tests.unit.test_sandblaster import InProcessShards

    flat = FlatParams(list(m.parameters()))
    shards = InProcessShards(flat.params.clone(), [(0, 40), (40, flat.numel)])
    w = SandblasterWorker(m, flat, shards, lambda: [(0, 10)], task, Recipe())
    w.begin_segment(0)
    w.shards_for_test = shards
    return w


def _fsdp(m, task):
    import torch.distributed as dist

    from actors.replica.reducer import ProcessGroupReducer, free_port, new_process_group
    from policies.rules.fsdp import FsdpWorker
    from tests.unit.test_fsdp import SPEC

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))
    pg = new_process_group(store, 0, 1, "gloo", timedelta(seconds=30), default=True)
    reducer = ProcessGroupReducer()
    reducer.configure(store, pg, 30.0)
    return FsdpWorker(m, SPEC, reducer, task=task, rebuild=lambda: copy.deepcopy(m), adopt=lambda new: None)


BUILD = {"allreduce": _allreduce, "downpour": _downpour, "easgd": _easgd, "local_sgd": _local_sgd,
         "gossip": _gossip, "hogwild": _hogwild, "sandblaster": _sandblaster, "fsdp": _fsdp}


def after_steps(mode: str, kind: str, task_name: str):
    """What the mode's step leaves, after 3 steps on a model of `kind`: the replica's parameters
    (sandblaster: the shards' gradient sum, its parameters never move)."""
    m = Net(kind)
    worker = BUILD[mode](m, task_of(task_name))
    try:
        losses = [worker.step(x, y, more=i < 2).loss for i, (x, y) in enumerate(batches())]
        if mode == "sandblaster":
            return torch.cat([p.sum for p in worker.shards_for_test.passes]).float(), losses
        if mode == "fsdp":
            return torch.cat([p.full_tensor().detach().reshape(-1) for p in worker.model.parameters()]), losses
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()]), losses
    finally:
        if mode == "fsdp":
            import torch.distributed as dist

            dist.destroy_process_group()


def test_every_mode_is_in_the_table():
    from policies.rules.registry import MODES

    assert set(BUILD) == set(MODES)


@pytest.mark.parametrize("mode", sorted(BUILD))
def test_each_kind_of_model_steps_every_mode_as_a_tensor_model_does(mode):
    want, want_losses = after_steps(mode, "tensor", "classification")
    for kind, task_name in CASES[1:]:
        got, losses = after_steps(mode, kind, task_name)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{mode}: {kind} {task_name}")
        assert losses == pytest.approx(want_losses, rel=1e-6), (mode, kind, task_name)


@pytest.mark.parametrize("kind, task_name", CASES)
def test_evaluation_reads_the_predictions_and_the_model_s_own_loss_is_its_loss(kind, task_name):
    m, task = Net(kind), task_of(task_name)
    x, y = batches(1)[0]
    out = run_model(m, task, x, y)
    logits = m.body(x)
    torch.testing.assert_close(predictions(out, with_loss=task.labels_to_model), logits)
    torch.testing.assert_close(task.loss(out, y), F.cross_entropy(logits, y))
    sums = task.evaluate(out, y)
    metrics = task.finish(sums)
    assert metrics["test_loss"] == pytest.approx(float(F.cross_entropy(logits.double(), y)), rel=1e-6)
    assert metrics["test_accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))


def test_the_causal_model_loss_scores_the_next_token_and_skips_masked_labels():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    labels[1, 3] = -100
    own = F.cross_entropy(logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1), ignore_index=-100)
    task = ModelLoss()
    out = Out(loss=own, logits=logits)
    assert task.loss(out, labels) is not None and float(task.loss(out, labels)) == pytest.approx(float(own))
    sums = task.evaluate(out, labels)
    assert sums["scored"] == 7.0  # 2 rows x 4 next tokens, one masked
    metrics = task.finish(sums)
    assert set(metrics) == {"test_loss", "test_perplexity"}
    assert metrics["test_loss"] == pytest.approx(float(own), rel=1e-6)


def test_outputs_the_task_cannot_read_are_one_line_errors():
    with pytest.raises(ValueError, match="no 'logits'"):
        predictions({"a": torch.zeros(1), "b": torch.zeros(1)})
    with pytest.raises(ValueError, match="needs its own loss"):
        own_loss(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="a tensor, a tuple"):
        predictions("text")


@pytest.mark.parametrize("kind", KINDS)
def test_the_checks_before_a_run_take_every_kind_and_refuse_a_tensor_for_model_loss(kind, monkeypatch):
    from orchestrator.trainer import check_model_and_task

    monkeypatch.setattr("tests.unit.test_model_outputs.KIND", kind, raising=False)
    x, y = batches(1)[0]
    cfg = job_config(model={"factory": "tests.unit.test_model_outputs:factory"})
    check_model_and_task(cfg, Net(kind), x.numpy(), y.numpy(), 3)
    cfg = job_config(model={"factory": "tests.unit.test_model_outputs:factory"},
                     task={"name": "model_loss", "kwargs": {"causal": False}})
    if kind == "tensor":
        with pytest.raises(ConfigError, match="config error: model.factory: .* does not accept .*labels="):
            check_model_and_task(cfg, Net(kind), x.numpy(), y.numpy(), 3)
    else:
        check_model_and_task(cfg, Net(kind), x.numpy(), y.numpy(), 3)


def test_a_model_that_does_not_shift_as_causal_says_is_refused():
    from orchestrator.trainer import check_model_and_task

    class Tokens(torch.nn.Module):  # a token classifier: its loss scores labels in place, not shifted
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(9, 9)

        def forward(self, input_ids, labels=None):
            logits = self.emb(input_ids)
            return Out(loss=F.cross_entropy(logits.reshape(-1, 9), labels.reshape(-1)), logits=logits)

    x = {"input_ids": torch.randint(0, 9, (4, 6)).numpy()}
    y = torch.randint(0, 9, (4, 6)).numpy()
    causal = job_config(task={"name": "model_loss"})
    with pytest.raises(ConfigError, match=r"config error: task.kwargs.causal: .* does not shift .*causal: false"):
        check_model_and_task(causal, Tokens(), x, y)
    check_model_and_task(job_config(task={"name": "model_loss", "kwargs": {"causal": False}}), Tokens(), x, y)


def test_the_mlflow_signature_is_of_the_predictions(tmp_path):
    """The logged model's output example is the logits of a ModelOutput model."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from orchestrator.reporting.tracking import Tracker

    uri = f"sqlite:///{tmp_path}/runs.db"
    tracker = Tracker(uri, "outputs", None)
    x = batches(1)[0][0][:4].numpy()
    assert tracker.log_model(Net("model_output").eval(), x)
    assert tracker.finish("FINISHED", timeout_s=10)
    mlflow.set_tracking_uri(uri)
    try:
        info = mlflow.models.get_model_info(f"runs:/{tracker.run_id}/model")
        assert info.signature.outputs.to_dict()[0]["tensor-spec"]["shape"] == (-1, 3)
        assert MlflowClient(uri).get_run(tracker.run_id).info.status == "FINISHED"
    finally:
        mlflow.set_tracking_uri(None)


KIND = "tensor"


def factory():
    return Net(KIND)
