"""The options people set on day one, as pure inputs (no Ray): decay groups by parameter name
(optimizer.no_decay), the metric early stopping and the best checkpoint watch (stop.watch)."""
from __future__ import annotations

import copy

import pytest
import torch

from orchestrator.config import JobConfig
from orchestrator.errors import ConfigError
from policies.decisions.stop import BestWatch
from policies.rules.recipe import decay_groups, make_optimizer


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(6, 6)
        self.ln = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 3, bias=False)

    def forward(self, x):
        return self.head(self.ln(torch.tanh(self.proj(x))))


def test_no_decay_matches_names_and_module_classes_once_each():
    from examples.huggingface import tiny_gpt2

    m = Block()
    decay, plain = decay_groups(m, ["bias", "Norm"])
    assert {id(p) for p in decay} == {id(m.proj.weight), id(m.head.weight)}
    assert {id(p) for p in plain} == {id(m.proj.bias), id(m.ln.weight), id(m.ln.bias)}
    gpt = tiny_gpt2()  # ln_1.weight: named for no pattern, owned by a LayerNorm; wte tied to lm_head, once
    decay, plain = decay_groups(gpt, ["bias", "norm"])
    names = {id(p): n for n, p in gpt.named_parameters()}
    assert {names[id(p)] for p in plain} >= {"transformer.h.0.ln_1.weight", "transformer.ln_f.weight",
                                              "transformer.h.0.attn.c_attn.bias"}
    assert "transformer.wte.weight" in {names[id(p)] for p in decay}
    assert len(decay) + len(plain) == len(list(gpt.parameters()))


