"""A cost model of one training step in each mode, for any number of replicas: what
`python -m orchestrator simulate` prints (orchestrator/cli/simulate.py) and what a scheduler can
weigh a switch with. Pure maths, no Ray, no torch.

Inputs (`Calibration`): the trainable parameter count P (4 bytes each: M = 4P bytes on the wire
per full exchange), the per-replica batch b, one step's compute seconds t (forward, backward,
update of one replica), the link's latency alpha (seconds per message) and inverse bandwidth
beta (seconds per byte), and how many replicas the hosts run at full speed (`cores`: beyond it
compute and communication slow in proportion, as on one machine whose cores are shared: there
the loopback "link" is memory copies and protocol work on the same cores). Stragglers
(`Stragglers`): each replica's step takes t x factor with probability p (a slowed replica), and
every step is jittered by a lognormal of sigma `jitter`.

The alpha-beta model per step, n replicas:
- allreduce (ring): E[max over n of the compute] + 2 (n-1)/n M beta + 2 (n-1) alpha: everybody
  waits for the slowest, then a ring all-reduce (reduce-scatter + all-gather);
- local SGD with period H (H = 1 is allreduce): the ring once every H steps, and the slowest
  replica's H-step block: E[max over n of a sum of H steps] / H;
- gossip with period H: the same H-step block, then a round: the model to each of the two ring
  neighbours and theirs back, min(2, n-1) (M beta + alpha), whatever n, plus a 3-float
  all-reduce, 2 (n-1) alpha (the epoch's one consensus all-reduce is left out);
- downpour (S shards, push every n_push steps, pull every n_fetch): each replica steps at its own
  speed (the mean compute) plus its push and pull traffic on its own link; the shards serve at
  most b / ((M/S) beta (1/n_push + 1/n_fetch)) samples/s (their links carry every replica's
  traffic);
- easgd (S shards, an exchange every tau steps: M up and M down): as downpour with
  1/n_push + 1/n_fetch = 2/tau;
- fsdp (U units): allreduce's wait for the slowest, then per unit two all-gathers of its
  parameters (forward, backward) and a reduce-scatter of its gradients, each (n-1)/n of its
  bytes: 3 (n-1)/n M beta + 3 U (n-1) alpha, plus two small all-reduces (the step's rows and
  flags, its loss), 4 (n-1) alpha; a replica holds 1/n of the parameters, gradients and
  optimizer state (`extra["state_share"]`);
- hogwild (one shard, k = min(n, node_replicas) replicas on its node): those k step at their own
  speed with nothing on the wire, as long as the node's memory carries the shared vector's
  traffic: each direct step reads x in its forward pass and reads and writes it in its update,
  3 M bytes that another writer's update has made stale in this core's caches, so the k writers
  together take at most b mem / (3 M) samples/s (mem: the node's memory bandwidth,
  `memory_bytes_per_s`; left out when not calibrated); the other n - k are downpour with
  n_push = n_fetch = 1 through the one shard, its link capping them at b / (2 M beta) samples/s;
- sandblaster (S shards; a pass of R/b batches in tasks of k batches, one L-BFGS iteration with
  h history pairs per pass): each replica computes at its own speed from one shared queue of
  tasks (the sum of the replicas' rates, as downpour's), pushes M bytes per task (M/k per step)
  and pulls M once per pass; the pass ends with a wait for the last task (the slowest replica's
  k steps, less a mean one's) and the coordinator's 2 h + 6 round trips to the shards (alpha
  each, scalars only), both spread over the pass's R / (n b) steps per replica. The shards take
  every task's M/S bytes: at most k b / ((M/S) beta) samples/s. One update per pass, whatever n:
  the samples/s here are gradient rows, not updates;
- backup (allreduce with b backup replicas): the wait is for the (n - b)-th fastest replica
  instead of the slowest, the ring is the same, and a step trains on (n - b) x b rows;
- single: one replica, compute only.
Samples/s = replicas x b / step seconds (backup: the rows trained on; the asynchronous modes:
the sum of each replica's rate, capped by the shards). Where it stops being trustworthy: it has no overlap of compute and
communication (our allreduce overlaps bucket reductions with the backward pass, so it is
pessimistic when communication is large), no contention beyond the shards' links (a switch's
bisection bandwidth, the Ray object store), and a straggler model of independent steps (a
replica slow for a whole phase is `p = 1/n, persistent`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

import numpy as np

BYTES_PER_PARAM = 4
MODES = ("single", "allreduce", "backup", "local_sgd", "gossip", "fsdp", "downpour", "easgd", "hogwild", "sandblaster")
SAMPLES = 4000  # draws for an expected maximum with jitter (a fixed seed: the same answer every time)


@dataclass(frozen=True)
class Calibration:
    params: int  # trainable parameters
    batch: int  # per-replica batch
    compute_s: float  # one step's compute on one replica
    alpha_s: float  # seconds per message
    beta_s_per_byte: float  # seconds per byte on a replica's link
    cores: Optional[float] = None  # replicas the hosts run at full speed (None: as many as asked)
    source: str = ""  # where the figures came from (a calibration here, a run, flags)
    allreduce_bytes_per_param: float = BYTES_PER_PARAM  # 2 with fp16 / bf16; PowerSGD: its factors' share
    shard_beta_s_per_byte: Optional[float] = None  # the shards' path when it differs from the link (from a run)
    memory_bytes_per_s: Optional[float] = None  # a node's memory bandwidth (hogwild's shared vector; None: left out)

    @property
    def shard_beta(self) -> float:
        return self.beta_s_per_byte if self.shard_beta_s_per_byte is None else self.shard_beta_s_per_byte

    @property
    def model_bytes(self) -> int:
        return self.params * BYTES_PER_PARAM

    def __post_init__(self) -> None:
        for name in ("params", "batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("compute_s", "alpha_s", "beta_s_per_byte"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if self.shard_beta_s_per_byte is not None and not (self.shard_beta_s_per_byte >= 0
                                                            and math.isfinite(self.shard_beta_s_per_byte)):
            raise ValueError(f"shard_beta_s_per_byte must be a finite number >= 0, got {self.shard_beta_s_per_byte}")
        if self.memory_bytes_per_s is not None and not (self.memory_bytes_per_s > 0
                                                         and math.isfinite(self.memory_bytes_per_s)):
            raise ValueError(f"memory_bytes_per_s must be a finite number > 0, got {self.memory_bytes_per_s}")
        if self.cores is not None and not self.cores > 0:
            raise ValueError(f"cores must be > 0, got {self.cores}")


@dataclass(frozen=True)
class Stragglers:
    p: float = 0.0  # chance that a replica's step is slowed
    factor: float = 1.0  # how much slower it is then
    jitter: float = 0.0  # lognormal sigma of every step
    persistent: bool = False  # the slowed replicas stay slow (a heterogeneous cluster): blocks do not average it out

    def __post_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {self.p}")
        if not self.factor >= 1.0:
            raise ValueError(f"factor must be >= 1, got {self.factor}")
        if not self.jitter >= 0.0:
            raise ValueError(f"jitter must be >= 0, got {self.jitter}")


@dataclass(frozen=True)
class ModeShape:
    """What a mode's step exchanges: the local-SGD period, the shards, Downpour's periods."""

    period: int = 4  # local SGD's H (and EASGD's tau when `tau` is not given)
    tau: Optional[int] = None  # EASGD's period
    shards: int = 1
    n_push: int = 1
    n_fetch: int = 1
    backups: int = 1  # allreduce with backup replicas: the step applies the first n - backups gradients
    units: int = 4  # fsdp: the sharded units (each a gather before its forward and its backward, a reduce-scatter after)
    node_replicas: Optional[int] = None  # hogwild: replicas on the shard's node, writing it directly (None: all)
    task_steps: int = 4  # sandblaster: batches in a task (a partition's rows / b)
    pass_steps: int = 64  # sandblaster: batches in a pass over the train rows (R / b)
    history: int = 10  # sandblaster: L-BFGS's history pairs (the coordinator's round trips per iteration)


@dataclass
class Prediction:
    mode: str
    replicas: int
    step_s: float  # one replica's step (the asynchronous modes: the mean replica's)
    compute_s: float  # of which compute (including waiting for the slowest, in lock-step modes)
    comm_s: float  # of which communication
    samples_per_s: float
    bound: str = "replicas"  # what limits it: "replicas", "shards", or (hogwild's direct writers) "memory"
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return asdict(self)


def slowdown(cal: Calibration, n: int) -> float:
    """Compute and communication slow in proportion once n replicas exceed the cores that run
    them at full speed."""
    return max(1.0, n / cal.cores) if cal.cores else 1.0


def mean_compute(cal: Calibration, n: int, s: Stragglers) -> float:
    """A replica's mean step compute."""
    jitter = math.exp(s.jitter ** 2 / 2)
    return cal.compute_s * slowdown(cal, n) * (1 + s.p * (s.factor - 1)) * jitter


