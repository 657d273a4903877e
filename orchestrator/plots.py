"""The run's picture: `training.png`, drawn from its events alone (the list events.jsonl holds).

The run's headline metric (the `started` event's `metric`: stop.target's metric, else the
task's primary one, e.g. test accuracy) and train loss (each `epoch_end` event) against seconds since the run started
(every event's `t`), with a vertical mark where a replica failed, was replaced or dropped, the
run changed its mode, or the replica group was resized. A pure function of the events, so it is
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
    the `started` event names; left axis) and train loss (right axis) at each epoch's end, one
    vertical line per failure, replacement, drop, mode switch and resize. Returns the marks
    drawn (kind -> seconds)."""
    import matplotlib

    matplotlib.use("Agg", force=False)  # no display needed; a caller's own backend is kept if set
    from matplotlib.figure import Figure

    epochs = [e for e in events if e.get("kind") == "epoch_end" and e.get("t") is not None]
    t = [float(e["t"]) for e in epochs]
    fig = Figure(figsize=(8, 4.5), dpi=100)  # not pyplot: no global figure state, safe in any thread
    acc_ax = fig.add_subplot()
    loss_ax = acc_ax.twinx()
    metric = metric or headline(events)
    label = metric.replace("_", " ")
    acc_ax.plot(t, [e.get(metric, float("nan")) for e in epochs], "o-", color="tab:blue", label=label)
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
    fig.tight_layout()
    fig.savefig(path, format="png")
    return marks


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
