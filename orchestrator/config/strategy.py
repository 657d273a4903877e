"""The config section of how replicas train together: the strategy (a mode, phases or the
adaptive policy). How many replicas there are and what happens when they fail: fleet.py."""
from __future__ import annotations

from typing import Any, Iterable, Literal, Optional, Sequence

from pydantic import Field, field_validator, model_serializer, model_validator

from orchestrator.config.sections import Section


MODE_OPTIONS = {
    "allreduce": ("bucket_mb", "balance", "compression", "powersgd_rank", "backup_replicas"),
    "downpour": ("n_fetch", "n_push", "max_in_flight", "max_staleness", "staleness_lr", "warmstart_steps"),
    "easgd": ("tau", "alpha", "variant", "momentum"),
    "local_sgd": ("period", "outer_lr", "outer_momentum", "balance"),
    "gossip": ("period",),
    "fsdp": (),
    "hogwild": ("max_in_flight",),  # the replicas off the shard's node push as downpour does
    "sandblaster": (),  # one mode for the whole run: its options (step_size, history_size) are strategy.* only
}
STRATEGY_MODE_OPTIONS = {  # a mode's options that only strategy.* sets (for the run, or for every phase of the mode)
    "allreduce": ("balance_window", "balance_min_share", "balance_max_share"),
    "local_sgd": ("balance_min_share", "balance_max_share"),
    "sandblaster": ("step_size", "history_size", "task_rows", "backup_tasks"),
}
ModeName = Literal["allreduce", "downpour", "easgd", "local_sgd", "gossip", "fsdp", "hogwild", "sandblaster"]
UNTIL_COUNTS = ("epochs", "steps", "seconds")  # spent in the phase


def option_users(option: str) -> list[str]:
    """The modes that use the strategy option `option`; none for an option of every mode (timeout_s)."""
    return [m for m, options in MODE_OPTIONS.items() if option in (*options, *STRATEGY_MODE_OPTIONS.get(m, ()))]


def unused_option(given: Iterable[str], modes: Sequence[str]) -> Optional[tuple[str, list[str]]]:
    """The first option of `given` that some mode uses and none of `modes` does, with the modes
    that use it; None when every given option is used. One rule for a phase and for the run."""
    for option in given:
        users = option_users(option)
        if users and not set(users) & set(modes):
            return option, users
    return None


class PhaseOptimizer(Section):
    """A phase's own optimizer settings: each given one overrides optimizer.* while the phase runs
    (e.g. a lower momentum for downpour's shards than for allreduce)."""

    lr: Optional[float] = Field(None, gt=0, description="As optimizer.lr.")
    momentum: Optional[float] = Field(None, ge=0, lt=1, description="As optimizer.momentum.")
    weight_decay: Optional[float] = Field(None, ge=0, description="As optimizer.weight_decay.")


