"""Switch policies: which synchronization mode runs when. Pure decisions, tested without Ray.

The controller hands a policy an `Observation` at every decision point (each epoch's end, and
during an epoch whenever a replica's progress report arrives) and carries out the `Switch` it
returns, if any (orchestrator/control/reconfig/phase_switch.py). Both policies work on the run's *plan*: the list
of phase strategies `StrategyConfig.plan()` gives, and `current` is the index of the phase that
runs.

- `SchedulePolicy` (strategy.phases): a phase ends when its `until` holds: `epochs` (epoch ends
  since the phase began), `steps` (steps since), `seconds` (training seconds since), or a
  metric threshold (any metric the task produces, or train_loss: reached when its goal is max,
  fallen to when min; measured at epoch ends). The last phase runs until the run stops.
- `AdaptivePolicy` (strategy.switch adaptive): plan[0] is the synchronous mode, plan[1] the
  asynchronous one. The signal is the spread of the replicas' compute time per step (each
  replica's step time minus its time waiting for others; in a synchronous mode every replica
  steps at the slowest one's pace, so only the compute time shows who is slow):
  ratio = slowest / median of the others. Synchronous -> asynchronous when ratio >= slow_ratio;
  asynchronous -> synchronous when ratio <= recover_ratio. Hysteresis: the two thresholds
  differ, a condition must hold for `patience` consecutive observations, and no switch comes
  sooner than `min_phase_s` after the last one.
  With `balance` (strategy.adaptive.balance, the default) the synchronous mode balances the
  batch by speed (policies/rules/balance.py), which absorbs a straggler without leaving synchronous
  SGD; the ratio is then what balancing cannot absorb: the balanced step's predicted time over
  the ideal one (every row at the replicas' summed speed; see `residual`). It exceeds 1 only
  once a share hits its bound (of two replicas, one more than 7x slower than the other with the
  default bounds), and only then is an asynchronous mode worth its switch.
  With `async_mode: backup` the straggler phase is allreduce with backup replicas (policies/
  backup.py): it is entered only when, besides the ratio, the backups are predicted to train
  more rows a second than the synchronous mode (`rows_per_s`: q x the q-th fastest speed against
  every row over the slowest member's time). A replica late at every step stops as soon as it
  knows and reports no compute time, so while one straggles the policy cannot see it recover:
  it comes back when every member of the group is in time often enough to be measured (the
  observation's `members`: with 3 or more replicas the in-time others alone would look
  recovered) and the ratio is at most recover_ratio, or after `probe_s` seconds (rule "probe")
  to measure again.
Every decision names its rule and the numbers behind it (the controller logs them as the
`mode_switch` event).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import Any, Optional, Union

from policies.rules.backup import backup_rows_per_s
from policies.rules.balance import split, step_time
from policies.rules.tasks import Classification

DEFAULT_GOALS = {**Classification.goals, "train_loss": "min"}  # the default task's metrics and their goals


@dataclass(frozen=True)
class Observation:
    """What the controller knows at a decision point."""

    epoch_end: bool  # at an epoch's end: `metrics` are fresh
    epochs: int  # epochs finished in the run
    step: int  # steps taken in the run
    elapsed_s: float  # seconds of training so far
    metrics: dict[str, float] = field(default_factory=dict)  # the latest epoch's task metrics and train_loss
    compute_s: dict[int, float] = field(default_factory=dict)  # rank -> compute seconds per step, latest window
    comm_share: Optional[float] = None  # share of the step spent waiting for communication, latest window
    rows: dict[int, float] = field(default_factory=dict)  # rank -> rows per step of its batches, latest window
    members: Optional[int] = None  # replicas in the group (those in `compute_s` are the ones measured)


@dataclass(frozen=True)
class Switch:
    phase: int  # index into the plan of the phase to run next
    mode: str
    rule: str  # what ended the last phase: "until epochs", "until <metric>", "straggler", "recovered", ...
    reason: str  # one line a person can read
    numbers: dict[str, Any]  # the figures behind it


@dataclass
class _Mark:
    epochs: int
    step: int
    elapsed_s: float


class SchedulePolicy:
    def __init__(self, plan: list[dict[str, Any]], goals: Optional[dict[str, str]] = None) -> None:
        """`goals`: each metric's direction ("max": reached at or above, "min": fallen to at or
        below), the task's and train_loss (default: the classification task's)."""
        self.plan = plan
        self.goals = dict(goals or DEFAULT_GOALS)
        self.current = 0  # the phase decided last (the replicas run it once its switch commits)
        self.mark = _Mark(0, 0, 0.0)
        self.off = False  # a switch was rolled back: no further switch this run
        self.commit()

    @property
    def until(self) -> Optional[dict[str, Any]]:
        """The running phase's `until` (None: the last phase's)."""
        return self.plan[self.current]["until"]

    def decide(self, obs: Observation) -> Optional[Switch]:
        until = self.until
        if until is None or self.off:
            return None
        (key, target), = until.items()
        if key == "epochs":
            spent = obs.epochs - self.mark.epochs
            hit = obs.epoch_end and spent >= target
            numbers = {"epochs_in_phase": spent, "target": target}
        elif key == "steps":
            spent = obs.step - self.mark.step
            hit = spent >= target
            numbers = {"steps_in_phase": spent, "target": target}
        elif key == "seconds":
            spent = obs.elapsed_s - self.mark.elapsed_s
            hit = spent >= target
            numbers = {"seconds_in_phase": round(spent, 3), "target": target}
        else:
            value = obs.metrics.get(key) if obs.epoch_end else None
            hit = value is not None and (value >= target if self.goals[key] == "max" else value <= target)
            numbers = {key: value, "target": target}
        if not hit:
            return None
        return self._advance(obs, f"until {key}", f"phase {self.current} ({self.plan[self.current]['mode']}) reached "
                             f"{key} {target:g}", numbers)

    def _place(self) -> dict[str, Any]:
        return {"current": self.current, "mark": [self.mark.epochs, self.mark.step, self.mark.elapsed_s],
                "off": self.off}

    def state_dict(self) -> dict[str, Any]:
        """Where the schedule was at the last switch carried out (`commit`): what a checkpoint
        holds, so one taken while a decided switch waits records the phase the replicas run
        (`load_state_dict` takes it back)."""
        return dict(self._committed)

    def commit(self) -> None:
        """The switch decided last (or a rollback) is carried out: the replicas run its phase."""
        self._committed = self._place()

    def load_state_dict(self, position: dict[str, Any]) -> None:
        self.current = position["current"]
        self.mark = _Mark(*position["mark"])
        self.off = position.get("off", False)
        self.commit()

    def roll_back(self, phase: int) -> None:
        """A switch that hurt was undone (the controller's guard): the plan is at `phase` again
        and decides no further switch this run."""
        self.current, self.off = phase, True

    def _advance(self, obs: Observation, rule: str, reason: str, numbers: dict[str, Any]) -> Switch:
        self.current += 1
        self.mark = _Mark(obs.epochs, obs.step, obs.elapsed_s)
        return Switch(self.current, self.plan[self.current]["mode"], rule, reason, numbers)


class AdaptivePolicy:
    SYNC, ASYNC = 0, 1

    def __init__(self, plan: list[dict[str, Any]], slow_ratio: float, recover_ratio: float, patience: int,
                 min_phase_s: float, balance: Optional[tuple[float, float]] = None, probe_s: float = 20.0) -> None:
        """`balance`: the synchronous mode balances the batch within these share bounds
        (policies/rules/balance.py), and the signal is what balancing cannot absorb (`residual`).
        `probe_s`: with backups as the straggler phase, how long before going back to measure."""
        if recover_ratio >= slow_ratio:
            raise ValueError(f"recover_ratio ({recover_ratio}) must be below slow_ratio ({slow_ratio})")
        self.plan = plan
        self.balance = balance
        straggler = plan[self.ASYNC]
        self.backups = int(straggler.get("backup_replicas") or 0) if straggler["mode"] == "allreduce" else 0
        self.probe_s = probe_s
        self.slow_ratio, self.recover_ratio = slow_ratio, recover_ratio
        self.patience, self.min_phase_s = patience, min_phase_s
        self.current = self.SYNC  # the phase decided last (the replicas run it once its switch commits)
        self.streak = 0
        self.last_switch_s = 0.0
        self.off = False  # a switch was rolled back: no further switch this run
        self.commit()

    @property
    def until(self) -> Optional[dict[str, Any]]:
        """The running phase's `until`: None (its rule ends a phase, not an `until`)."""
        return self.plan[self.current]["until"]

    def state_dict(self) -> dict[str, Any]:
        """The policy at the last switch carried out (`commit`), as a checkpoint holds it (SchedulePolicy)."""
        return dict(self._committed)

    def commit(self) -> None:
        """The switch decided last (or a rollback) is carried out: the replicas run its phase."""
        self._committed = {"current": self.current, "streak": self.streak, "last_switch_s": self.last_switch_s,
                           "off": self.off}

    def load_state_dict(self, position: dict[str, Any]) -> None:
        self.current, self.streak, self.last_switch_s = (position["current"], position["streak"],
                                                         position["last_switch_s"])
        self.off = position.get("off", False)
        self.commit()

    def roll_back(self, phase: int) -> None:
        """A switch that hurt was undone: the policy is in `phase` again and decides no further
        switch this run."""
        self.current, self.streak, self.off = phase, 0, True

    @staticmethod
    def spread(compute_s: dict[int, float]) -> tuple[float, Optional[int]]:
        """(slowest replica's compute time per step / the median of the others', its rank);
        (1.0, None) with fewer than two replicas reporting."""
        times = {r: t for r, t in compute_s.items() if t is not None and t > 0}
        if len(times) < 2:
            return 1.0, None
        slow = max(times, key=lambda r: (times[r], -r))
        others = median(t for r, t in times.items() if r != slow)
        return times[slow] / others, slow

    def residual(self, compute_s: dict[int, float], rows: dict[int, float]) -> tuple[float, Optional[int], dict]:
        """With balancing: (the balanced synchronous step's predicted seconds / the ideal step's,
        the slowest replica, the numbers). Each replica's speed is its rows per step over its
        compute seconds per step; the balanced step gives each a share of the batch in
        proportion, within the bounds (policies/rules/balance.py split), and takes as long as its
        slowest member; the ideal step, every row at the summed speed, is what an
        asynchronous mode's throughput comes to at best. 1.0: balancing absorbs the straggler
        whole; (1.0, None) with fewer than two replicas reporting."""
        ranks = sorted(r for r, t in compute_s.items() if t and t > 0 and rows.get(r))
        if len(ranks) < 2:
            return 1.0, None, {}
        speeds = [rows[r] / compute_s[r] for r in ranks]
        batch = sum(rows[r] for r in ranks) / len(ranks)
        shares = split(max(1, round(batch)), speeds, *self.balance)
        balanced, ideal = step_time(shares, speeds), len(ranks) * batch / sum(speeds)
        slow = ranks[min(range(len(ranks)), key=lambda i: (speeds[i], ranks[i]))]
        numbers = {"speeds_rows_per_s": {str(r): round(v, 1) for r, v in zip(ranks, speeds)},
                   "balanced_shares": {str(r): s for r, s in zip(ranks, shares)},
                   "predicted_balanced_step_s": round(balanced, 5), "predicted_ideal_step_s": round(ideal, 5)}
        return balanced / ideal, slow, numbers

    def rows_per_s(self, compute_s: dict[int, float], rows: dict[int, float]) -> Optional[dict[str, Any]]:
        """With backups as the straggler phase: the synchronous mode's and the backups' predicted
        trained rows per second from the replicas' speeds (rows per step / compute seconds per
        step), and the backups' gain; None with fewer than two replicas reporting. Synchronous:
        every row of the step over the slowest member's time (balanced shares, when balancing);
        backups: every replica a batch at its own speed, the step ending with the q-th fastest
        (policies/rules/backup.py `backup_rows_per_s`)."""
        ranks = sorted(r for r, t in compute_s.items() if t and t > 0 and rows.get(r))
        if len(ranks) < 2:
            return None
        speeds = [rows[r] / compute_s[r] for r in ranks]
        if self.balance is not None:
            batch = sum(rows[r] for r in ranks) / len(ranks)
            shares = split(max(1, round(batch)), speeds, *self.balance)
            sync = sum(shares) / step_time(shares, speeds)
        else:
            sync = sum(rows[r] for r in ranks) / max(compute_s[r] for r in ranks)
        backup = backup_rows_per_s(speeds, self.backups)
        return {"predicted_sync_rows_per_s": round(sync, 1), "predicted_backup_rows_per_s": round(backup, 1),
                "backup_gain": backup / sync - 1}

    def decide(self, obs: Observation) -> Optional[Switch]:
        if self.off:
            return None
        extra: dict[str, Any] = {}
        if self.balance is not None:
            ratio, slow, extra = self.residual(obs.compute_s, obs.rows)
        else:
            ratio, slow = self.spread(obs.compute_s)
        # backups drop a late replica's steps, so its figures stop: after probe_s, go back and measure
        probe = (self.current == self.ASYNC and self.backups > 0 and obs.elapsed_s - self.last_switch_s >= self.probe_s
                 and obs.elapsed_s - self.last_switch_s >= self.min_phase_s)
        if slow is None and not probe:
            return None
        rates = self.rows_per_s(obs.compute_s, obs.rows) if self.backups else None
        if self.current == self.SYNC:
            holds, rule, threshold = ratio >= self.slow_ratio, "straggler", self.slow_ratio
            if holds and self.backups:  # only when the backups are predicted to train more rows a second
                holds = rates is not None and rates["backup_gain"] > 0
        else:
            holds, rule, threshold = slow is not None and ratio <= self.recover_ratio, "recovered", self.recover_ratio
            if holds and self.backups and obs.members is not None:  # a late replica reports nothing: all measured
                holds = sum(1 for t in obs.compute_s.values() if t and t > 0) >= obs.members
        self.streak = self.streak + 1 if holds else 0
        if probe and not (holds and self.streak >= self.patience):
            rule, self.streak = "probe", self.patience
        if self.streak < self.patience or obs.elapsed_s - self.last_switch_s < self.min_phase_s:
            return None
        self.streak = 0
        since = obs.elapsed_s - self.last_switch_s
        self.last_switch_s = obs.elapsed_s
        self.current = self.ASYNC if self.current == self.SYNC else self.SYNC
        numbers = {"ratio": round(ratio, 3) if slow is not None else None, "threshold": threshold, "slowest_rank": slow,
                   "compute_s_by_rank": {str(r): round(t, 5) for r, t in sorted(obs.compute_s.items())},
                   "observations": self.patience, **extra,
                   **({"comm_share": round(obs.comm_share, 3)} if obs.comm_share is not None else {})}
        if self.backups:
            return self._backup_switch(rule, ratio, threshold, slow, since, rates, numbers)
        if self.balance is not None:
            gain = 1 - 1 / ratio  # of the balanced step's time, when the asynchronous mode reaches the ideal
            numbers["predicted_gain"] = round(gain if rule == "straggler" else -gain, 4)
            if rule == "straggler":
                reason = (f"balancing cannot absorb replica {slow}: the balanced step is predicted "
                          f"{ratio:.2f}x the ideal (>= {threshold:g}): go asynchronous")
            else:
                reason = (f"balancing absorbs the slowest replica again: the balanced step is predicted "
                          f"{ratio:.2f}x the ideal (<= {threshold:g}): go synchronous")
        elif rule == "straggler":
            reason = (f"replica {slow} computes {ratio:.2f}x as long per step as the others (>= {threshold:g}): "
                      "go asynchronous")
        else:
            reason = f"the slowest replica is back to {ratio:.2f}x the others (<= {threshold:g}): go synchronous"
        return Switch(self.current, self.plan[self.current]["mode"], rule, reason, numbers)

    def _backup_switch(self, rule: str, ratio: float, threshold: float, slow: Optional[int], since: float,
                       rates: Optional[dict[str, Any]], numbers: dict[str, Any]) -> Switch:
        """The switch into or out of the backups, with its reason and predicted gain."""
        sync = self.plan[self.SYNC]["mode"]
        numbers["backup_replicas"] = self.backups
        if rates is not None:
            gain = rates.pop("backup_gain")
            numbers.update(rates)
            numbers["predicted_gain"] = round(gain if rule == "straggler" else 1 / (1 + gain) - 1, 4)
        if rule == "straggler":
            reason = (f"replica {slow} straggles ({ratio:.2f}x, >= {threshold:g}): with {self.backups} backup "
                      f"replica(s) the step is predicted to train {numbers['predicted_backup_rows_per_s']:.0f} rows/s "
                      f"against {numbers['predicted_sync_rows_per_s']:.0f}: apply the first gradients, drop the late")
        elif rule == "recovered":
            reason = (f"every replica is in time again ({ratio:.2f}x, <= {threshold:g}): back to {sync} without backups")
        else:
            numbers["probe_s"] = self.probe_s
            reason = (f"{since:.1f} s with backups (probe_s {self.probe_s:g}): a replica late at every step is not "
                      f"measured while its steps are dropped; back to {sync} to measure every replica")
        return Switch(self.current, self.plan[self.current]["mode"], rule, reason, numbers)


SwitchPolicy = Union[SchedulePolicy, AdaptivePolicy]


def make_switch_policy(strategy: Any, goals: Optional[dict[str, str]] = None) -> SwitchPolicy:
    """The policy a StrategyConfig asks for, over its plan; `goals`: the run's metrics' directions."""
    plan = strategy.plan()
    if strategy.switch == "adaptive":
        a = strategy.adaptive
        balance = (strategy.balance_min_share, strategy.balance_max_share) if a.balance else None
        return AdaptivePolicy(plan, a.slow_ratio, a.recover_ratio, a.patience, a.min_phase_s, balance, a.probe_s)
    return SchedulePolicy(plan, goals)


ASYNC_SHARED = {"downpour": "on the shards", "hogwild": "on the replicas' steps into the shared vector"}


def entering_optimizer(mode: str, job: dict[str, Any], phase: Optional[dict[str, Any]], replicas: int,
                       in_phases: bool) -> tuple[dict[str, Any], Optional[str]]:
    """The optimizer settings a phase of `mode` runs with: the job's `optimizer.*` under the
    phase's own overrides; and, for a phase entering an asynchronous mode whose updates land on
    one shared copy (downpour's shards; hogwild's shared vector, stepped by each replica's own
    optimizer) in a run of phases with no `momentum` of its own, the momentum lowered by the
    momentum the asynchrony adds (n replicas applying stale gradients act as an implicit momentum
    of about 1 - 1/n: Mitliagkas et al. 2016, "Asynchrony begets momentum"): max(0, momentum -
    (1 - 1/n)), so the total stays near the job's. Returns the settings and what was translated
    (None: nothing)."""
    opt = {**job, **(phase or {})}
    if mode not in ASYNC_SHARED or not in_phases or "momentum" in (phase or {}) or replicas < 2:
        return opt, None
    implicit = 1 - 1 / replicas
    explicit = max(0.0, round(opt["momentum"] - implicit, 6))
    if explicit == opt["momentum"]:
        return opt, None
    note = (f"momentum {opt['momentum']:g} -> {explicit:g} {ASYNC_SHARED[mode]}: {replicas} asynchronous replicas add "
            f"about {implicit:g} (1 - 1/n); set this phase's optimizer.momentum to choose it")
    return {**opt, "momentum": explicit}, note


def shard_settings(strategy: dict[str, Any], job: dict[str, Any], replicas: int,
                   in_phases: bool) -> tuple[tuple[float, float, float], Optional[str]]:
    """(lr, momentum, weight_decay) of a phase's shards: `entering_optimizer` for the phase's
    mode under its optimizer overrides; and what was translated (None: nothing)."""
    opt, note = entering_optimizer(strategy["mode"], job, strategy.get("optimizer"), replicas, in_phases)
    return (opt["lr"], opt["momentum"], opt["weight_decay"]), note


def replicas_strategy(strategy: dict[str, Any], job: dict[str, Any], replicas: int,
                      in_phases: bool) -> tuple[dict[str, Any], Optional[str]]:
    """The strategy a phase's replicas run: hogwild's step the shared vector with their own
    optimizers, so its `entering_optimizer` momentum goes into the phase's optimizer overrides
    (the shards take it through the same rule); every other mode's as it is. Returns the
    strategy and what was translated (None: nothing)."""
    if strategy["mode"] != "hogwild":
        return strategy, None
    opt, note = entering_optimizer("hogwild", job, strategy.get("optimizer"), replicas, in_phases)
    if note is None:
        return strategy, None
    return {**strategy, "optimizer": {**(strategy.get("optimizer") or {}), "momentum": opt["momentum"]}}, note
