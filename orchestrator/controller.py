"""The controller: an explicit state machine that turns decisions into actions.

States: STARTING -> RUNNING (one epoch per step()) -> FINISHING -> FINISHED, or ERRORED.
Policies decide (policies/stop.py, policies/allreduce.py); the controller starts actors,
moves data into the object store, waits with timeouts, logs to MLflow and checkpoints.
"""
from __future__ import annotations

import enum
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import ray

from orchestrator.checkpoint import save_checkpoint
from orchestrator.config import JobConfig
from orchestrator.data import Dataset, eval_slices, partition
from orchestrator.errors import TrainingError
from orchestrator.progress import ProgressDisplay
from orchestrator.tracking import Tracker
from policies.leases import first_grant_messages
from policies.modes import needs_shards
from policies.stop import EpochSnapshot, StopPolicy

CONTROL_CALL_TIMEOUT_S = 30.0


class State(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    FINISHING = "finishing"
    FINISHED = "finished"
    ERRORED = "errored"


@dataclass
class RunTotals:
    epochs: int = 0
    steps: int = 0
    samples: int = 0
    epoch_wall_s: float = 0.0  # whole epochs: training + evaluation + logging
    train_s: float = 0.0  # inside the replicas' step loops (slowest replica per epoch)
    comm_s: float = 0.0
    startup_s: float = 0.0
    time_to_target_s: Optional[float] = None
    test_accuracy: float = float("nan")
    test_loss: float = float("nan")
    train_loss: float = float("nan")
    stop_reason: str = ""
    checkpoint: Optional[str] = None
    rows_per_epoch: list[int] = field(default_factory=list)  # train rows each epoch stepped on (all replicas)


def merge_epoch_stats(stats: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One totals row per rank (a replica runs twice in an epoch when it takes over a dead
    replica's partitions)."""
    merged: dict[int, dict[str, Any]] = {}
    for s in stats:
        m = merged.get(s["rank"])
        if m is None:
            merged[s["rank"]] = dict(s)
            continue
        for key in ("steps", "samples", "train_s", "comm_s"):
            m[key] += s[key]
        m["consumed"] = m["consumed"] + s["consumed"]
        m["partitions"] = m["partitions"] + s["partitions"]
        m.update(eval=s["eval"], loss=s["loss"], mode=s["mode"])
    return [merged[r] for r in sorted(merged)]


def mode_metrics(mode: str, stats: list[dict[str, Any]]) -> dict[str, float]:
    """Each mode's own per-epoch figures, combined across replicas."""
    modes = [s["mode"] for s in stats]
    slowest = max(s["train_s"] for s in stats)
    if mode == "downpour":
        pushes = sum(m["pushes"] for m in modes)
        return {"staleness_mean": sum(m["staleness_mean"] * m["pushes"] for m in modes) / max(pushes, 1),
                "staleness_max": max(m["staleness_max"] for m in modes),
                "pushes_per_s": pushes / max(slowest, 1e-9)}
    if mode == "easgd":
        return {"elastic_distance": sum(m["elastic_distance"] for m in modes) / len(modes),
                "elastic_distance_mean": sum(m["elastic_distance_mean"] for m in modes) / len(modes),
                "exchanges_per_s": sum(m["exchanges"] for m in modes) / max(slowest, 1e-9)}
    return {}


class Controller:
    def __init__(self, config: JobConfig, dataset: Dataset, tracker: Optional[Tracker], t0: float,
                 display: Optional[ProgressDisplay] = None, trace_ids: bool = False) -> None:
        self.cfg = config
        self.dataset = dataset
        self.tracker = tracker
        self.t0 = t0
        self.display = display
        self.trace_ids = trace_ids
        self.state = State.STARTING
        self.replicas: list[Any] = []
        self.shards: list[Any] = []
        self.totals = RunTotals()
        self.consumed: list[dict[int, list[list[int]]]] = []  # [epoch] {rank: [step] -> row ids} (trace_ids)
        self.redone: list[dict[str, Any]] = []  # partitions served again after a replica died
        self.alive: dict[int, Any] = {}
        self.server = None
        self.partition_refs: list = []  # the train partitions in the object store (kept alive here)
        self._unreported: dict[int, list[int]] = {}  # last epoch's final completions, not yet reported
        self.progress: dict[int, int] = {}  # rank -> the last step it reported (progress rows)
        s = config.stop
        self.stop_policy = StopPolicy(s.epochs, s.target_accuracy, s.at_target, s.max_wall_s)
        self.steps_per_epoch = 0
        self._train_started = 0.0
        self._last_state: Optional[dict[str, Any]] = None

    # ---- the state machine ---------------------------------------------------------------
    def step(self) -> State:
        try:
            if self.state is State.STARTING:
                self._start()
                self.state = State.RUNNING
            elif self.state is State.RUNNING:
                if self._run_epoch():
                    self.state = State.FINISHING
            elif self.state is State.FINISHING:
                self._finish()
                self.state = State.FINISHED
        except BaseException:
            self.state = State.ERRORED
            raise
        return self.state

    def run(self) -> RunTotals:
        while self.step() not in (State.FINISHED, State.ERRORED):
            pass
        return self.totals

    # ---- STARTING: data into the object store, actors, process group -----------------------
    def launch(self) -> None:
        """Ask Ray for the actors the mode needs and return at once: their worker processes boot
        (import torch, build the model) while the caller does other start-up work."""
        from actors.replica import ModelReplica

        cfg, n = self.cfg, self.cfg.scaling.replicas
        shards, bounds = self._launch_shards() if needs_shards(cfg.strategy.mode) else (None, None)
        raw = cfg.model_dump()
        self.replicas = [
            ModelReplica.options(num_cpus=cfg.scaling.cpus_per_replica, num_gpus=cfg.scaling.gpus_per_replica,
                                 max_restarts=0).remote(rank, n, raw, shards, bounds)
            for rank in range(n)
        ]

    def _launch_shards(self) -> tuple[list, list[tuple[int, int]]]:
        """ParameterShards holding the initial parameters (the same factory and seed as every
        replica), cut into balanced slices of the flat vector."""
        import torch

        from actors.shard import create_shards
        from orchestrator.factory import build_model
        from policies.sharding import shard_bounds

        cfg = self.cfg
        model = build_model(cfg.model.factory, cfg.model.kwargs, cfg.data.seed)
        initial = torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad]).numpy()
        bounds = shard_bounds(initial.size, cfg.scaling.shards)
        opt = cfg.optimizer
        server_opt = opt.name if cfg.strategy.mode == "downpour" else "sgd"  # easgd shards only hold the center
        self.shards = create_shards(initial, bounds, server_opt, opt.lr, opt.momentum, opt.weight_decay,
                                    cfg.scaling.replicas)
        return self.shards, bounds

    def _start(self) -> None:
        from actors.partition_server import PartitionServer

        if not self.replicas:
            self.launch()
        cfg, n = self.cfg, self.cfg.scaling.replicas
        parts = partition(self.dataset.train, cfg.data.partitions or 4 * n, cfg.data.seed)
        refs = [ray.put({"x": p.x, "y": p.y, "ids": p.ids}) for p in parts]  # each partition put once
        rows = [len(p) for p in parts]
        pinned = cfg.strategy.mode == "allreduce"  # its partitions are each replica's own: one grant call
        bs = cfg.data.batch_size
        self.steps_per_epoch = -(-sum(-(-r // bs) for r in rows) // n)  # the display's estimate
        self._plan = (rows, n, cfg.data.seed, pinned, cfg.data.shuffle)
        self.server = PartitionServer.remote(*self._plan)
        self.partition_refs = refs
        timeout = cfg.strategy.timeout_s
        if cfg.strategy.mode == "allreduce":
            addr, port = self._get(self.replicas[0].rendezvous_address.remote(), "rendezvous", timeout + 60)
            self._get([r.join_group.remote(addr, port, timeout) for r in self.replicas], "process group", timeout + 60)
        self.test_ref = ray.put({"x": self.dataset.test.x, "y": self.dataset.test.y})
        slices = eval_slices(len(self.dataset.test), n)
        self._get([r.set_data.remote(self.server, [refs], [self.test_ref], slices[k]) for k, r in enumerate(self.replicas)],
                  "data", timeout)
        self.alive = dict(enumerate(self.replicas))
        self.totals.startup_s = time.perf_counter() - self.t0
        self._train_started = time.perf_counter()
        self.tracker.event("started", self.t0, replicas=n, steps_per_epoch=self.steps_per_epoch,
                           partitions=len(parts), rows_per_partition=[min(rows), max(rows)],
                           startup_s=round(self.totals.startup_s, 3))
        self._say(f"started {n} replicas ({len(parts)} partitions, ~{self.steps_per_epoch} steps/epoch per replica) "
                  f"in {self.totals.startup_s:.1f}s")

    # ---- RUNNING: one epoch, evaluation, logging, the stop decision ------------------------
    def _serve_epoch(self, epoch: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Run the epoch on the live replicas until the PartitionServer has served every
        partition once. In downpour / async easgd a replica that dies is dropped: its leases go
        back to the pool and the survivors finish them (reported as redone).

        The epoch's first grants are computed here (the same pure plan the server follows) and
        go to the replicas with their epoch call; the server call that starts the epoch, sent
        right after, also reports the last epoch's final completions (the server checks that
        epoch was served whole) and is only checked once the replicas are done. An epoch with a
        death reports its completions at once and reads the server's status (redone partitions,
        a second pass if any are left)."""
        cfg = self.cfg
        ranks = sorted(self.alive)
        first = first_grant_messages(*self._plan, epoch, ranks)
        started = None
        stats, progress, lost = [], [], False
        while True:
            streams = {rank: r.run_epoch.remote(epoch, cfg.tracking.log_every_steps, self.trace_ids, first.get(rank))
                       for rank, r in self.alive.items()}
            if first:  # the replicas are on their way; now the server call that starts the epoch
                started = self.server.start_epoch.remote(epoch, ranks, self._unreported)
                self._unreported = {}
            first = {}  # a second pass (after a death) asks the server afresh
            finals, rows, dead = self._drain(streams, epoch)
            if started is not None:
                self._get(started, f"partition server, start of epoch {epoch}", CONTROL_CALL_TIMEOUT_S)
                started = None
            stats += finals
            progress += rows
            completed = {s["rank"]: s["unreported"] for s in finals}
            if not dead and not lost:  # reported when the next epoch starts, or by finish_epochs
                self._unreported = completed
                return merge_epoch_stats(stats), progress
            for rank in dead:
                self._lose_replica(rank, epoch)
            lost = True
            status = self._get(self.server.finish.remote(completed), "partition server", CONTROL_CALL_TIMEOUT_S)
            if status["complete"]:
                self.redone += status["redone"]
                return merge_epoch_stats(stats), progress
            if not dead:
                raise TrainingError(f"epoch {epoch}: {status['remaining']} partitions were never served")

    def finish_epochs(self) -> dict[str, Any]:
        """Report the last epoch's final completions; the server's status, which must say the
        epoch was served whole."""
        status = self._get(self.server.finish.remote(self._unreported), "partition server", CONTROL_CALL_TIMEOUT_S)
        self._unreported = {}
        if not status["complete"]:
            raise TrainingError(f"epoch {status['epoch']}: {status['remaining']} partitions were never served")
        return status

    def _lose_replica(self, rank: int, epoch: int) -> None:
        cfg = self.cfg
        tolerant = cfg.strategy.mode == "downpour" or (cfg.strategy.mode == "easgd" and cfg.strategy.variant == "async")
        survivors = sorted(r for r in self.alive if r != rank)
        if not tolerant or not survivors:
            raise TrainingError(f"replica {rank} died in epoch {epoch} ({cfg.strategy.mode} cannot continue without it)")
        del self.alive[rank]
        back = self._get(self.server.release.remote(rank, survivors), "partition server", CONTROL_CALL_TIMEOUT_S)
        if self.shards:  # the slowest-replica clock (SSP) must not wait for the dead
            self._get(self.shards[0].forget_replica.remote(rank), "shard", CONTROL_CALL_TIMEOUT_S)
        slices = eval_slices(len(self.dataset.test), len(survivors))
        self._get([self.alive[r].set_test_slice.remote([self.test_ref], slices[k]) for k, r in enumerate(survivors)],
                  "test slices", CONTROL_CALL_TIMEOUT_S)
        self.tracker.event("replica_lost", self.t0, rank=rank, epoch=epoch, partitions_served_again=back,
                           survivors=survivors)
        self._say(f"replica {rank} died in epoch {epoch}; its partitions {back} go to replicas {survivors}")

    def _run_epoch(self) -> bool:
        cfg, tot = self.cfg, self.totals
        epoch = tot.epochs + 1
        t_epoch = time.perf_counter()
        stats, progress = self._serve_epoch(epoch)
        evals = [s["eval"] for s in stats]
        if needs_shards(cfg.strategy.mode):  # evaluate the reference (server copy / center) once all are done
            evals = self._get([r.evaluate_reference.remote() for r in self.alive.values()], "evaluation",
                              cfg.strategy.timeout_s)
        correct, loss_sum, rows = map(sum, zip(*evals))
        acc, test_loss = correct / rows, loss_sum / rows

        tot.epochs = epoch
        tot.steps += max(s["steps"] for s in stats)
        tot.samples += sum(s["samples"] for s in stats)
        tot.rows_per_epoch.append(sum(s["samples"] for s in stats))
        tot.train_s += max(s["train_s"] for s in stats)
        tot.comm_s += max(s["comm_s"] for s in stats)
        tot.train_loss = stats[0]["loss"]
        tot.test_accuracy, tot.test_loss = acc, test_loss
        if self.trace_ids:
            self.consumed.append({s["rank"]: s["consumed"] for s in stats})
        elapsed = time.perf_counter() - self.t0
        target = cfg.stop.target_accuracy
        if target is not None and tot.time_to_target_s is None and acc >= target:
            tot.time_to_target_s = elapsed
            self.tracker.event("target_reached", self.t0, epoch=epoch, test_accuracy=acc, target=target)

        rows_out = [(key, p[name], p["step"]) for p in progress
                    for key, name in (("train_loss", "loss"), ("samples_per_s", "samples_per_s"))]
        rows_out += [("test_accuracy", acc, tot.steps), ("test_loss", test_loss, tot.steps), ("epoch", epoch, tot.steps),
                     ("comm_share", tot.comm_s / max(tot.train_s, 1e-9), tot.steps)]
        extra = mode_metrics(cfg.strategy.mode, stats)
        if cfg.strategy.mode == "downpour":  # the lead over the slowest replica, as the shard saw the pushes
            extra["max_lead"] = self._get(self.shards[0].observed_max_lead.remote(), "shard", CONTROL_CALL_TIMEOUT_S)
        rows_out += [(k, v, tot.steps) for k, v in extra.items()]
        rows_out.append(("epoch_rows", tot.rows_per_epoch[-1], tot.steps))
        self.tracker.log_metrics(rows_out)
        tot.epoch_wall_s += time.perf_counter() - t_epoch
        self.tracker.event("epoch_end", self.t0, epoch=epoch, step=tot.steps, test_accuracy=round(acc, 4),
                           test_loss=round(test_loss, 4), train_loss=round(tot.train_loss, 4),
                           train_s_by_rank=[round(s["train_s"], 3) for s in stats],
                           steps_by_rank=[s["steps"] for s in stats], rows=tot.rows_per_epoch[-1],
                           **{k: round(v, 4) for k, v in extra.items()})
        self._say(f"epoch {epoch}: test_accuracy {acc:.4f}  test_loss {test_loss:.4f}  "
                  f"train_loss {tot.train_loss:.4f}  ({elapsed:.1f}s)")

        every = cfg.checkpoint.every_epochs
        if every and epoch % every == 0:
            tot.checkpoint = self.checkpoint(f"epoch_{epoch:04d}.pt", CONTROL_CALL_TIMEOUT_S)
        decision = self.stop_policy.decide(EpochSnapshot(epoch, acc, time.perf_counter() - self._train_started))
        if decision.stop:
            tot.stop_reason = decision.reason
            self.tracker.event("stop", self.t0, reason=decision.reason)
        return decision.stop

    def _drain(self, streams: dict[int, Any], epoch: int):
        """Read every replica's epoch stream to its end. Returns (epoch totals, rank 0's progress
        rows, ranks that died). No word from any replica for strategy.timeout_s is a
        TrainingError: never a hang."""
        timeout = self.cfg.strategy.timeout_s
        finals: list[dict[str, Any]] = []
        progress: list[dict[str, Any]] = []
        dead: list[int] = []
        active = dict(streams)
        first = min(streams)
        while active:
            ready, _ = ray.wait(list(active.values()), num_returns=1, timeout=timeout)
            if not ready:
                raise TrainingError(f"no progress from any replica for {timeout:.0f}s in epoch {epoch} (strategy.timeout_s)")
            for rank, stream in list(active.items()):
                if stream not in ready:
                    continue
                try:
                    item = ray.get(next(stream), timeout=timeout)
                except StopIteration:
                    del active[rank]
                    continue
                except ray.exceptions.RayActorError:
                    dead.append(rank)
                    del active[rank]
                    if self.shards:  # at once: the survivors' slowest-replica clock (SSP) must not wait for it
                        self.shards[0].forget_replica.remote(rank)
                    continue
                except ray.exceptions.RayTaskError as exc:
                    raise TrainingError(f"replica {rank} epoch {epoch}: {exc.cause if hasattr(exc, 'cause') else exc}") from None
                if item["kind"] == "epoch":
                    finals.append(item)
                rows = item["progress"] if item["kind"] == "epoch" else item["rows"]
                if rows:
                    self.progress[rank] = rows[-1]["step"]
                if rank == first and rows:
                    progress += rows
                    if self.display is not None:
                        last = rows[-1]
                        self.display.steps(epoch, last["step_in_epoch"], last["loss"], self.steps_per_epoch)
        return finals, progress, dead

    # ---- FINISHING: final checkpoint and artifacts -----------------------------------------
    def _finish(self) -> None:
        self.finish_epochs()
        self.totals.checkpoint = self.checkpoint("model.pt", CONTROL_CALL_TIMEOUT_S)
        with tempfile.TemporaryDirectory() as tmp:
            import torch

            path = os.path.join(tmp, "model.pt")
            torch.save(self._last_state["model"], path)
            self.tracker.log_file(path)

    def checkpoint(self, name: str, timeout_s: float) -> str:
        """Rank 0's model and optimizer state (all replicas hold the same parameters) plus the
        run's position, written to checkpoint.storage/<mlflow run id>/<name>."""
        state = self._get(next(iter(self.alive.values())).state.remote(), f"checkpoint {name}", timeout_s)
        state.update(epoch=self.totals.epochs, mlflow_run_id=self.tracker.run_id,
                     config=self.cfg.model_dump(mode="json"))
        path = save_checkpoint(self.cfg.checkpoint.storage, self.tracker.run_id, name, state)
        self._last_state = state
        self.tracker.event("checkpoint", self.t0, path=path, epoch=self.totals.epochs)
        return path

    def shutdown(self) -> None:
        """Stop every actor this controller started (replicas and shards)."""
        for r in self.replicas + self.shards + ([self.server] if self.server is not None else []):
            try:
                ray.kill(r, no_restart=True)
            except Exception:
                pass
        self.replicas, self.shards, self.server = [], [], None

    # ---- helpers ---------------------------------------------------------------------------
    def _get(self, refs, what: str, timeout: float):
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TrainingError(f"{what}: no answer within {timeout:.0f}s") from None
        except ray.exceptions.RayActorError as exc:
            raise TrainingError(f"{what}: a replica died ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
        except ray.exceptions.RayTaskError as exc:
            raise TrainingError(f"{what}: {exc.cause if hasattr(exc, 'cause') else exc}") from None

    def _say(self, text: str) -> None:
        if self.display is not None:
            self.display.line(text)
