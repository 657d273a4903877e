"""The run's picture: `training.png`, drawn from its events alone (the list events.jsonl holds).

The run's headline metric (the `started` event's `metric`: stop.target's metric, else the
task's primary one, e.g. test accuracy) and train loss (each `epoch_end` event) against seconds since the run started
(every event's `t`), with a vertical mark where a replica failed, was replaced or dropped, the
run changed its mode, or the replica group was resized. When the epochs carry per-step
measurements (`step_figures`: allreduce), a second panel shows each replica's milliseconds per
step split into compute, communication and waiting, and the gradient diversity. With
optimizer.schedule, a last panel shows the learning rate by optimizer step (`lr_by_step`). A pure function of the events, so it is
tested without Ray and redrawn from any run's events.jsonl.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Iterable, Optional

PLOT_NAME = "training.png"

# event kind -> (colour, line style, legend label) of its vertical mark
MARKS: dict[str, tuple[str, str, str]] = {
    "replica_failed": ("tab:red", "-", "replica failed"),
    "replica_replaced": ("tab:green", "--", "replica replaced"),
    "replica_dropped": ("tab:brown", "--", "replica dropped"),
    "mode_switch": ("tab:purple", "-.", "mode switch"),
    "resize": ("tab:gray", ":", "resize"),
}


def mark_times(events: Iterable[dict[str, Any]]) -> dict[str, list[float]]:
    """kind -> the seconds (`t`) of each event that gets a vertical mark, in order."""
    marks: dict[str, list[float]] = {}
    for ev in events:
        if ev.get("kind") in MARKS and ev.get("t") is not None:
            marks.setdefault(ev["kind"], []).append(float(ev["t"]))
    return marks


def headline(events: list[dict[str, Any]]) -> str:
    """The metric the run is judged by, as its `started` event says (test_accuracy for a run
    recorded before metrics were named there)."""
    started = next((e for e in events if e.get("kind") == "started"), {})
    return str(started.get("metric") or "test_accuracy")


def training_plot(events: list[dict[str, Any]], path: str, metric: Optional[str] = None) -> dict[str, list[float]]:
    """Draw the run's `events` to the PNG file `path`: the headline `metric` (default: the one
    the `started` event names; left axis; at each epoch's end and each `evaluation` of
    eval.every_steps) and train loss (right axis) at each epoch's end, one
    vertical line per failure, replacement, drop, mode switch and resize. Returns the marks
    drawn (kind -> seconds)."""
    import matplotlib

    matplotlib.use("Agg", force=False)  # no display needed; a caller's own backend is kept if set
    from matplotlib.figure import Figure

    epochs = [e for e in events if e.get("kind") == "epoch_end" and e.get("t") is not None]
    t = [float(e["t"]) for e in epochs]
    timed = [e for e in epochs if e.get("step_figures")]
    rates = [pair for e in epochs for pair in e.get("lr_by_step") or []]  # optimizer.schedule's rate by step
    panels = 1 + bool(timed) + bool(rates)
    fig = Figure(figsize=(8, 4.5 + 3.5 * (panels - 1)), dpi=100)  # not pyplot: no global figure state, safe in any thread
    acc_ax = fig.add_subplot(panels, 1, 1)
    loss_ax = acc_ax.twinx()
    metric = metric or headline(events)
    label = metric.replace("_", " ")
    judged = sorted((e for e in events if e.get("kind") in ("epoch_end", "evaluation") and e.get("t") is not None),
                    key=lambda e: float(e["t"]))  # eval.every_steps: the evaluations between epoch ends too
    acc_ax.plot([float(e["t"]) for e in judged], [e.get(metric, float("nan")) for e in judged], "o-", color="tab:blue",
                label=label)
    loss_ax.plot(t, [e.get("train_loss", float("nan")) for e in epochs], "s-", color="tab:orange",
                 label="train loss")
    acc_ax.set_xlabel("seconds since the run started")
    acc_ax.set_ylabel(label, color="tab:blue")
    loss_ax.set_ylabel("train loss", color="tab:orange")
    end = max((float(e["t"]) for e in events if isinstance(e.get("t"), (int, float))), default=0.0)
    acc_ax.set_xlim(0, max(end * 1.02, 1e-3))  # the whole run, start to its last event
    if epochs:
        loss_ax.set_ylim(bottom=0)
    acc_ax.grid(alpha=0.3)
    marks = mark_times(events)
    for kind, times in marks.items():
        colour, style, label = MARKS[kind]
        for i, x in enumerate(times):
            acc_ax.axvline(x, color=colour, linestyle=style, linewidth=1, label=label if i == 0 else None)
    if not epochs:
        acc_ax.text(0.5, 0.5, "no epoch ended", transform=acc_ax.transAxes, ha="center", va="center")
    handles = acc_ax.get_legend_handles_labels()
    more = loss_ax.get_legend_handles_labels()
    acc_ax.legend(handles[0] + more[0], handles[1] + more[1], loc="lower left", bbox_to_anchor=(0, 1.02, 1, 0.2),
                  mode="expand", ncol=4, fontsize="small", frameon=False)  # above the axes: never over a curve
    if timed:
        step_panel(fig.add_subplot(panels, 1, 2), timed)
    if rates:
        lr_ax = fig.add_subplot(panels, 1, panels)
        lr_ax.plot([s for s, _ in rates], [r for _, r in rates], "-", color="tab:green")
        lr_ax.set_xlabel("optimizer step")
        lr_ax.set_ylabel("learning rate")
        lr_ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return marks


def step_panel(ax: Any, epochs: list[dict[str, Any]]) -> None:
    """Each epoch's milliseconds per step, per replica: compute, communication and waiting
    stacked (one bar per replica, side by side), and the gradient diversity on the right axis."""
    ranks = sorted({int(r) for e in epochs for r in e["step_figures"]})
    width = 0.8 / max(len(ranks), 1)
    parts = (("compute_s", "tab:blue", "compute"), ("comm_s", "tab:green", "communication"),
             ("wait_s", "tab:red", "waiting"))
    for j, rank in enumerate(ranks):
        xs = [i + (j - (len(ranks) - 1) / 2) * width for i in range(len(epochs))]
        bottom = [0.0] * len(epochs)
        for key, colour, label in parts:
            ms = [1e3 * (e["step_figures"].get(str(rank), {}).get(key) or 0.0) for e in epochs]
            ax.bar(xs, ms, width * 0.9, bottom=bottom, color=colour, label=label if j == 0 else None,
                   edgecolor="white", linewidth=0.3)
            bottom = [b + m for b, m in zip(bottom, ms)]
    ax.set_xticks(range(len(epochs)), [str(e.get("epoch", i + 1)) for i, e in enumerate(epochs)])
    ax.set_xlabel(f"epoch (one bar per replica: {', '.join(str(r) for r in ranks)})")
    ax.set_ylabel("ms per step")
    handles, labels = ax.get_legend_handles_labels()
    diversity = [e.get("gradient_diversity") for e in epochs]
    if any(d is not None for d in diversity):
        div_ax = ax.twinx()
        div_ax.plot(range(len(epochs)), [float("nan") if d is None else d for d in diversity], "k.-",
                    label="gradient diversity")
        div_ax.set_ylabel("gradient diversity")
        div_ax.set_ylim(bottom=0)
        more = div_ax.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, loc="upper right", fontsize="small", ncol=2)


def log_training_plot(tracker: Any, events: Optional[list[dict[str, Any]]] = None,
                      warn: Callable[[str], None] = lambda line: None, timeout_s: Optional[float] = None) -> None:
    """Draw the tracker's events (or `events`) and log the picture to its MLflow run as
    training.png, waiting up to timeout_s (default: the tracker's file timeout). Never raises:
    a picture that cannot be drawn is reported through `warn`."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, PLOT_NAME)
            training_plot(list(tracker.events if events is None else events), path)
            tracker.log_file(path, **({} if timeout_s is None else {"timeout_s": timeout_s}))
    except Exception as exc:  # the picture is a view of the record, never a reason to lose the run
        warn(f"{PLOT_NAME} not drawn ({type(exc).__name__}: {exc})")
