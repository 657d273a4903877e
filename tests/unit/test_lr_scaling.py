"""Learning-rate rules for resizing, checked against hand-computed numbers."""
import pytest
import torch

from policies.rules.easgd import default_alpha
from policies.decisions.lr_scaling import (LrSchedule, corrected_momentum_scale, easgd_alpha, linear_scaled_lr,
                                 warmup_lr)


def test_linear_scaling_rule():
    assert linear_scaled_lr(0.1, 2, 4) == pytest.approx(0.2)
    assert linear_scaled_lr(0.1, 2, 1) == pytest.approx(0.05)
    assert linear_scaled_lr(0.05, 4, 6) == pytest.approx(0.075)
    assert linear_scaled_lr(0.05, 4, 4) == 0.05
    with pytest.raises(ValueError):
        linear_scaled_lr(0.1, 0, 2)


def test_warmup_is_a_straight_line_from_start_to_target():
    assert warmup_lr(0.2, 0.1, 0, 100) == pytest.approx(0.1)
    assert warmup_lr(0.2, 0.1, 25, 100) == pytest.approx(0.125)
    assert warmup_lr(0.2, 0.1, 50, 100) == pytest.approx(0.15)
    assert warmup_lr(0.2, 0.1, 100, 100) == pytest.approx(0.2)
    assert warmup_lr(0.2, 0.1, 500, 100) == pytest.approx(0.2)
    assert warmup_lr(0.4, 0.05, 5, 10) == pytest.approx(0.225)  # Goyal et al.'s shape: eta up to k eta (k = 8)
    assert warmup_lr(0.2, 0.1, 0, 0) == 0.2  # no warmup: the target at once


def test_schedule_starts_at_base_lr_and_a_grow_warms_up_from_the_current_rate():
    s = LrSchedule(base_lr=0.1, base_replicas=2, rule="linear", warmup_steps=100)
    assert s.lr_at(0) == s.lr_at(10_000) == 0.1 and s.replicas == 2  # no resize: today's rate, no warmup
    assert s.resize(200, 4) == pytest.approx(0.2)
    assert [s.lr_at(t) for t in (199, 200, 250, 300, 400)] == pytest.approx([0.1, 0.1, 0.15, 0.2, 0.2])


def test_a_resize_mid_warmup_restarts_the_warmup_from_the_current_rate():
    s = LrSchedule(0.1, 2, "linear", 100)
    s.resize(200, 4)  # 0.1 -> 0.2 over steps 200..300
    assert s.resize(250, 6) == pytest.approx(0.3)  # at step 250 the rate is 0.15
    assert [s.lr_at(t) for t in (225, 250, 300, 350, 351)] == pytest.approx([0.125, 0.15, 0.225, 0.3, 0.3])
    assert s.replicas == 6


def test_a_shrink_lowers_the_rate_at_once():
    s = LrSchedule(0.1, 2, "linear", 100)
    s.resize(0, 4)  # a resize at step 0 ramps from base_lr
    assert [s.lr_at(t) for t in (0, 50, 100)] == pytest.approx([0.1, 0.15, 0.2])
    assert s.resize(150, 3) == pytest.approx(0.15)
    assert [s.lr_at(t) for t in (149, 150, 151)] == pytest.approx([0.2, 0.15, 0.15])
    s.resize(160, 4)  # grow again: ramp 0.15 -> 0.2
    assert s.lr_at(210) == pytest.approx(0.175)


def test_two_resizes_at_one_step_keep_the_later_one():
    s = LrSchedule(0.1, 2, "linear", 10)
    s.resize(20, 8)
    s.resize(20, 4)
    assert [s.lr_at(t) for t in (20, 25, 30)] == pytest.approx([0.1, 0.15, 0.2]) and s.replicas == 4
    with pytest.raises(ValueError, match="before the last resize"):
        s.resize(19, 2)


def test_rule_none_keeps_the_rate():
    s = LrSchedule(0.1, 2, "none", 100)
    assert s.resize(100, 8) == 0.1
    s.resize(150, 1)
    assert {s.lr_at(t) for t in (0, 100, 120, 150, 400)} == {0.1}
    with pytest.raises(ValueError):
        LrSchedule(0.1, 2, "sqrt", 100)


def test_momentum_correction_makes_the_lr_inside_form_take_torchs_steps():
    """Over a warmup (the rate changes every step): torch's SGD (v <- m v + g; w <- w - lr v)
    and the lr-inside form (v <- m v + lr g; w <- w - v) with the buffer rescaled by
    new_lr / old_lr take the same steps; without the correction they do not."""
    assert corrected_momentum_scale(0.1, 0.15) == pytest.approx(1.5)
    assert corrected_momentum_scale(0.2, 0.1) == pytest.approx(0.5)
    m, grads = 0.9, [1.0, -0.5, 2.0, 0.25, 1.5]
    lrs = [warmup_lr(0.4, 0.05, t, 4) for t in range(len(grads))]  # 0.05, 0.1375, 0.225, 0.3125, 0.4

    w = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([w], lr=lrs[0], momentum=m)
    for lr, g in zip(lrs, grads):
        opt.param_groups[0]["lr"] = lr
        w.grad = torch.tensor([g])
        opt.step()
    torch_w = w.item()

    def lr_inside(correct):
        w, v, old = 0.0, 0.0, lrs[0]
        for lr, g in zip(lrs, grads):
            v = m * v * (corrected_momentum_scale(old, lr) if correct else 1.0) + lr * g
            w, old = w - v, lr
        return w

    assert lr_inside(correct=True) == pytest.approx(torch_w, rel=1e-6)
    assert lr_inside(correct=False) != pytest.approx(torch_w, rel=1e-3)


def test_easgd_alpha_keeps_beta_fixed():
    assert easgd_alpha(0.9, 3) == pytest.approx(0.3)
    assert easgd_alpha(0.9, 1) == pytest.approx(0.9)
    for p in (1, 2, 4, 9):
        assert p * easgd_alpha(0.9, p) == pytest.approx(0.9) and easgd_alpha(0.9, p) == default_alpha(p)
    with pytest.raises(ValueError):
        easgd_alpha(2.0, 1)  # alpha would be 2