def test_an_allreduce_step_with_no_decay_equals_torch_s_two_groups():
    from policies.rules.allreduce import AllReduceWorker
    from tests.unit.test_allreduce_rule import ThreadSum

    spec = {"name": "adamw", "lr": 0.05, "weight_decay": 0.5, "no_decay": ["bias", "norm"], "kwargs": {}}
    ours, ref = Block(), Block()
    worker = AllReduceWorker(ours, make_optimizer(spec, ours), 256, ThreadSum(1).for_rank(0))
    groups = [{"params": [ref.proj.weight, ref.head.weight]},
              {"params": [ref.proj.bias, ref.ln.weight, ref.ln.bias], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=0.05, weight_decay=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        worker.step(x, y)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    plain = copy.deepcopy(Block())  # without no_decay every parameter decays: the norm's weight moves off 1
    worker = AllReduceWorker(plain, make_optimizer({**spec, "no_decay": []}, plain), 256, ThreadSum(1).for_rank(0))
    worker.step(torch.zeros(8, 6), torch.zeros(8, dtype=torch.long))
    assert not torch.equal(plain.ln.weight, ours.ln.weight)


@pytest.mark.parametrize("mode", ["downpour", "hogwild", "sandblaster"])
def test_no_decay_in_a_mode_whose_shards_update_flat_slices_is_one_line(mode):
    with pytest.raises(ConfigError, match=f"config error: optimizer.no_decay: {mode} updates flat slices"):
        JobConfig.from_dict({}, ["optimizer.no_decay=[bias]", f"strategy.mode={mode}"])


@pytest.mark.parametrize("mode", ["allreduce", "fsdp", "local_sgd", "gossip", "easgd"])
def test_no_decay_builds_in_every_mode_that_takes_it(mode):
    from policies.rules.registry import MODES

    assert MODES[mode].named_optimizer
    JobConfig.from_dict({}, ["optimizer.no_decay=[bias]", f"strategy.mode={mode}"])


def test_the_watched_metric_is_what_early_stopping_and_the_best_checkpoint_follow():
    cfg = JobConfig.from_dict({}, ["stop.watch={metric: test_loss}", "stop.target_accuracy=0.9"])
    assert cfg.headline_metric() == "test_accuracy" and cfg.watched() == ("test_loss", "min")
    assert JobConfig.from_dict({}, ["stop.watch={metric: train_loss, goal: max}"]).watched() == ("train_loss", "max")
    assert JobConfig.from_dict({}, []).watched() == ("test_accuracy", "max")
    with pytest.raises(ConfigError, match="config error: stop.watch.metric: .* no metric 'val_loss'"):
        JobConfig.from_dict({}, ["stop.watch={metric: val_loss}"])
    watch = BestWatch(*cfg.watched(), patience=2)
    for epoch, loss in enumerate([0.9, 0.5, 0.6, 0.55], start=1):  # accuracy would keep rising: not watched
        watch.observe(epoch, {"test_loss": loss, "test_accuracy": 0.5 + epoch / 10})
    assert watch.best_epoch == 2 and "early stopping: test_loss" in watch.stop().reason


def test_a_callback_s_returned_action_is_held_for_the_policy_that_judges_it(capsys):
    from orchestrator.reporting.reporter import Action, Reporter, Requests
    from policies.decisions.stop import EpochSnapshot, StopPolicy

    class StopAtEpoch2:
        def on_event(self, event):
            return Action.STOP if event["kind"] == "epoch_end" and event["epoch"] == 2 else None

    class AsksCheckpoint:
        def on_event(self, event):
            return "checkpoint" if event["kind"] == "progress" else None

    class Confused:
        def on_event(self, event):
            return "pause"

    reporter = Reporter(None, None, 0.0)
    reporter.callbacks.extend([StopAtEpoch2(), AsksCheckpoint(), Confused()])
    reporter.event("epoch_end", epoch=1)
    assert reporter.requests == Requests() and len(reporter.callbacks) == 2  # "pause" is no action: dropped
    assert "returned 'pause', not an action" in capsys.readouterr().err
    reporter.event("progress", step=5)
    reporter.event("epoch_end", epoch=2)
    assert reporter.requests == Requests(stop="StopAtEpoch2 after epoch_end", checkpoint="AsksCheckpoint after progress")
    policy = StopPolicy(epochs=10)
    assert not policy.decide(EpochSnapshot(2, {})).stop
    decision = policy.decide(EpochSnapshot(2, {}, asked=reporter.requests.take(Action.STOP)))
    assert reporter.requests.stop is None  # handed on: asked no more
    assert decision.stop and decision.reason == "callback: StopAtEpoch2 after epoch_end asked to stop"


def test_max_steps_ends_the_run_once_the_model_took_that_many_updates():
    from policies.decisions.stop import EpochSnapshot, StopPolicy

    policy = StopPolicy(epochs=10, max_steps=100)
    assert not policy.decide(EpochSnapshot(1, {}, steps=72)).stop
    decision = policy.decide(EpochSnapshot(2, {}, steps=100))  # mid-epoch 2: the replicas stopped at step 100
    assert decision.stop and decision.reason == "max_steps: 100 >= stop.max_steps (100)"
    assert StopPolicy(epochs=2, max_steps=100).decide(EpochSnapshot(2, {}, steps=90)).reason.startswith("epochs")


def test_max_steps_plans_the_schedule_over_the_steps_the_run_takes():
    from policies.rules.recipe import planned_steps

    assert planned_steps(8721, 64, 1, 2, 4) == 4 * 69
    assert planned_steps(8721, 64, 1, 2, 4, max_steps=100) == 100  # a warm-up fraction is of these
    assert planned_steps(8721, 64, 1, 2, 1, max_steps=100) == 69  # the epochs end it first


@pytest.mark.parametrize("mode", ["allreduce", "fsdp", "local_sgd", "gossip"])
def test_max_steps_is_taken_where_every_member_counts_the_same_updates(mode):
    assert JobConfig.from_dict({}, ["stop.max_steps=12", f"strategy.mode={mode}"]).stop.max_steps == 12


@pytest.mark.parametrize("mode", ["downpour", "hogwild", "sandblaster", "easgd"])
def test_max_steps_in_an_asynchronous_mode_is_one_line(mode):
    with pytest.raises(ConfigError, match=f"config error: stop.max_steps counts updates every replica takes together; "
                                          f"{mode}"):
        JobConfig.from_dict({}, ["stop.max_steps=12", f"strategy.mode={mode}"])
    JobConfig.from_dict({}, ["stop.max_steps=12", "strategy.mode=easgd", "strategy.variant=sync"])
