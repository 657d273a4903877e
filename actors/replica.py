"""ModelReplica: one model copy in a Ray actor. It holds state and moves tensors; the update
rule it runs lives in policies/<mode>.py (a *Worker), the decisions in the driver.

A replica runs a whole epoch on its own (`run_epoch`) and is never called per step; it streams
progress rows back to the driver as a Ray streaming generator while the epoch runs. (A second
concurrency group for polling was tried first: running the step loop off the actor's main
thread cost ~10% of step throughput.)
"""
from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any, Iterator, Optional

import numpy as np
import ray
import torch
import torch.distributed as dist
import torch.nn.functional as F

from actors.partition_server import PartitionReader
from actors.shard import RayShardClient
from orchestrator.factory import build_model, make_optimizer
from policies.allreduce import AllReduceWorker
from policies.downpour import DownpourWorker
from policies.easgd import EasgdWorker, default_alpha
from policies.sharding import FlatParams


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class ProcessGroupReducer:
    """Sums a bucket across replicas with an asynchronous torch.distributed all-reduce, and
    broadcasts rank 0's buffers (the process group's timeout bounds every wait)."""

    def start(self, tensor: torch.Tensor):
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)

    def wait(self, handle) -> None:
        handle.wait()

    def broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=0)


def replica_device(gpus_per_replica: float) -> torch.device:
    """The device a replica trains on: its GPU when it reserved one, else the CPU. A replica
    given GPUs by Ray that torch cannot see is an error, never a silent fall back to the CPU."""
    if gpus_per_replica <= 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"scaling.gpus_per_replica is {gpus_per_replica} but torch sees no CUDA device on "
                           f"node {ray.util.get_node_ip_address()} (torch {torch.__version__})")
    return torch.device("cuda")


