"""The step a user would write (policies/rules/recipe.py) against a plain single-process loop, without
Ray: any torch.optim optimizer, learning-rate schedules, clipping, accumulation and mixed
precision, in allreduce (threads as replicas), on a shard's slice and in the local modes."""
import math

import pytest
import torch
import torch.nn.functional as F

from examples.models import tiny_mlp
from policies.rules.allreduce import AllReduceWorker
from policies.rules.recipe import Recipe, RecipeError, Schedule, make_optimizer, optimizer_class, planned_steps, shardable
from policies.rules.sharding import ShardState
from tests.unit.test_allreduce_rule import ThreadSum, run_replicas

ADAMW = {"name": "adamw", "lr": 3e-3, "momentum": 0.9, "weight_decay": 0.1, "kwargs": {"betas": [0.9, 0.95], "eps": 1e-8}}
COSINE = {"name": "cosine", "warmup": 0.25, "min_factor": 0.1}


def model(seed=0):
    torch.manual_seed(seed)
    return tiny_mlp(in_features=8, hidden=16, num_classes=3)


def batches(steps, rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 8, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(steps)]


# ---- optimizers -----------------------------------------------------------------------------
def test_any_torch_optimizer_by_name_or_module_class_with_its_kwargs():
    m = model()
    opt = make_optimizer(ADAMW, m.parameters())
    assert type(opt) is torch.optim.AdamW
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["weight_decay"] == 0.1
    assert type(make_optimizer({**ADAMW, "name": "torch.optim:RMSprop", "kwargs": {"alpha": 0.9}},
                               m.parameters())) is torch.optim.RMSprop
    sgd = make_optimizer({"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}, m.parameters())
    assert sgd.defaults["momentum"] == 0.9


@pytest.mark.parametrize("name, says", [("adamz", "unknown optimizer 'adamz'"),
                                        ("collections:OrderedDict", "not a torch.optim.Optimizer subclass"),
                                        ("no_such_module:Opt", "no_such_module")])
def test_an_unknown_optimizer_is_a_one_line_error(name, says):
    with pytest.raises(RecipeError, match=says):
        optimizer_class(name)


def test_bad_optimizer_kwargs_name_the_call():
    with pytest.raises(RecipeError, match=r"adamw\(.*bogus=1.*failed \(TypeError"):
        make_optimizer({**ADAMW, "kwargs": {"bogus": 1}}, model().parameters())


def test_only_element_wise_optimizers_shard():
    assert shardable("adamw") is None and shardable("sgd") is None
    assert "closure" in shardable("lbfgs") and "factored" in shardable("adafactor")


def test_a_shard_applying_adamw_to_its_slice_equals_adamw_on_the_whole_vector():
    torch.manual_seed(0)
    whole = torch.nn.Parameter(torch.randn(10))
    ref = make_optimizer(ADAMW, [whole])
    shards = [ShardState(whole.detach()[lo:hi].clone(), {"name": "adamw", "kwargs": ADAMW["kwargs"]}, ADAMW["lr"],
                         0.0, ADAMW["weight_decay"]) for lo, hi in ((0, 4), (4, 10))]
    for step in range(20):
        grad = torch.randn(10)
        whole.grad = grad.clone()
        ref.step()
        for s, (lo, hi) in zip(shards, ((0, 4), (4, 10))):
            s.apply_gradient(grad[lo:hi].clone(), s.version)
    torch.testing.assert_close(torch.cat([s.values for s in shards]), whole.detach(), rtol=0, atol=1e-6)
    snap = shards[0].snapshot()  # the state a rebuild restores: AdamW's moments and step included
    again = ShardState.from_snapshot(snap)
    assert torch.equal(again.values, shards[0].values)


def test_a_shard_takes_the_pushing_replicas_schedule_factor():
    s = ShardState(torch.zeros(2), "sgd", lr=1.0)
    s.apply_gradient(torch.ones(2), 0, (False, 0.25))
    assert s.values.tolist() == [-0.25, -0.25]
    s.apply_gradient(torch.ones(2), 0, (True, 0.5))  # staleness 1: 0.5 / 1
    assert s.values.tolist() == [-0.75, -0.75]


# ---- schedules ------------------------------------------------------------------------------
def test_warmup_then_cosine_to_the_floor():
    s = Schedule(COSINE, 100)
    assert s.warmup == 25
    assert s.factor(0) == pytest.approx(1 / 25) and s.factor(24) == pytest.approx(1.0)
    assert s.factor(25) == pytest.approx(1.0)
    assert s.factor(25 + 75 // 2) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * 37 / 75)) / 2)
    assert s.factor(100) == pytest.approx(0.1) and s.factor(1000) == pytest.approx(0.1)


@pytest.mark.parametrize("spec, t, expect", [
    ({"name": "constant"}, 50, 1.0),
    ({"name": "linear", "min_factor": 0.0}, 50, 0.5),
    ({"name": "step", "kwargs": {"step_size": 10, "gamma": 0.5}}, 25, 0.25),
    ({"name": "exponential", "kwargs": {"gamma": 0.9}}, 3, 0.729),
    ({"name": "warmup", "warmup": 10}, 4, 0.5),
])
def test_named_schedules(spec, t, expect):
    if spec["name"] == "warmup":
        spec = {"name": "constant", "warmup": spec["warmup"]}
    assert Schedule(spec, 100).factor(t) == pytest.approx(expect)


def test_a_torch_lr_scheduler_class_by_name_gives_its_rate_and_replays_backwards():
    s = Schedule({"name": "StepLR", "kwargs": {"step_size": 2, "gamma": 0.5}}, 100)
    assert [s.factor(t) for t in range(5)] == pytest.approx([1, 1, 0.5, 0.5, 0.25])
    assert s.factor(1) == pytest.approx(1.0)  # an earlier step (a resume): replayed from 0


def test_a_module_function_schedule_and_the_floor():
    s = Schedule({"name": "math:pow", "min_factor": 0.2}, 10)  # pow(u, span): 0 at u=0 -> the floor
    assert s.factor(0) == pytest.approx(0.2) and s.factor(1) == pytest.approx(1.0)


def test_planned_steps_count_global_batches():
    assert planned_steps(1000, 10, 2, 5, 3) == 30
    assert planned_steps(1001, 10, 2, 5, 1) == 11


# ---- the step against one process ---------------------------------------------------------
def reference_run(data, steps, accumulate_rows=None, clip=1.0, schedule=COSINE, total=20):
    """One process: AdamW on the union of each step's batches, the schedule's rate, clipping."""
    m = model()
    opt = make_optimizer(ADAMW, m.parameters())
    sched = Schedule(schedule, total)
    for t in range(steps):
        x, y = data[t]
        for g in opt.param_groups:
            g["lr"] = ADAMW["lr"] * sched.factor(t)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
    return m


@pytest.mark.parametrize("replicas", [1, 3])
def test_allreduce_with_adamw_cosine_clipping_and_accumulation_equals_one_process(replicas):
    steps, micro, k = 20, 4, 2
    data = batches(steps, micro * k * replicas)
    ref = reference_run(data, steps)
    reducer = ThreadSum(replicas)
    models = [model() for _ in range(replicas)]
    recipes = [Recipe(accumulate=k, clip=1.0) for _ in range(replicas)]

    def body(rank):
        m = models[rank]
        opt = make_optimizer(ADAMW, m.parameters())
        w = AllReduceWorker(m, opt, 1 << 20, reducer.for_rank(rank), recipe=recipes[rank])
        sched = Schedule(COSINE, steps)
        for t in range(steps):
            for g in opt.param_groups:
                g["lr"] = ADAMW["lr"] * sched.factor(t)
            x, y = data[t]
            rows = micro * k
            w.step(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows], more=t < steps - 1)

    run_replicas(replicas, body)
    for m in models:
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    assert recipes[0].last.grad_norm > 0  # measured before clipping


def test_accumulation_is_one_step_on_the_union_of_the_micro_batches():
    x, y = batches(1, 12)[0]
    one, acc = model(), model()
    F.cross_entropy(one(x), y).backward()
    Recipe(accumulate=3).backward(acc, _CE(), x, y)
    for p, q in zip(one.parameters(), acc.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert len(Recipe(accumulate=3).micro_batches(x, y)) == 3
    assert len(Recipe(accumulate=3).micro_batches(x[:2], y[:2])) == 2  # a short last batch: fewer chunks


class _CE:
    def loss(self, out, y):
        return F.cross_entropy(out, y)


def test_clipping_caps_the_norm_and_reports_it_before():
    m = model()
    x, y = batches(1, 16)[0]
    r = Recipe(clip=1e-3)
    r.backward(m, _CE(), x, y)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    facts = r.apply(opt)
    after = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])
    assert facts.grad_norm > 1e-3 and float(after) == pytest.approx(1e-3, rel=1e-4)


def test_bf16_autocast_trains_and_keeps_fp32_parameters():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    r = Recipe(precision="bf16")
    data = batches(30, 32)
    first = last = None
    for x, y in data * 3:
        opt.zero_grad()
        loss = r.backward(m, _CE(), x, y)
        r.apply(opt)
        first = loss if first is None else first
        last = loss
    assert all(p.dtype == torch.float32 for p in m.parameters())
    assert last < first


def test_fp16_skips_a_step_with_an_inf_gradient_and_lowers_the_scale():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    r = Recipe(precision="fp16")
    x, y = batches(1, 8)[0]
    r.backward(m, _CE(), x, y)
    before = [p.detach().clone() for p in m.parameters()]
    next(m.parameters()).grad[0, 0] = float("inf")
    scale = r.scaler.get_scale()
    facts = r.apply(opt)
    assert not facts.applied and r.skipped == 1 and r.scaler.get_scale() < scale
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    opt.zero_grad()
    r.backward(m, _CE(), x, y)
    assert r.apply(opt).applied
    assert r.state_dict()["scaler"]["scale"] == r.scaler.get_scale()


def test_an_unknown_precision_is_an_error():
    with pytest.raises(RecipeError, match="model.precision"):
        Recipe(precision="fp8")


@pytest.mark.parametrize("replicas,compression", [(1, "none"), (2, "none"), (2, "powersgd")])
def test_a_non_finite_loss_ends_the_run_except_on_a_switchs_probation_where_the_step_is_skipped(replicas, compression):
    """allreduce's rule (every replica judges the same summed loss): off probation a non-finite
    loss raises before the step is applied; on probation the step is skipped on every replica
    alike (the parameters and the momentum untouched, `skipped` counted) and a finite step after
    it is applied and finite (PowerSGD's error feedback did not keep the skipped step's NaN)."""
    data = batches(3, 4 * replicas)
    poisoned = data[1][0].clone()
    poisoned[0, 0] = float("inf")  # this step's loss is not finite
    for probation in (False, True):
        reducer = ThreadSum(replicas)
        models = [model() for _ in range(replicas)]
        recipes = [Recipe() for _ in range(replicas)]
        kept = {}

        def body(rank):
            m, r = models[rank], recipes[rank]
            r.skip_nonfinite = probation
            opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
            w = AllReduceWorker(m, opt, 1 << 20, reducer.for_rank(rank), batch=4, compression=compression,
                                powersgd_rank=1, recipe=r)
            for t, (x, y) in enumerate(data):
                x = poisoned if t == 1 else x
                if t == 1:
                    kept[rank] = ([p.detach().clone() for p in m.parameters()],
                                  [opt.state[p]["momentum_buffer"].clone() for p in m.parameters()])
                step = w.step(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4], more=t < 2)
                if t == 1:
                    assert not math.isfinite(step.loss)
                    params, moms = kept[rank]
                    assert all(torch.equal(a, b) for a, b in zip(params, m.parameters()))
                    assert all(torch.equal(a, opt.state[p]["momentum_buffer"]) for a, p in zip(moms, m.parameters()))

        if not probation:
            with pytest.raises(FloatingPointError, match="the loss is (nan|inf)"):
                run_replicas(replicas, body)
            continue
        run_replicas(replicas, body)
        assert [r.skipped for r in recipes] == [1] * replicas
        for m in models:  # the last step was applied: the parameters moved on from before the skipped one
            assert all(torch.isfinite(p).all() for p in m.parameters())
            assert not all(torch.equal(a, b) for a, b in zip(kept[0][0], m.parameters()))
