"""The config sections of the replicas as a fleet: how many and where (scaling), what happens
when one fails (fault tolerance), and the faults a test or benchmark injects."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from orchestrator.config.sections import Section


class ScalingConfig(Section):
    replicas: int = Field(2, ge=1, description="Number of ModelReplica actors. A local Ray cluster the run starts "
                          "itself declares at most 4 logical CPUs per core of the machine: replicas x cpus_per_replica "
                          "beyond that is refused before Ray starts (join a cluster for more).")
    cpus_per_replica: float = Field(1.0, gt=0, description="Logical CPUs per replica (also its torch threads).")
    gpus_per_replica: float = Field(
        0.0, ge=0, description="GPUs per replica, at most 1: a replica trains on one GPU today (more would be "
        "reserved and left idle). 1: each replica has its own GPU and allreduce/local_sgd reduce with NCCL; a "
        "fraction (e.g. 0.5): replicas share a GPU and reduce with gloo (NCCL cannot put two ranks on one GPU)."
    )
    memory_per_replica_mb: Optional[float] = Field(
        None, gt=0, description="A replica's memory budget (MB) for the model's parameters, gradients and optimizer "
        "state, checked before anything starts: allreduce and the other modes hold all of it in every replica, "
        "(2 + the optimizer's tensors per parameter) x the parameters' bytes; fsdp a 1/replicas slice plus the "
        "largest sharded unit whole. A run over it is refused in one line naming the budget "
        "(docs/modes-synchronous.md, \"fsdp\"). None: no check."
    )
    shards: int = Field(
        1, ge=1, description="ParameterShard actors (downpour, easgd; hogwild takes exactly 1); they reserve no CPU; "
        "at most one per model parameter."
    )
    min_replicas: int = Field(
        1, ge=1, description="The fewest replicas the run goes on with when a dead replica is not replaced "
        "(fault_tolerance.max_replica_restarts spent, or its node gone and no room elsewhere: a shrink); below it "
        "the run fails."
    )
    max_replicas: Optional[int] = Field(
        None, ge=1, description="The most replicas the run may grow to when the cluster has room; none = "
        "scaling.replicas (no growth beyond it; a run that shrank grows back to it). New replicas start when room "
        "is seen and join once ready, at the replicas' next partition boundary; while below it the run asks the "
        "autoscaler for the room "
        "(docs/elasticity.md)."
    )
    lr_scaling: Literal["linear", "none"] = Field(
        "linear", description="How the learning rate follows the replica count on a resize: linear (optimizer.lr "
        "x replicas / scaling.replicas, a rise reached by a warmup of lr_warmup_steps) or none (optimizer.lr "
        "throughout). Applies to allreduce (its batch is replicas x data.batch_size); easgd keeps beta = replicas "
        "x alpha; downpour's rate does not change."
    )
    lr_warmup_steps: int = Field(
        100, ge=0, description="Steps of the linear ramp from the current learning rate up to the new one after a "
        "grow (lr_scaling linear); 0 = at once. A shrink lowers the rate at once."
    )
    poll_s: float = Field(
        5.0, gt=0, description="Seconds between two looks at the cluster's resources by the scaling policy (a "
        "replica whose node dies is seen at once, without waiting for a poll)."
    )
    grow_after: int = Field(
        2, ge=1, description="Consecutive polls that must see room for another replica before the run grows (a "
        "shrink after lost resources is at once)."
    )
    wait_for_room_s: float = Field(
        600.0, ge=0, le=86400, description="On a cluster the run joins (RAY_ADDRESS, `ray job submit`, an earlier "
        "ray.init) that cannot hold the starting replicas yet: ask the autoscaler for them and wait up to this "
        "many seconds for the room (a cluster scaling up from zero worker nodes), then exit 2 naming what is "
        "short. 0 = refuse at once. A local cluster the run starts itself is never waited for."
    )

    @field_validator("gpus_per_replica")
    @classmethod
    def _one_gpu_at_most(cls, v: float) -> float:
        if v > 1:
            raise ValueError("a replica uses one GPU today (its model and batches go to one device), so at most 1")
        return v

    def max_or_replicas(self) -> int:
        """max_replicas, or replicas when it is unset (no growth)."""
        return self.max_replicas if self.max_replicas is not None else self.replicas


class FaultToleranceConfig(Section):
    max_replica_restarts: int = Field(
        3, ge=0, description="Replicas replaced per run (a dead, hung or raising replica is replaced by a new "
        "actor or a spare); past it a dead replica is dropped if scaling.min_replicas allows, else the run fails."
    )
    restart_backoff_s: float = Field(
        0.0, ge=0, description="Seconds to wait before the n-th replacement in a row: restart_backoff_s * "
        "2^(n-1), at most 30 s; 0 replaces at once. A run that goes one epoch without a failure starts over at n = 1."
    )
    spares: int = Field(
        0, ge=0, description="Idle replicas started with the run (model built, no CPU reserved; with GPUs each holds its GPU): a failed replica "
        "is replaced at once by a spare, which is then started afresh in the background."
    )
    hang_timeout_s: float = Field(
        60.0, gt=0, description="A replica that reports no progress for this long is hung: it is killed and "
        "replaced; so is one that has not answered a call made to every member this long after the others did "
        "(the epoch's evaluation, a switch's steps). allreduce: also the process group's collective timeout. A parameter shard or the partition "
        "server whose pings go unanswered for half of it is killed and rebuilt (from its snapshot, its journal)."
    )
    shard_snapshot_every_s: float = Field(
        5.0, gt=0, description="downpour, easgd: seconds between snapshots of each parameter shard, from which a "
        "dead shard is rebuilt (the replicas replay the updates they pushed since)."
    )


class SlowWindow(Section):
    """A deliberate straggler: replica `rank` slowed while its step count or the training time
    is inside the window."""

    rank: int = Field(ge=0, description="The replica to slow.")
    delay_s: Optional[float] = Field(None, ge=0, description="Seconds added to each of its steps.")
    factor: Optional[float] = Field(
        None, ge=1, description="Or: its compute takes this many times as long, as on a slower device (after each "
        "step it sleeps factor - 1 times that step's own work: the step's duration less its time in communication, "
        "waiting for others included there)."
    )
    from_step: Optional[int] = Field(None, ge=0, description="From this step of the replica on (default: the start).")
    to_step: Optional[int] = Field(None, ge=0, description="Until this step (default: the end).")
    from_s: Optional[float] = Field(None, ge=0, description="From this many seconds after training started.")
    to_s: Optional[float] = Field(None, ge=0, description="Until this many seconds after training started.")

    @model_validator(mode="after")
    def _one_way(self) -> "SlowWindow":
        if (self.delay_s is None) == (self.factor is None):
            raise ValueError("give delay_s or factor (one of them)")
        if (self.from_step is not None or self.to_step is not None) and (self.from_s is not None or self.to_s is not None):
            raise ValueError("give the window in steps (from_step, to_step) or seconds (from_s, to_s), not both")
        return self


class FaultsConfig(Section):
    slow_replicas: list[SlowWindow] = Field(
        default_factory=list, description="Straggler experiments: a list of windows {rank, delay_s or factor, "
        "from_step/to_step or from_s/to_s}; or the short form {rank: seconds added to each step} (all run long)."
    )

    @field_validator("slow_replicas", mode="before")
    @classmethod
    def _short_form(cls, v: Any) -> Any:
        if isinstance(v, dict):
            for rank, delay in v.items():
                if not isinstance(rank, int) or rank < 0 or not isinstance(delay, (int, float)) or delay < 0:
                    raise ValueError(f"ranks and delays must be >= 0, got {rank}: {delay}")
            return [{"rank": rank, "delay_s": delay} for rank, delay in v.items()]
        return v

    link_gbps: Optional[float] = Field(
        None, gt=0, description="An emulated slower network for the replicas' collectives (allreduce, local_sgd): "
        "each all-reduce or broadcast of N bytes among p replicas takes at least 2 (p - 1) / p x N x 8 / "
        "(link_gbps x 1e9) seconds on each replica (a ring's traffic on one link; collectives queue on it one "
        "after another), plus link_latency_us. A replica that finishes sooner waits out the rest. none: the "
        "real network as it is. For benchmarks of compression and local SGD where bandwidth, not compute, bounds "
        "the step."
    )
    link_latency_us: float = Field(
        0.0, ge=0, description="With link_gbps: microseconds added to each collective (the alpha of the alpha-beta "
        "model)."
    )
