"""training.png from a run's events: a real PNG (real matplotlib), with the accuracy and loss
curves and one vertical mark per failure, replacement, drop, mode switch and resize."""
from __future__ import annotations

import matplotlib.image

from orchestrator.reporting.plots import log_training_plot, mark_times, training_plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_events() -> list[dict]:
    return [
        {"t": 0.8, "kind": "started", "replicas": 2},
        {"t": 2.0, "kind": "epoch_end", "epoch": 1, "test_accuracy": 0.61, "train_loss": 1.2},
        {"t": 2.5, "kind": "replica_failed", "rank": 1, "cause": "died"},
        {"t": 2.9, "kind": "replica_replaced", "rank": 1},
        {"t": 3.6, "kind": "epoch_end", "epoch": 2, "test_accuracy": 0.83, "train_loss": 0.6},
        {"t": 4.1, "kind": "mode_switch", "from": "allreduce", "to": "downpour"},
        {"t": 4.4, "kind": "resize", "old": 2, "new": 3},
        {"t": 4.6, "kind": "replica_failed", "rank": 0, "cause": "raised"},
        {"t": 4.7, "kind": "replica_dropped", "rank": 0},
        {"t": 5.2, "kind": "epoch_end", "epoch": 3, "test_accuracy": 0.95, "train_loss": 0.2},
        {"t": 5.3, "kind": "checkpoint", "path": "x"},
        {"t": 5.4, "kind": "finished"},
    ]


def test_the_plot_is_a_png_with_a_mark_per_event(tmp_path):
    path = tmp_path / "training.png"
    marks = training_plot(run_events(), str(path))
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert matplotlib.image.imread(str(path)).shape[:2] == (450, 800)  # 8x4.5 in at 100 dpi
    assert marks == {"replica_failed": [2.5, 4.6], "replica_replaced": [2.9], "replica_dropped": [4.7],
                     "mode_switch": [4.1], "resize": [4.4]}


def test_the_marks_and_curves_are_on_the_axes(tmp_path, monkeypatch):
    """Read the figure the function draws: the vertical lines sit at the events' seconds, the
    curves go through each epoch's accuracy and loss."""
    from matplotlib.figure import Figure

    figures = []
    real_savefig = Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    training_plot(run_events(), str(tmp_path / "training.png"))
    acc_ax, loss_ax = figures[0].axes
    vertical = sorted(line.get_xdata()[0] for line in acc_ax.lines  # axvline: x twice, y 0 -> 1 in axes units
                      if list(line.get_ydata()) == [0, 1] and len(set(line.get_xdata())) == 1)
    assert vertical == [2.5, 2.9, 4.1, 4.4, 4.6, 4.7]
    [accuracy] = [line for line in acc_ax.lines if line.get_label() == "test accuracy"]
    assert list(accuracy.get_xdata()) == [2.0, 3.6, 5.2] and list(accuracy.get_ydata()) == [0.61, 0.83, 0.95]
    [loss] = loss_ax.lines
    assert list(loss.get_ydata()) == [1.2, 0.6, 0.2]
    legend = [t.get_text() for t in acc_ax.get_legend().get_texts()]
    assert {"replica failed", "replica replaced", "replica dropped", "mode switch", "resize", "test accuracy",
            "train loss"} == set(legend) and len(legend) == 7  # one legend entry per kind


def test_a_run_without_epochs_still_gets_a_picture(tmp_path):
    path = tmp_path / "training.png"
    assert training_plot([{"t": 0.5, "kind": "started"}, {"t": 0.9, "kind": "replica_failed"}], str(path)) == {
        "replica_failed": [0.9]}
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_mark_times_ignores_other_kinds_and_events_without_a_time():
    assert mark_times([{"kind": "resize"}, {"t": 1, "kind": "checkpoint"}, {"t": 2, "kind": "resize"}]) == {
        "resize": [2.0]}


class FileTracker:
    def __init__(self, events):
        self.events, self.logged = events, []

    def log_file(self, path, timeout_s=None):
        self.logged.append(open(path, "rb").read())


def test_log_training_plot_hands_the_png_to_the_tracker_and_never_raises():
    tracker = FileTracker(run_events())
    log_training_plot(tracker)
    assert len(tracker.logged) == 1 and tracker.logged[0][:8] == PNG_MAGIC
    said = []
    log_training_plot(FileTracker([{"t": "soon", "kind": "epoch_end"}]), warn=said.append)
    assert len(said) == 1 and said[0].startswith("training.png not drawn")


def test_a_scheduled_rate_gets_its_own_panel_by_optimizer_step(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    figures = []
    real_savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), real_savefig(fig, *a, **k)))
    events = run_events()
    events[1]["lr_by_step"] = [[1, 0.001], [5, 0.005]]
    events[4]["lr_by_step"] = [[10, 0.004]]
    path = tmp_path / "training.png"
    training_plot(events, str(path))
    lr_ax = figures[0].axes[-1]
    assert lr_ax.get_ylabel() == "learning rate"
    [line] = lr_ax.lines
    assert list(line.get_xdata()) == [1, 5, 10] and list(line.get_ydata()) == [0.001, 0.005, 0.004]
    assert matplotlib.image.imread(str(path)).shape[:2] == (800, 800)
