"""data.adaptive_batch's rule (policies/decisions/batch_size.py) and its config, without Ray."""
from __future__ import annotations

import math

import numpy as np
import pytest

from orchestrator.config import JobConfig
from orchestrator.errors import ConfigError
from policies.decisions.batch_size import AdaptiveBatch, noise_scale


@pytest.mark.parametrize("b_noise,replicas,batch", [(40.0, 2, 16), (400.0, 4, 32), (5.0, 2, 64)])
def test_the_noise_scale_from_the_replicas_gradient_diversity_is_tr_s_over_g_squared(b_noise, replicas, batch):
    """Per-example gradients with mean G and covariance S (tr S / ||G||^2 = b_noise): p replicas
    each average b of them; the diversity sum_i ||g_i||^2 / ||sum_i g_i||^2, averaged over many
    steps, gives back b_noise through noise_scale."""
    rng = np.random.default_rng(0)
    dim, steps = 50, 4000
    g = rng.normal(size=dim)
    g /= np.linalg.norm(g)
    sigma = math.sqrt(b_noise / dim)  # isotropic: tr S = dim sigma^2 = b_noise ||G||^2
    sq, summed = 0.0, 0.0
    for _ in range(steps):  # each replica's mean over its batch: G + noise of covariance S / b
        means = g + rng.normal(scale=sigma / math.sqrt(batch), size=(replicas, dim))
        sq += (means ** 2).sum()
        summed += (means.sum(axis=0) ** 2).sum()
    diversity = sq / summed  # the ratio of the means: what the steps' figures estimate
    assert noise_scale(diversity, replicas, batch) == pytest.approx(b_noise, rel=0.1)


def test_the_ends_of_the_diversity_range():
    assert noise_scale(0.5, 2, 32) == 0.0  # D = 1/p: identical gradients, no noise
    assert noise_scale(0.4, 2, 32) == 0.0  # below 1/p (sampling): no noise, not negative
    assert noise_scale(1.0, 2, 32) == math.inf and noise_scale(1.3, 4, 32) == math.inf
    for bad in ((float("nan"), 2, 32), (0.0, 2, 32), (0.7, 1, 32), (0.7, 2, 0)):
        with pytest.raises(ValueError):
            noise_scale(*bad)


def test_the_batch_grows_by_its_factor_while_the_grown_global_batch_is_within_the_noise_scale():
    rule = AdaptiveBatch(16, 128, 2)
    # p 2, b 16: D = 0.8 gives B_noise = 16 (1.6 - 1) / 0.2 = 48 < 2 x 32: kept
    assert rule.decide(0.8, 2, 16) is None
    # D = 0.9: 16 x 0.8 / 0.1 = 128 >= 64: grows to 32
    assert rule.decide(0.9, 2, 16) == (32, pytest.approx(128.0))
    assert rule.decide(0.99, 2, 64) == (128, pytest.approx(64 * 0.98 / 0.01))
    assert rule.decide(0.999, 2, 128) is None  # at max: 256 would pass it
    assert rule.decide(None, 2, 16) is None and rule.decide(0.99, 1, 16) is None  # unmeasured; one replica
    assert rule.decide(float("nan"), 2, 16) is None and rule.decide(float("inf"), 2, 16) is None  # fp16 overflow
    # data.accumulate k: a step's gradient is over 16 k rows; the noise scale is in rows, the decision the same
    assert rule.decide(0.9, 2, 16, accumulate=4) == (32, pytest.approx(512.0))
    assert AdaptiveBatch(16, 100, 4).decide(0.999, 2, 16) == (64, pytest.approx(16 * 0.998 / 0.001))
    with pytest.raises(ValueError):
        AdaptiveBatch(16, 8)


def test_the_config_takes_either_spelling_and_refuses_what_it_cannot_measure():
    a = JobConfig.from_dict({"data": {"batch_size": {"adaptive": {"min": 16, "max": 128}}}}).data
    b = JobConfig.from_dict({"data": {"batch_size": 16, "adaptive_batch": {"max": 128}}}).data
    assert a == b and a.batch_size == 16 and a.adaptive_batch.max == 128 and a.adaptive_batch.factor == 2
    cases = [({"data": {"batch_size": {"adaptive": {"min": 16}}}}, "data: batch_size: give a number, or {adaptive"),
             ({"data": {"adaptive_batch": {"max": 128}}, "strategy": {"mode": "downpour"}}, "one allreduce phase"),
             ({"data": {"adaptive_batch": {"max": 128}}, "strategy": {"balance": True}}, "equal shares"),
             ({"data": {"adaptive_batch": {"max": 128}}, "strategy": {"backup_replicas": 1}}, "equal shares"),
             ({"data": {"adaptive_batch": {"max": 128}}, "scaling": {"replicas": 1}}, "scaling.replicas >= 2"),
             ({"data": {"adaptive_batch": {"max": 128}}, "strategy": {"compression": "powersgd"}}, "powersgd"),
             ({"data": {"adaptive_batch": {"max": 100}}}, "max (100) leaves no room to grow data.batch_size (64)"),
             ({"data": {"adaptive_batch": {"max": 128, "factor": 1}}}, "data.adaptive_batch.factor: Input should be"),
             ({"data": {"batch_size": {"adaptive": {"min": 8, "max": 64}}, "adaptive_batch": {"max": 64}}},
              "the same setting")]
    for raw, said in cases:
        with pytest.raises(ConfigError) as exc:
            JobConfig.from_dict(raw)
        assert said in str(exc.value) and "\n" not in str(exc.value), (raw, str(exc.value))
