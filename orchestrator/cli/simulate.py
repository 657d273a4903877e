"""`python -m orchestrator simulate CONFIG`: the cost model (policies/decisions/cost_model.py) calibrated on
this machine or from a finished run, predicting steps/s and samples/s per mode up to thousands
of replicas; a table on stdout and a plot.

Calibration (`calibrate`), about 10 s:
- compute: the config's model and optimizer take `STEPS` steps on one real batch of the job's
  data (data.batch_size rows) in this process, with the threads one replica gets
  (scaling.cpus_per_replica); the median step is t;
- link: two processes on this host time a gloo all-reduce of a 4-byte message and of a quarter
  and the whole of the model's size or 1 MiB, whichever is larger (`LINK_REPEATS` each, medians);
  alpha and beta are fitted (cost_model.fit_link).
  That is the loopback link; `--bandwidth-gbps` / `--latency-us` model another one.
`--from-run RUN`: the run's own progress rows (its samples_per_s at the run's batch: a step is
batch / samples_per_s, of which the run's comm_share is communication). A 1-replica run gives t;
a run of n > 1 replicas gives the cores its hosts ran at full speed instead (n x t here / its
step compute: what sharing the hosts did to the step, `--cores` unless given), t staying the
step measured here alone; a run whose step compute was no slower than t gives n cores and its
own step as t (its replicas had cores of their own; a busy host here must not slow the model of
that run). Either way the model gives the run's own step back at its n. For allreduce at n > 1 the link comes from its communication: alpha and
beta as calibrated here, both scaled so the ring all-reduce at n takes the run's communication
time (with `--latency-us` given, beta is what the run's time leaves after the latency), the
run's time first divided by n / cores when n exceeds the cores (the model stretches
communication on shared cores as it does compute). For
downpour and easgd the shards' path (Ray calls and the object store, not gloo) comes from theirs
(alpha as calibrated, or given).
`--shard-path here`: without such a run, the shards' path is timed with real shards on Ray
(`calibrate_shard_path`); by default (`link`) the shards' exchanges cost what the link's do.
`--cores here`: this host's effective cores from the calibration steps run in as many processes
at once as it has CPUs (`calibrate_cores`).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from typing import Any, Optional

from orchestrator.errors import ConfigError
from policies.decisions.cost_model import (Calibration, ModeShape, Prediction, Stragglers, ring_allreduce_s,
                                 table)

from orchestrator.cli.calibration import allreduce_bytes_per_param, calibration

PLOT_NAME = "simulate.png"


def render(preds: list[Prediction], cal: Calibration, s: Stragglers) -> str:
    """The table as text (one row per mode and replica count)."""
    lines = [f"model: {cal.params:,} trainable parameters ({cal.model_bytes / 1e6:.2f} MB), batch {cal.batch} per "
             f"replica; step compute {cal.compute_s * 1e3:.2f} ms; link alpha {cal.alpha_s * 1e6:.1f} us, "
             f"bandwidth {8 / cal.beta_s_per_byte / 1e9 if cal.beta_s_per_byte else math.inf:.2f} Gbit/s"
             + (f"; {cal.cores:g} replicas at full speed" if cal.cores else "")
             + (f"; memory {cal.memory_bytes_per_s / 1e9:.1f} GB/s" if cal.memory_bytes_per_s else ""),
             f"from: {cal.source}",
             f"stragglers: p {s.p:g}, factor {s.factor:g}, jitter {s.jitter:g}{', persistent' if s.persistent else ''}",
             "",
             f"{'mode':<10} {'replicas':>8} {'step ms':>9} {'compute ms':>10} {'comm ms':>9} {'steps/s':>9} "
             f"{'samples/s':>11} {'bound':>8}"]
    for p in preds:
        lines.append(f"{p.mode:<10} {p.replicas:>8} {p.step_s * 1e3:>9.2f} {p.compute_s * 1e3:>10.2f} "
                     f"{p.comm_s * 1e3:>9.3f} {1 / p.step_s:>9.1f} {p.samples_per_s:>11,.0f} {p.bound:>8}")
    return "\n".join(lines)


def plot(preds: list[Prediction], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(p.mode for p in preds):
        rows = [p for p in preds if p.mode == mode]
        if len(rows) == 1:
            ax.axhline(rows[0].samples_per_s, linestyle=":", color="grey", label=f"{mode} (1 replica)")
        else:
            ax.plot([p.replicas for p in rows], [p.samples_per_s for p in rows], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("replicas")
    ax.set_ylabel("predicted samples/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def simulate(cfg: Any, replicas: list[int], stragglers: Stragglers, run: Optional[dict[str, Any]] = None,
             bandwidth_gbps: Optional[float] = None, latency_us: Optional[float] = None,
             cores: "float | str | None" = None, period: Optional[int] = None,
             shard_path: str = "link") -> tuple[Calibration, list[Prediction]]:
    cal = calibration(cfg, run, bandwidth_gbps, latency_us, cores, shard_path)
    st = cfg.strategy
    if st.compression != "none":  # allreduce's gradients travel in half precision, or as low-rank factors
        cal = replace(cal, allreduce_bytes_per_param=allreduce_bytes_per_param(cfg),
                      source=f"{cal.source}; all-reduce in {st.compression}")
    from orchestrator.models import build_model
    from policies.rules.fsdp import shard_units

    model = build_model(cfg.model.factory, cfg.model.kwargs, cfg.data.seed)
    units = len(shard_units(model)) + any(True for _ in model.parameters(recurse=False))  # the root's own, if any
    shape = ModeShape(period=period or st.period, tau=period or st.tau, shards=cfg.scaling.shards, n_push=st.n_push,
                      n_fetch=st.n_fetch,
                      backups=max([p["backup_replicas"] for p in st.plan() if p["mode"] == "allreduce"] or [0]) or 1,
                      units=units, node_replicas=node_replicas(cfg), history=st.history_size)
    return cal, table(replicas, cal, stragglers, shape)


def node_replicas(cfg: Any) -> int:
    """hogwild's direct writers: the replicas one node like this host holds beside the shard
    (its CPUs over scaling.cpus_per_replica); the rest reach the shard over the link."""
    return max(1, int((os.cpu_count() or 1) / max(cfg.scaling.cpus_per_replica, 1e-9)))


def parse_replicas(text: str) -> list[int]:
    try:
        out = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ConfigError(f"--replicas must be a comma-separated list of integers, got {text!r}") from None
    if not out or out[0] < 1:
        raise ConfigError(f"--replicas must list counts >= 1, got {text!r}")
    return out


def write_json(path: str, cal: Calibration, preds: list[Prediction], s: Stragglers) -> None:
    from dataclasses import asdict

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"calibration": asdict(cal), "stragglers": asdict(s), "ring_allreduce_s_at_2": ring_allreduce_s(cal, 2),
                   "predictions": [p.row() for p in preds]}, f, indent=2)