class PhaseConfig(Section):
    """One phase of strategy.phases: a mode, that mode's options (each overrides the strategy.*
    value of the same name) and when the phase ends."""

    mode: ModeName = Field(description="The phase's synchronization mode.")
    until: Optional[dict[str, float]] = Field(
        None, description="One of {epochs: N}, {steps: N}, {seconds: S} spent in this phase, or {metric: threshold} "
        "for any metric the task produces or train_loss: reached (a metric whose goal is max, e.g. test_accuracy) or "
        "fallen to (goal min, e.g. test_loss)."
    )
    optimizer: Optional[PhaseOptimizer] = Field(None, description="This phase's optimizer.* overrides.")
    bucket_mb: Optional[float] = Field(None, gt=0, description="allreduce: as strategy.bucket_mb.")
    balance: Optional[bool] = Field(None, description="allreduce, local_sgd: as strategy.balance.")
    compression: Optional[Literal["none", "fp16", "bf16", "powersgd"]] = Field(
        None, description="allreduce: as strategy.compression.")
    powersgd_rank: Optional[int] = Field(None, ge=1, description="allreduce: as strategy.powersgd_rank.")
    backup_replicas: Optional[int] = Field(None, ge=0, description="allreduce: as strategy.backup_replicas.")
    n_fetch: Optional[int] = Field(None, ge=1, description="downpour: as strategy.n_fetch.")
    n_push: Optional[int] = Field(None, ge=1, description="downpour: as strategy.n_push.")
    max_in_flight: Optional[int] = Field(None, ge=1, description="downpour: as strategy.max_in_flight.")
    max_staleness: Optional[int] = Field(None, ge=0, description="downpour: as strategy.max_staleness.")
    staleness_lr: Optional[bool] = Field(None, description="downpour: as strategy.staleness_lr.")
    warmstart_steps: Optional[int] = Field(None, ge=0, description="downpour: as strategy.warmstart_steps.")
    tau: Optional[int] = Field(None, ge=1, description="easgd: as strategy.tau.")
    alpha: Optional[float] = Field(None, gt=0, le=1, description="easgd: as strategy.alpha.")
    variant: Optional[Literal["async", "sync"]] = Field(None, description="easgd: as strategy.variant.")
    momentum: Optional[float] = Field(None, ge=0, lt=1, description="easgd: as strategy.momentum.")
    period: Optional[int] = Field(None, ge=1, description="local_sgd, gossip: as strategy.period.")
    outer_lr: Optional[float] = Field(None, gt=0, description="local_sgd: as strategy.outer_lr.")
    outer_momentum: Optional[float] = Field(None, ge=0, lt=1, description="local_sgd: as strategy.outer_momentum.")

    @field_validator("until")
    @classmethod
    def _one_condition(cls, v: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        if v is None:
            return v
        if len(v) != 1:
            raise ValueError(f"give exactly one condition, got {sorted(v) or 'none'}")
        (key, value), = v.items()
        if not key.isidentifier():
            raise ValueError(f"unknown condition {key!r}; choose one of {', '.join(UNTIL_COUNTS)} or a metric name")
        if value <= 0 or (key in ("epochs", "steps") and value != int(value)):
            raise ValueError(f"{key} must be {'a whole number ' if key in ('epochs', 'steps') else ''}> 0, got {value}")
        return v

    @model_validator(mode="after")
    def _options_of_its_mode(self) -> "PhaseConfig":
        unused = unused_option([o for o in type(self).model_fields if getattr(self, o) is not None], [self.mode])
        if unused is not None:
            option, users = unused
            raise ValueError(f"{option}: used by {', '.join(users)}; this phase's mode ({self.mode}) does not use it")
        return self


class AdaptiveConfig(Section):
    """strategy.switch adaptive: from the step times the replicas report, go asynchronous while a
    replica straggles and come back when it recovers (policies/decisions/switching.py)."""

    sync_mode: Literal["allreduce", "local_sgd"] = Field(
        "allreduce", description="The mode while no replica straggles: allreduce, or local_sgd (the models averaged "
        "every strategy.period steps; with balance, each replica's period follows its speed)."
    )
    async_mode: Literal["downpour", "easgd", "hogwild", "backup"] = Field(
        "easgd", description="The mode while one does, so the others do not wait for it: easgd (as variant async "
        "with the strategy.* easgd options), downpour or hogwild (one node's replicas writing one shared vector), "
        "asynchronous; or backup: allreduce with "
        "strategy.backup_replicas (at least 1) backup replicas and no balancing, each step applying the first "
        "gradients and dropping the late ones, entered only when its predicted trained rows per second beat the "
        "synchronous mode's (see probe_s)."
    )
    slow_ratio: float = Field(
        2.0, gt=1, description="Go asynchronous when the ratio is at least this: with balance, the balanced "
        "step's predicted time over the ideal step's; without, the slowest replica's compute time per step over "
        "the median of the others'."
    )
    recover_ratio: float = Field(
        1.4, gt=1, description="Come back to the synchronous mode when the ratio is at most this (below "
        "slow_ratio: the gap is the hysteresis)."
    )
    patience: int = Field(
        2, ge=1, description="Consecutive observations (one per replica progress report) a condition must hold."
    )
    min_phase_s: float = Field(3.0, ge=0, description="No switch sooner than this many seconds after the last one.")
    probe_s: float = Field(
        20.0, gt=0, description="async_mode backup: a replica late at every step is not measured (it stops as soon "
        "as it is late), so after this many seconds with backups the run goes back to the synchronous mode to "
        "measure every replica again (a `probe` switch); the straggler rule brings the backups back if it still "
        "holds."
    )
    balance: bool = Field(
        True, description="The synchronous mode balances the batch by the replicas' speeds (strategy.balance, "
        "within balance_min_share..balance_max_share), and the ratios above compare the balanced step's predicted "
        "time with the ideal one (every row at the replicas' summed speed): the run goes asynchronous only for a "
        "straggler balancing cannot absorb. false: the ratios compare the slowest replica's compute time per step "
        "with the median of the others', without balancing."
    )
    sync_optimizer: Optional[PhaseOptimizer] = Field(None, description="optimizer.* overrides in the synchronous mode.")
    async_optimizer: Optional[PhaseOptimizer] = Field(
        None, description="optimizer.* overrides in the asynchronous mode (e.g. a lower momentum for downpour)."
    )

    @model_validator(mode="after")
    def _hysteresis(self) -> "AdaptiveConfig":
        if self.recover_ratio >= self.slow_ratio:
            raise ValueError(f"recover_ratio ({self.recover_ratio}) must be below slow_ratio ({self.slow_ratio})")
        return self


class StrategyConfig(Section):
    mode: ModeName = Field(
        "allreduce", description="Synchronization mode: allreduce (synchronous data parallel), downpour "
        "(asynchronous SGD via parameter shards), easgd (elastic averaging), local_sgd (local steps, the models "
        "averaged every strategy.period steps) or gossip (decentralized: every strategy.period steps each replica "
        "averages with its two ring neighbours) or fsdp (allreduce's update with the parameters, gradients and optimizer "
        "state split across the replicas: torch's fully_shard; one mode for the whole run) or hogwild (lock-free writes of "
        "one shared-memory parameter vector by the replicas on its node; the others push and pull) or sandblaster (full-batch "
        "L-BFGS: the replicas compute each pass's gradient in tasks, a coordinator on the driver moves the shards' "
        "parameters once per epoch; one mode for the whole run); see docs/modes.md."
    )
    timeout_s: float = Field(
        60.0, gt=0, description="Timeout of each call to the parameter shards and the partition server, and of the replicas' control calls (collectives and progress: fault_tolerance.hang_timeout_s)."
    )
    bucket_mb: float = Field(
        25.0, gt=0, description="Bucket size (MiB) for gradient all-reduce; the first bucket closes at "
        "1 MiB so the last layers' all-reduce overlaps the rest of the backward pass."
    )
    balance: bool = Field(
        False, description="allreduce: load-balanced batch shares. Each replica's share of the global batch "
        "(replicas x data.batch_size rows a step) follows its measured speed, so a slow replica takes fewer rows and "
        "nobody waits; the update is still the mean gradient over the step's rows. While the split is uneven, partitions are leased "
        "from one shared queue (a fast replica reads more of them); an even split runs as plain allreduce. local_sgd: "
        "each replica's period (steps between two rounds) follows its measured speed instead, replicas x "
        "strategy.period steps a round in all, each within balance_min_share..balance_max_share x period (kept even "
        "unless the split is predicted to shorten the round by more than 10%); partitions are leased "
        "as plain local SGD's while the periods are even, from one shared queue while they differ. See "
        "docs/modes-allreduce-options.md."
    )
    compression: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none", description="allreduce: how gradients travel. fp16 or bf16: summed in that dtype, half the bytes "
        "each all-reduce sends (gradients scaled by the global batch on the way, so fp16's range holds them; the "
        "loss sums and rows stay float32). powersgd: each matrix-shaped gradient sent as rank-powersgd_rank "
        "factors with error feedback, (n + m) r floats for an n x m matrix, in two all-reduces after the backward "
        "pass. Worth it where the link, not compute, bounds the step (`orchestrator simulate` says where). See "
        "docs/modes-allreduce-options.md."
    )
    powersgd_rank: int = Field(2, ge=1, description="allreduce with compression powersgd: the rank r of the "
                               "factors (higher: closer to the exact sum, more bytes).")
    backup_replicas: int = Field(
        0, ge=0, description="allreduce: backup replicas b. Each step applies the gradients of the first h - b "
        "replicas to finish their backward pass (h: the replicas holding a batch that step; at least one), "
        "weighted by rows; a late replica stops its work, joins the all-reduce with no rows, and its batch's rows "
        "are dropped (counted in the backup_dropped_rows metric and a backup_drops event). Every replica still "
        "takes the same step. Not with balance or compression powersgd. 0: wait for every replica. See "
        "docs/modes-allreduce-options.md."
    )
    balance_window: int = Field(8, ge=1, description="allreduce with balance: steps of measurements behind each new "
                                "split of the batch.")
    balance_min_share: float = Field(0.25, gt=0, le=1, description="allreduce with balance: the smallest share a "
                                     "replica is given, as a fraction of data.batch_size (local_sgd: of "
                                     "strategy.period, at least 1 step).")
    balance_max_share: float = Field(4.0, ge=1, description="allreduce with balance: the largest share a replica is "
                                     "given, as a multiple of data.batch_size; also the cap on the rows a replica "
                                     "takes at an uneven split's tail, where the replicas still holding rows share "
                                     "the global batch (local_sgd: the largest period, as a multiple of "
                                     "strategy.period).")
    n_fetch: int = Field(1, ge=1, description="downpour: pull parameters from the shards every n_fetch steps.")
    n_push: int = Field(1, ge=1, description="downpour: push the accumulated gradient every n_push steps.")
    max_in_flight: int = Field(2, ge=1, description="downpour: pushes outstanding before a replica waits.")
    max_staleness: Optional[int] = Field(
        None, ge=0, description="downpour: a replica more than this many steps ahead of the slowest waits (SSP); "
        "none = unbounded."
    )
    staleness_lr: bool = Field(False, description="downpour: shards step eta / staleness for stale gradients.")
    warmstart_steps: int = Field(0, ge=0, description="downpour: rank 0 trains alone for this many steps first.")
    tau: int = Field(4, ge=1, description="easgd: elastic exchange with the center every tau steps.")
    alpha: Optional[float] = Field(
        None, gt=0, le=1, description="easgd: elastic coefficient; default 0.9 / replicas (beta = 0.9)."
    )
    variant: Literal["async", "sync"] = Field("async", description="easgd: asynchronous, or synchronous at a barrier.")
    momentum: float = Field(
        0.0, ge=0, lt=1, description="easgd: local Nesterov momentum (EAMSGD) when > 0; optimizer.name sgd only."
    )
    period: int = Field(
        8, ge=1, description="local_sgd: each replica takes this many steps on its own (H) between two rounds that "
        "average the replicas' models in one all-reduce of the model. gossip: the steps between two rounds in which "
        "each replica averages its model with its two ring neighbours' (1: every step)."
    )
    outer_lr: float = Field(
        1.0, gt=0, description="local_sgd: the outer learning rate a round applies to the replicas' mean move "
        "(1 with outer_momentum 0: plain model averaging)."
    )
    outer_momentum: float = Field(
        0.0, ge=0, lt=1, description="local_sgd: Nesterov momentum of the outer step on the global model (DiLoCo; "
        "its paper uses 0.9 with outer_lr 0.7); 0: none."
    )
    step_size: float = Field(
        1.0, gt=0, description="sandblaster: L-BFGS's step (torch.optim.LBFGS's lr; the first iteration's is "
        "min(1, 1/|g|_1) times it). optimizer.* is not used by sandblaster.")
    history_size: int = Field(
        10, ge=1, description="sandblaster: the (s, y) pairs L-BFGS keeps, each a vector the size of the model split "
        "across the shards (the coordinator holds scalars only).")
    task_rows: Optional[int] = Field(
        None, ge=1, description="sandblaster: a gradient task is this many rows of a partition (each partition cut in "
        "turn, its last task shorter), so a pass has many small tasks, handed out by speed and backed up, from few "
        "large partitions; null: a task is a whole partition (set data.partitions instead).")
    backup_tasks: bool = Field(
        True, description="sandblaster: once a pass's queue of tasks is empty, a replica that asks for more "
        "computes a backup copy of a task another replica still holds (of the replica that has completed fewest); "
        "the first copy the shards get counts and the other replica drops the rest of its copy. false: a late "
        "task is waited for.")
    phases: Optional[list[PhaseConfig]] = Field(
        None, description="A run in phases, each {mode, that mode's options, until}: e.g. [{mode: downpour, n_push: "
        "4, until: {epochs: 2}}, {mode: allreduce, until: {test_accuracy: 0.96}}, {mode: easgd, tau: 8}]. `until`: "
        "epochs, steps or seconds spent in the phase, or a metric threshold (test_accuracy reached, test_loss or "
        "train_loss fallen to); the last phase has none and runs until the run stops. A phase's options override "
        "the strategy.* values above; none = one phase of strategy.mode. See "
        "docs/modes-switching.md."
    )
    switch: Literal["schedule", "adaptive"] = Field(
        "schedule", description="Who picks the mode: schedule (strategy.phases, or strategy.mode throughout) or "
        "adaptive (strategy.adaptive switches between a synchronous and an asynchronous mode while the run goes)."
    )
    adaptive: AdaptiveConfig = Field(
        default_factory=lambda: AdaptiveConfig(), description="The adaptive switch policy's rules (switch: adaptive)."
    )
    rollback_margin: Optional[float] = Field(
        0.5, gt=0, description="A run in phases: a switch is rolled back (the phase, mode and model from before it; "
        "no further switch that run) when the test loss at an epoch's end right after it is above the test loss at "
        "the switch by more than this fraction (0.5: 50% higher), or not finite; until then a step whose training "
        "loss is not finite is skipped, not the end of the run. null: never. See docs/modes-switching.md."
    )

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        """A run in phases is dumped without strategy.mode (its default would read as the
        one-mode form, and mode with phases is a config error): config.yaml and a checkpoint's
        config load back as they were given."""
        out = handler(self)
        if self.phases is not None and "mode" not in self.model_fields_set:
            out.pop("mode", None)
        return out

    @model_validator(mode="after")
    def _phases_fit(self) -> "StrategyConfig":
        if self.phases is None:
            if self.switch == "adaptive" and self.variant == "sync":
                raise ValueError("switch adaptive switches to and from asynchronous EASGD; strategy.variant "
                                 "sync cannot take part")
            return self
        if "mode" in self.model_fields_set:
            raise ValueError("set mode (one mode) or phases, not both")
        if self.switch == "adaptive":
            raise ValueError("switch adaptive picks the modes itself; remove phases or use "
                             "switch: schedule")
        if not self.phases:
            raise ValueError("phases: give at least one phase")
        for i, phase in enumerate(self.phases):
            last = i == len(self.phases) - 1
            if last and phase.until is not None:
                raise ValueError(f"phases[{i}]: the last phase runs until the run stops; remove its until")
            if not last and phase.until is None:
                raise ValueError(f"phases[{i}]: every phase but the last needs until (epochs, steps, "
                                 "seconds or a metric threshold)")
            variant = phase.variant if phase.variant is not None else self.variant
            if len(self.phases) > 1 and phase.mode == "easgd" and variant == "sync":
                raise ValueError(f"phases[{i}]: synchronous EASGD cannot switch mid-run (its rounds are "
                                 "not paused yet); use variant async in a run with several phases")
        return self

    @model_validator(mode="after")
    def _backups_fit(self) -> "StrategyConfig":
        for i, phase in enumerate(self.plan()):
            if phase["mode"] != "allreduce" or not phase["backup_replicas"]:
                continue
            where = f"phases[{i}]: " if self.phases else ""
            if phase["balance"]:
                hint = "strategy.adaptive.balance" if self.switch == "adaptive" else "balance"
                raise ValueError(f"{where}backup_replicas and balance do not go together (balance sizes the batches "
                                 f"so nobody waits); set {hint} false or backup_replicas 0")
            if phase["compression"] == "powersgd":
                raise ValueError(f"{where}backup_replicas and compression powersgd do not go together (PowerSGD's "
                                 "error feedback would send a late replica's residual); use none, fp16 or bf16")
        return self

    def plan(self) -> list[dict[str, Any]]:
        """The strategy of each phase, in order: every strategy.* value with the phase's own
        options over it, `until` (None for the last) and `optimizer` (its optimizer.* overrides). `switch: adaptive`: the synchronous
        and the asynchronous mode it moves between (no until; the policy decides)."""
        base = self.model_dump(exclude={"phases", "switch", "adaptive"})

        def opt(o: Optional[PhaseOptimizer]) -> dict[str, Any]:
            return o.model_dump(exclude_none=True) if o is not None else {}

        if self.switch == "adaptive":
            a = self.adaptive
            sync = {**base, "mode": a.sync_mode, "variant": "async", "until": None, "optimizer": opt(a.sync_optimizer),
                    "balance": a.balance}
            if a.async_mode == "backup":  # allreduce with backups: the backups belong to the straggler phase
                sync["backup_replicas"] = 0
                straggler = {**base, "mode": "allreduce", "variant": "async", "until": None,
                             "optimizer": opt(a.async_optimizer), "balance": False,
                             "backup_replicas": max(1, base["backup_replicas"])}
            else:
                straggler = {**base, "mode": a.async_mode, "variant": "async", "until": None,
                             "optimizer": opt(a.async_optimizer), "balance": base["balance"]}
            return [sync, straggler]
        phases = self.phases or [PhaseConfig(mode=self.mode)]
        return [{**base, **phase.model_dump(exclude_none=True, exclude={"until", "optimizer"}), "until": phase.until,
                 "optimizer": opt(phase.optimizer)} for phase in phases]

    def modes(self) -> list[str]:
        """Every mode the run can take."""
        return [p["mode"] for p in self.plan()]

    def unused_option(self) -> Optional[str]:
        """Why an option set here does nothing in this run (`strategy.tau` in an allreduce run), or
        None. An option at its default counts as not set: a whole dumped config (config.yaml, a
        checkpoint's) holds every option and loads back."""
        fields = type(self).model_fields
        given = [o for o in fields if o in self.model_fields_set and getattr(self, o) != fields[o].get_default()]
        modes = list(dict.fromkeys(self.modes()))
        unused = unused_option(given, modes)
        if unused is None:
            return None
        option, users = unused
        return f"strategy.{option}: used by {', '.join(users)}; this run's modes ({', '.join(modes)}) do not use it"
