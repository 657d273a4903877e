"""Learning-rate rules for a run whose replica count changes. Pure functions, no Ray, no torch.

Synchronous modes (allreduce). Each replica steps on `data.batch_size` rows and the update is the
mean gradient over all of them, so the global batch is replicas x batch_size. Goyal et al. 2017
("Accurate, Large Minibatch SGD") keep the accuracy of small-batch training at large batches with:
- the linear scaling rule (their section 2.1): when the minibatch is multiplied by k, multiply the
  learning rate by k. `optimizer.lr` is the rate for `scaling.replicas` replicas, so with p
  replicas the rate is lr * p / scaling.replicas (`linear_scaled_lr`);
- gradual warmup (section 2.2): a large rate is unstable while the weights change fast, so it is
  reached by a linear ramp of constant increments per step (`warmup_lr`);
- momentum correction (section 3): when momentum is written with the rate inside the buffer, the
  buffer must be rescaled when the rate changes (`corrected_momentum_scale`).
`LrSchedule` puts the first two together for a run that resizes.

Asynchronous modes. EASGD keeps beta = p * alpha fixed as the replica count p changes
(`easgd_alpha`). Downpour's shards apply each replica's push as it comes, with a rate that does
not depend on p (see `easgd_alpha`'s note).
"""
from __future__ import annotations

from dataclasses import dataclass, field

RULES = ("linear", "none")


def linear_scaled_lr(base_lr: float, base_replicas: int, replicas: int) -> float:
    """The linear scaling rule: base_lr * replicas / base_replicas.

    `base_lr` is the rate tuned for `base_replicas` replicas (optimizer.lr and scaling.replicas).
    In allreduce the global batch is replicas x batch_size and the step is the mean gradient over
    it. One step on the mean of a k times larger batch moves about as far as one small-batch step,
    where k small-batch steps would have moved about k times as far; multiplying the rate by k lets
    the one large step stand in for the k small ones (Goyal et al. 2017, section 2.1; it holds while
    the gradient changes little over k steps, which fails in the first steps of training: hence
    gradual warmup)."""
    if base_lr <= 0 or base_replicas < 1 or replicas < 1:
        raise ValueError(f"need base_lr > 0, base_replicas >= 1 and replicas >= 1, got {base_lr}, "
                         f"{base_replicas}, {replicas}")
    return base_lr * replicas / base_replicas


def warmup_lr(target_lr: float, start_lr: float, step_in_warmup: int, warmup_steps: int) -> float:
    """Gradual warmup: the rate `step_in_warmup` steps into a ramp of `warmup_steps` steps,
    linear from `start_lr` (step 0) to `target_lr` (step warmup_steps and after):
    start_lr + (target_lr - start_lr) * step_in_warmup / warmup_steps.

    Goyal et al. start their warmup at the small-batch rate (a single worker's: here base_lr /
    base_replicas) and add a constant amount per iteration until the large-batch rate is reached.
    That is for the start of training, when the weights change fastest. A run that resizes in the
    middle has been stepping stably at its current rate, so `LrSchedule.resize` starts the ramp
    from the current rate: no step down to the single-replica rate and back up, and no jump."""
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if warmup_steps == 0 or step_in_warmup >= warmup_steps:
        return target_lr
    if step_in_warmup <= 0:
        return start_lr
    return start_lr + (target_lr - start_lr) * step_in_warmup / warmup_steps


def corrected_momentum_scale(old_lr: float, new_lr: float) -> float:
    """Goyal et al.'s momentum correction: the factor new_lr / old_lr to multiply the momentum
    buffer by when the rate changes from `old_lr` (the last step's) to `new_lr` (the next step's).

    It is needed only when the rate is inside the buffer:
        v <- m v + lr g;   w <- w - v
    There v carries the old rate in every past gradient; with the rate changed, m v would carry
    old_lr's history into a new_lr step (during a warmup, a history too small for the new rate,
    which Goyal et al. found destabilizing). Rescaling v by new_lr / old_lr before the step makes
    this form take the same steps as the one below. The caller applies it to every buffer of that
    form, once per change of the rate (every step of a warmup), before the step at the new rate.

    torch.optim.SGD keeps the rate outside the buffer:
        v <- m v + g;   w <- w - lr v
    v does not depend on the rate, so no correction is needed: the factor for that form is 1.0.
    Every momentum buffer in this project is torch.optim.SGD's (allreduce replicas, downpour
    shards, EAMSGD's local steps), so callers here pass nothing through this function; it is for
    an update rule of the first form."""
    if old_lr <= 0 or new_lr <= 0:
        raise ValueError(f"learning rates must be > 0, got {old_lr} and {new_lr}")
    return new_lr / old_lr