@ray.remote
class ModelReplica:
    def __init__(self, rank: int, world_size: int, config: dict[str, Any], shards: Optional[list] = None,
                 bounds: Optional[list[tuple[int, int]]] = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.cfg = config
        torch.set_num_threads(max(1, int(config["scaling"]["cpus_per_replica"])))
        self.device = replica_device(config["scaling"]["gpus_per_replica"])
        self.model = build_model(config["model"]["factory"], config["model"]["kwargs"], config["data"]["seed"]).to(self.device)
        self.flat: Optional[FlatParams] = None
        self.client: Optional[RayShardClient] = None
        self.worker = self._make_worker(config, shards, bounds)
        self.step_delay_s = float(config["faults"]["slow_replicas"].get(rank, 0.0))
        self.step = 0
        self._has_buffers = any(True for _ in self.model.buffers())

    def _make_worker(self, config: dict[str, Any], shards, bounds):
        """The mode's update rule (policies/<mode>.py) wired to this replica's transport."""
        s, opt = config["strategy"], config["optimizer"]
        if s["mode"] == "allreduce":
            optimizer = make_optimizer(opt["name"], self.model.parameters(), opt["lr"], opt["momentum"], opt["weight_decay"])
            return AllReduceWorker(self.model, optimizer, int(s["bucket_mb"] * 2**20), ProcessGroupReducer())
        self.flat = FlatParams(list(self.model.parameters()))
        self.client = RayShardClient(shards, bounds, s["max_in_flight"], s["timeout_s"])
        if s["mode"] == "downpour":
            return DownpourWorker(self.model, self.flat, self.client, self.rank, lr=opt["lr"], n_fetch=s["n_fetch"],
                                  n_push=s["n_push"], max_staleness=s["max_staleness"], staleness_lr=s["staleness_lr"],
                                  warmstart_steps=s["warmstart_steps"], timeout_s=s["timeout_s"])
        if opt["name"] == "sgd":  # EAMSGD when strategy.momentum > 0
            local = torch.optim.SGD(self.model.parameters(), lr=opt["lr"], momentum=s["momentum"],
                                    nesterov=s["momentum"] > 0, weight_decay=opt["weight_decay"])
        else:
            local = make_optimizer(opt["name"], self.model.parameters(), opt["lr"], 0.0, opt["weight_decay"])
        alpha = s["alpha"] if s["alpha"] is not None else default_alpha(self.world_size)
        return EasgdWorker(self.model, self.flat, local, self.client, self.world_size, alpha, s["tau"], s["variant"])

    # ---- process group -------------------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        """Where rank 0 will host the TCP store the process group meets at."""
        return ray.util.get_node_ip_address(), free_port()

    def join_group(self, addr: str, port: int, timeout_s: float) -> int:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{addr}:{port}", rank=self.rank, world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        return self.rank


    # ---- data ----------------------------------------------------------------------------
    def set_data(self, server, train_parts: list, test_part: list, test_slice: tuple[int, int]) -> int:
        """The PartitionServer to lease train partitions from, the train partitions' refs, and
        this replica's slice of the test split (refs wrapped in lists so Ray passes them through
        unresolved)."""
        self.reader = PartitionReader(server, train_parts[0], self.rank, self.cfg["data"]["batch_size"], self.cfg["data"]["shuffle"],
                                      self.device, self.cfg["strategy"]["timeout_s"])
        return self.set_test_slice(test_part, test_slice)

    def set_test_slice(self, test_part: list, test_slice: tuple[int, int]) -> int:
        test = ray.get(test_part[0])
        lo, hi = test_slice
        self.test_x = torch.from_numpy(test["x"][lo:hi].copy())
        self.test_y = torch.from_numpy(test["y"][lo:hi].copy())
        return hi - lo

    # ---- training ------------------------------------------------------------------------
    def run_epoch(self, epoch: int, log_every: int, trace_ids: bool = False,
                  first_grant: Optional[dict] = None) -> Iterator[dict[str, Any]]:
        """Lease partitions and take steps of the mode's rule over every row of them until the
        server has no more for this replica this epoch (lock-step modes: until no replica has a
        batch left, with empty steps meanwhile); then (allreduce) evaluate this replica's test
        slice. A Ray streaming generator: makes a progress row every `log_every` steps (display,
        step metrics, stall check) and sends the rows made so far at most every
        `tracking.progress_interval_s`; yields last the totals with the rows not yet sent (one
        call per epoch, no call per step), and the partitions finished since the last grant
        request (`unreported`) for the controller to report. `first_grant`: the grant this replica
        starts the epoch with. A non-finite loss ends the run (RuntimeError naming the step)."""
        self.model.train()
        consumed, comm_s, steps, samples, loss = [], 0.0, 0, 0, float("nan")
        t_epoch = t_window = t_sent = time.perf_counter()
        window, rows = 0, []
        send_every = float(self.cfg["tracking"]["progress_interval_s"])
        lock_step = self.worker.lock_step
        batches = self.reader.epoch_batches(first_grant)
        following = next(batches, None)
        while following is not None or lock_step:
            current = following
            following = next(batches, None) if current is not None else None  # look ahead one batch
            x, y = (None, None) if current is None else current[:2]
            if self.step_delay_s and current is not None:
                time.sleep(self.step_delay_s)  # faults.slow_replicas: a deliberate straggler
            try:
                result = self.worker.step(x, y, following is not None)
            except FloatingPointError as exc:
                lr = self.cfg["optimizer"]["lr"]
                raise RuntimeError(f"training diverged: {exc} at step {self.step + 1} (epoch {epoch}) with "
                                   f"optimizer.lr {lr:g}; the step was not applied and the last checkpoint is kept; "
                                   "lower optimizer.lr") from None
            comm_s += result.comm_s
            steps += 1
            self.step += 1
            if current is not None:
                samples += len(y)
                window += len(y)
                loss = result.loss
                if trace_ids:
                    consumed.append(current[3]["ids"][current[2].numpy()].tolist())
            if steps % log_every == 0:
                now = time.perf_counter()
                rows.append({"rank": self.rank, "epoch": epoch, "step": self.step, "step_in_epoch": steps,
                             "loss": loss, "samples_per_s": window / (now - t_window)})
                t_window, window = now, 0
                if now - t_sent >= send_every:  # each message to the driver costs the step loop
                    yield {"kind": "progress", "rank": self.rank, "rows": rows}
                    rows, t_sent = [], now
            if lock_step and not result.go_on:
                break
        train_s = time.perf_counter() - t_epoch
        mode_stats = self.worker.end_epoch()  # e.g. waits for this epoch's pushes
        if self.flat is not None and self._has_buffers:  # the reference model's buffers: the replicas' averaged
            self.client.set_buffers(self.rank, self.local_buffers())
        evaluation = self.evaluate() if self.flat is None else None  # sharded modes: see evaluate_reference
        yield {"kind": "epoch", "rank": self.rank, "steps": steps, "samples": samples, "train_s": train_s,
               "comm_s": comm_s, "consumed": consumed, "partitions": list(self.reader.read),
               "unreported": self.reader.unreported, "eval": evaluation,
               "loss": loss, "mode": mode_stats, "progress": rows}

    @torch.inference_mode()
    def evaluate(self) -> tuple[int, float, int]:
        """(correct, summed loss, rows) on this replica's slice of the test split. Batches of
        data.batch_size: small batches stay in cache and run ~2x faster than one big one on CPU."""
        self.model.eval()
        batch = self.cfg["data"]["batch_size"]
        correct, loss_sum = 0, 0.0
        for lo in range(0, len(self.test_y), batch):
            x = self.test_x[lo : lo + batch].to(self.device)
            y = self.test_y[lo : lo + batch].to(self.device)
            out = self.model(x)
            loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
        return correct, loss_sum, len(self.test_y)

    # ---- state ---------------------------------------------------------------------------
    def flat_parameters(self) -> np.ndarray:
        return torch.cat([p.detach().reshape(-1).cpu() for p in self.model.parameters()]).numpy()

    def local_buffers(self) -> dict[str, np.ndarray]:
        """This replica's module buffers (e.g. BatchNorm running statistics) as numpy arrays."""
        return {name: b.detach().cpu().numpy().copy() for name, b in self.model.named_buffers()}

    def evaluate_reference(self) -> tuple[int, float, int]:
        """Sharded modes: evaluate the mode's reference model (Downpour's server copy, EASGD's
        center, with the replicas' buffers averaged) on this replica's test slice, then put the
        local parameters and buffers back."""
        with self._reference_loaded():
            return self.evaluate()

    def state(self) -> dict[str, Any]:
        """The mode's reference model (plus this replica's optimizer) for a checkpoint."""
        with self._reference_loaded():
            model = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        opt = getattr(self.worker, "optimizer", None)
        return {"model": model, "optimizer": opt.state_dict() if opt is not None else None, "step": self.step}

    @contextlib.contextmanager
    def _reference_loaded(self):
        if self.flat is None:  # allreduce: every replica already holds the reference
            yield
            return
        local = self.flat.params.clone()
        local_buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()}
        self.client.pull(self.flat.params)
        reference_buffers = self.client.buffers() if local_buffers else {}
        buffers = dict(self.model.named_buffers())
        for name, value in reference_buffers.items():
            buffers[name].detach().copy_(torch.from_numpy(value))
        try:
            yield
        finally:
            self.flat.params.copy_(local)
            for name, value in local_buffers.items():
                buffers[name].detach().copy_(value)
