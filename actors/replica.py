"""ModelReplica: one model copy in a Ray actor. It holds state and moves tensors; the update
rule it runs lives in policies/ (allreduce_step), the decisions in the driver.

A replica runs a whole epoch on its own (`run_epoch`) and is never called per step; it streams
progress rows back to the driver as a Ray streaming generator while the epoch runs. (A second
concurrency group for polling was tried first: running the step loop off the actor's main
thread cost ~10% of step throughput.)
"""
from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any, Iterator

import numpy as np
import ray
import torch
import torch.distributed as dist
import torch.nn.functional as F

from orchestrator.factory import build_model, make_optimizer
from policies.allreduce import GradientBuckets, allreduce_step, epoch_order


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class ProcessGroupReducer:
    """Sums a bucket across replicas with an asynchronous torch.distributed all-reduce (the
    process group's timeout bounds every wait)."""

    def start(self, tensor: torch.Tensor):
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)

    def wait(self, handle) -> None:
        handle.wait()


@ray.remote
class ModelReplica:
    def __init__(self, rank: int, world_size: int, config: dict[str, Any]) -> None:
        self.rank, self.world_size = rank, world_size
        self.cfg = config
        threads = max(1, int(config["scaling"]["cpus_per_replica"]))
        torch.set_num_threads(threads)
        self.device = torch.device("cuda" if config["scaling"]["gpus_per_replica"] > 0 and torch.cuda.is_available() else "cpu")
        self.model = build_model(config["model"]["factory"], config["model"]["kwargs"], config["data"]["seed"]).to(self.device)
        opt = config["optimizer"]
        self.optimizer = make_optimizer(opt["name"], self.model.parameters(), opt["lr"], opt["momentum"], opt["weight_decay"])
        bucket_bytes = int(config["strategy"]["bucket_mb"] * 2**20)
        self.buckets = GradientBuckets.attach([p for p in self.model.parameters() if p.requires_grad], bucket_bytes)
        self.reducer = ProcessGroupReducer()
        self.step = 0

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
    def load_data(self, train_parts: list, test_part: list, test_slice: tuple[int, int]) -> int:
        """Read this replica's partitions from the object store (refs wrapped in lists so Ray
        passes them through unresolved) and keep them as tensors; returns rows held."""
        parts = ray.get(train_parts)
        self.x = torch.from_numpy(np.concatenate([p["x"] for p in parts]))
        self.y = torch.from_numpy(np.concatenate([p["y"] for p in parts]))
        self.ids = np.concatenate([p["ids"] for p in parts])
        test = ray.get(test_part[0])
        lo, hi = test_slice
        self.test_x = torch.from_numpy(test["x"][lo:hi].copy())
        self.test_y = torch.from_numpy(test["y"][lo:hi].copy())
        return len(self.y)

    # ---- training ------------------------------------------------------------------------
    def run_epoch(self, epoch: int, steps: int, log_every: int, trace_ids: bool = False) -> Iterator[dict[str, Any]]:
        """Take `steps` synchronous steps over this replica's rows in this epoch's order, then
        evaluate this replica's slice of the test split. A Ray streaming generator: yields a
        progress row every `log_every` steps (the driver's display, step metrics and stall
        check), and last the epoch's totals with the evaluation (one call per epoch)."""
        self.model.train()
        bs = self.cfg["data"]["batch_size"]
        order = torch.from_numpy(epoch_order(len(self.y), self.cfg["data"]["seed"], epoch, self.rank))
        consumed, comm_s = [], 0.0
        t_epoch = t_window = time.perf_counter()
        for i in range(steps):
            idx = order[i * bs : (i + 1) * bs]
            x, y = self.x[idx].to(self.device, non_blocking=True), self.y[idx].to(self.device, non_blocking=True)
            loss, c = allreduce_step(self.model, self.optimizer, self.buckets, x, y, self.world_size, self.reducer)
            comm_s += c
            self.step += 1
            if trace_ids:
                consumed.append(self.ids[idx.numpy()].tolist())
            if (i + 1) % log_every == 0 or i + 1 == steps:
                now = time.perf_counter()
                n_steps = (i + 1) % log_every or log_every
                yield {"kind": "progress", "rank": self.rank, "epoch": epoch, "step": self.step, "step_in_epoch": i + 1,
                       "loss": loss, "samples_per_s": n_steps * bs * self.world_size / (now - t_window)}
                t_window = now
        train_s = time.perf_counter() - t_epoch
        yield {"kind": "epoch", "rank": self.rank, "steps": steps, "samples": steps * bs, "train_s": train_s,
               "comm_s": comm_s, "consumed": consumed, "eval": self.evaluate(), "loss": loss}

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

    def state(self) -> dict[str, Any]:
        """Model and optimizer state for a checkpoint (tensors on CPU)."""
        to_cpu = lambda sd: {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in sd.items()}
        return {"model": to_cpu(self.model.state_dict()), "optimizer": self.optimizer.state_dict(), "step": self.step}

    def leave_group(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def pid(self) -> int:
        return os.getpid()