def easgd_alpha(beta: float, replicas: int) -> float:
    """EASGD's elastic coefficient for `replicas` replicas: alpha = beta / replicas.

    Zhang et al. (EASGD, 2015) keep beta = p * alpha fixed as the replica count p changes: the
    center moves by alpha times each of the p replicas' differences from it, beta in all, so the
    pull between the center and the replicas keeps its strength when replicas come or go. It is
    the formula of strategy.alpha's default (policies.rules.easgd.default_alpha: beta 0.9); with
    strategy.alpha set, beta = strategy.alpha * scaling.replicas.

    Downpour needs no such rule: each replica's push is applied by the shards as it arrives, with
    the shards' own rate, and the step one push makes does not depend on how many replicas push.
    More replicas mean more pushes per second, each computed from parameters that are older by
    the time it lands: more staleness, not a larger batch, so the server rate is not scaled with p
    (strategy.staleness_lr and strategy.max_staleness are the levers for staleness)."""
    if not 0 < beta <= replicas:
        raise ValueError(f"need 0 < beta <= replicas (alpha = beta / replicas must be in (0, 1]), got beta {beta} "
                         f"and {replicas} replicas")
    return beta / replicas


@dataclass(frozen=True)
class _Segment:
    from_step: int  # the first step of this segment
    replicas: int
    start_lr: float  # the rate at from_step
    target_lr: float  # the rate once the ramp is over
    ramp_steps: int  # 0: target_lr from from_step on


@dataclass
class LrSchedule:
    """The learning rate of a run whose replica count changes, step by step.

    It starts at `base_lr` with `base_replicas` replicas (no warmup: the run begins with the rate
    it was configured with). `resize(step, new_replicas)` from step `step` on:
    - rule "linear": the new target is linear_scaled_lr(base_lr, base_replicas, new_replicas).
      A higher target is reached by a gradual warmup over `warmup_steps` steps from the rate the
      schedule gives at `step` (the current rate, mid-ramp if a ramp was under way). A lower target
      (a shrink) takes effect at once: the global batch has already shrunk, and keeping the larger
      rate through a ramp would step too far on the smaller batch; lowering a rate at once is safe
      (step decays do it).
    - rule "none": the rate stays `base_lr` whatever the replica count.
    `lr_at(step)` answers for any step from 0 on (earlier resizes are kept; a second resize at the
    same step replaces the first).
    """

    base_lr: float
    base_replicas: int
    rule: str = "linear"
    warmup_steps: int = 100
    segments: list[_Segment] = field(default_factory=list, init=False)  # memory: one per resize, in order

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        if self.base_lr <= 0 or self.base_replicas < 1 or self.warmup_steps < 0:
            raise ValueError(f"need base_lr > 0, base_replicas >= 1 and warmup_steps >= 0, got {self.base_lr}, "
                             f"{self.base_replicas}, {self.warmup_steps}")
        if not self.segments:
            self.segments.append(_Segment(0, self.base_replicas, self.base_lr, self.base_lr, 0))

    @property
    def replicas(self) -> int:
        return self.segments[-1].replicas

    def state_dict(self) -> list[list]:
        """Every resize so far (a checkpoint's part; `load_state_dict` takes it back)."""
        return [[s.from_step, s.replicas, s.start_lr, s.target_lr, s.ramp_steps] for s in self.segments]

    def load_state_dict(self, position: list[list]) -> None:
        self.segments = [_Segment(int(a), int(b), float(c), float(d), int(e)) for a, b, c, d, e in position]

    def target_lr(self, replicas: int) -> float:
        """The rate the rule gives `replicas` replicas once any warmup is over."""
        if self.rule == "none":
            return self.base_lr
        return linear_scaled_lr(self.base_lr, self.base_replicas, replicas)

    def lr_at(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self._lr_in(next(s for s in reversed(self.segments) if s.from_step <= step), step)

    def resize(self, step: int, new_replicas: int) -> float:
        """From step `step` on the run has `new_replicas` replicas; returns the new target rate."""
        if step < self.segments[-1].from_step:
            raise ValueError(f"resize at step {step} is before the last resize (step {self.segments[-1].from_step})")
        if new_replicas < 1:
            raise ValueError(f"new_replicas must be >= 1, got {new_replicas}")
        before = [s for s in self.segments if s.from_step < step]  # a resize at the same step is replaced
        current = self._lr_in(before[-1], step) if before else self.base_lr
        target = self.target_lr(new_replicas)
        ramp = self.warmup_steps if target > current else 0
        self.segments = before + [_Segment(step, new_replicas, current, target, ramp)]
        return target

    @staticmethod
    def _lr_in(seg: _Segment, step: int) -> float:
        return warmup_lr(seg.target_lr, seg.start_lr, step - seg.from_step, seg.ramp_steps)