def max_compute(cal: Calibration, n: int, s: Stragglers, block: int = 1, first: Optional[int] = None) -> float:
    """E[max over n replicas of the mean step compute over a block of `block` steps]: what a
    lock-step mode waits for per step. `first`: the `first`-th fastest instead of the slowest
    (backup replicas wait for the first n - b)."""
    t = cal.compute_s * slowdown(cal, n)
    kth = n if first is None else max(1, min(n, first))  # the kth smallest of the n
    if n == 1 and not s.persistent:
        return mean_compute(cal, n, s)
    if s.jitter == 0.0 and (block == 1 or s.persistent or s.p in (0.0, 1.0)):
        if s.persistent:  # round(p n) replicas are slow for good: the kth waits for one if fewer are fast
            return t * (s.factor if n - round(s.p * n) < kth else 1.0)
        # the kth fastest is slow when fewer than kth of the n are fast
        p_slow = sum(math.comb(n, j) * (1 - s.p) ** j * s.p ** (n - j) for j in range(kth))
        return t * (s.factor * p_slow + (1 - p_slow))
    rng = np.random.default_rng(0)
    draws = max(1, SAMPLES // max(1, n // 64))
    out = 0.0
    for lo in range(0, draws, 256):
        k = min(256, draws - lo)
        steps = np.ones((k, n, block))
        if s.persistent:
            steps[:, : max(0, round(s.p * n)), :] = s.factor
        else:
            steps = np.where(rng.random((k, n, block)) < s.p, s.factor, 1.0)
        if s.jitter:
            steps = steps * rng.lognormal(0.0, s.jitter, (k, n, block))
        out += float(np.sort(steps.mean(axis=2), axis=1)[:, kth - 1].sum())
    return t * out / draws


def ring_allreduce_s(cal: Calibration, n: int) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * cal.params * cal.allreduce_bytes_per_param * cal.beta_s_per_byte + 2 * (n - 1) * cal.alpha_s


def predict(mode: str, n: int, cal: Calibration, s: Stragglers = Stragglers(),
            shape: ModeShape = ModeShape()) -> Prediction:
    """One mode at n replicas (module doc)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if n < 1:
        raise ValueError(f"replicas must be >= 1, got {n}")
    b = cal.batch
    if mode == "single":
        c = mean_compute(cal, 1, Stragglers(jitter=s.jitter))
        return Prediction(mode, 1, c, c, 0.0, b / c)
    if mode == "backup":  # allreduce that applies the first q = n - backups gradients: their rows, the full ring
        q = max(1, n - shape.backups)
        c = max_compute(cal, n, s, first=q)
        comm = ring_allreduce_s(cal, n) * slowdown(cal, n)
        step = c + comm
        return Prediction(mode, n, step, c, comm, q * b / step, extra={"backups": n - q, "rows_per_step": q * b})
    if mode in ("allreduce", "local_sgd"):
        h = 1 if mode == "allreduce" else max(1, shape.period)
        c = max_compute(cal, n, s, block=h)
        ring = cal if mode == "allreduce" else replace(cal, allreduce_bytes_per_param=BYTES_PER_PARAM)  # float32 rounds
        comm = ring_allreduce_s(ring, n) * slowdown(cal, n) / h
        step = c + comm
        return Prediction(mode, n, step, c, comm, n * b / step, extra={"period": h})
    if mode == "fsdp":  # per unit: two all-gathers and a reduce-scatter, (n-1)/n of its bytes each; two small sums
        c = max_compute(cal, n, s)
        u = max(1, shape.units)
        comm = 0.0 if n <= 1 else (3 * (n - 1) / n * cal.model_bytes * cal.beta_s_per_byte
                                   + (3 * u + 4) * (n - 1) * cal.alpha_s) * slowdown(cal, n)
        step = c + comm
        return Prediction(mode, n, step, c, comm, n * b / step, extra={"units": u, "state_share": 1 / n})
    if mode == "gossip":  # a round: the model to each ring neighbour and theirs back, and a 3-float all-reduce
        h = max(1, shape.period)
        c = max_compute(cal, n, s, block=h)
        exchange = min(2, n - 1) * (cal.model_bytes * cal.beta_s_per_byte + cal.alpha_s)
        comm = (exchange + 2 * (n - 1) * cal.alpha_s) * slowdown(cal, n) / h
        step = c + comm
        return Prediction(mode, n, step, c, comm, n * b / step, extra={"period": h})
    if mode == "hogwild":
        return _hogwild(n, cal, s, shape)
    if mode == "sandblaster":
        return _sandblaster(n, cal, s, shape)
    if mode == "downpour":
        per_step_exchanges = 1 / max(1, shape.n_push) + 1 / max(1, shape.n_fetch)
    else:  # easgd: M up and M down every tau steps
        per_step_exchanges = 2 / max(1, shape.tau or shape.period)
    c = mean_compute(cal, n, s)
    comm = per_step_exchanges * (cal.model_bytes * cal.shard_beta + cal.alpha_s) * slowdown(cal, n)
    step = c + comm
    replicas_rate = n * b / step
    shard_s = per_step_exchanges * (cal.model_bytes / max(1, shape.shards)) * cal.shard_beta
    cap = b / shard_s if shard_s > 0 else math.inf
    bound = "shards" if cap < replicas_rate else "replicas"
    rate = min(replicas_rate, cap)
    return Prediction(mode, n, n * b / rate if bound == "shards" else step, c, comm, rate, bound,
                      extra={"shards": shape.shards, "shard_cap_samples_per_s": cap if math.isfinite(cap) else None})


HOGWILD_VECTOR_PASSES = 3  # a direct step's passes over the shared vector: the forward's read, the update's read and write


def _hogwild(n: int, cal: Calibration, s: Stragglers, shape: ModeShape) -> Prediction:
    """Direct writers at compute speed, together no faster than the node's memory carries the
    shared vector; the rest push and pull every step through the one shard."""
    b, c = cal.batch, mean_compute(cal, n, s)
    local = n if shape.node_replicas is None else max(0, min(n, shape.node_replicas))
    remote = n - local
    comm = 2 * (cal.model_bytes * cal.shard_beta + cal.alpha_s) * slowdown(cal, n)
    shard_s = 2 * cal.model_bytes * cal.shard_beta
    cap = b / shard_s if shard_s > 0 else math.inf
    remote_rate = min(remote * b / (c + comm), cap) if remote else 0.0
    memory_cap = (b * cal.memory_bytes_per_s / (HOGWILD_VECTOR_PASSES * cal.model_bytes)
                  if cal.memory_bytes_per_s else math.inf)
    direct_rate = min(local * b / c, memory_cap) if local else 0.0
    rate = direct_rate + remote_rate
    bound = ("shards" if remote and remote * b / (c + comm) > cap
             else "memory" if local and local * b / c > memory_cap else "replicas")
    # a step's seconds as the rate implies them (a shard-bound writer waits for the shard: downpour's n b / rate)
    return Prediction("hogwild", n, n * b / rate if rate > 0 else c, c, remote * comm / n, rate, bound,
                      extra={"direct": local, "through_shard": remote,
                             **({"memory_cap_samples_per_s": memory_cap} if math.isfinite(memory_cap) else {})})


def _sandblaster(n: int, cal: Calibration, s: Stragglers, shape: ModeShape) -> Prediction:
    """Tasks from one shared queue at each replica's speed; a push per task, a pull and the
    coordinator's round trips per pass; the wait for the pass's last task."""
    b, c = cal.batch, mean_compute(cal, n, s)
    k = max(1, shape.task_steps)
    per_replica = max(1.0, shape.pass_steps / n)  # a replica's steps in one pass
    wire = cal.model_bytes * cal.shard_beta + cal.alpha_s
    coordinator = (2 * shape.history + 6) * cal.alpha_s
    tail = k * max(0.0, max_compute(cal, n, s) - c)  # the last task's wait, beyond a mean replica's
    comm = (wire / k + (wire + coordinator + tail) / per_replica) * slowdown(cal, n)
    step = c + comm
    replicas_rate = n * b / step
    shard_s = (cal.model_bytes / max(1, shape.shards)) * cal.shard_beta / k
    cap = b / shard_s if shard_s > 0 else math.inf
    bound = "shards" if cap < replicas_rate else "replicas"
    rate = min(replicas_rate, cap)
    return Prediction("sandblaster", n, n * b / rate if bound == "shards" else step, c, comm, rate, bound,
                      extra={"shards": shape.shards, "updates_per_pass": 1,
                             "shard_cap_samples_per_s": cap if math.isfinite(cap) else None})


def table(replicas: list[int], cal: Calibration, s: Stragglers = Stragglers(), shape: ModeShape = ModeShape(),
          modes: tuple[str, ...] = MODES) -> list[Prediction]:
    """Every mode at every replica count (single once)."""
    out = []
    for mode in modes:
        for n in ([1] if mode == "single" else replicas):
            out.append(predict(mode, n, cal, s, shape))
    return out


def fit_link(sizes_bytes: list[float], seconds: list[float], n: int = 2) -> tuple[float, float]:
    """alpha, beta from ring all-reduce timings of messages of `sizes_bytes` among n processes
    (least squares on t = 2 (n-1) alpha + 2 (n-1)/n size beta, both kept >= 0)."""
    if len(sizes_bytes) != len(seconds) or len(seconds) < 2:
        raise ValueError("need at least two (size, seconds) timings")
    a = np.array([[2 * (n - 1), 2 * (n - 1) / n * s] for s in sizes_bytes], dtype=float)
    (alpha, beta), *_ = np.linalg.lstsq(a, np.array(seconds, dtype=float), rcond=None)
    return max(0.0, float(alpha)), max(0.0, float(beta))
