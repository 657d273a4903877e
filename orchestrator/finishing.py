"""Finishing (the controller's last state): what a run leaves behind once it stops."""
from __future__ import annotations

import os
import tempfile
import time
from typing import TYPE_CHECKING, Any

from orchestrator import switching
from orchestrator.epoch import report_shard_events

if TYPE_CHECKING:
    from orchestrator.controller import Controller


def finish(ctl: "Controller") -> None:
    """Finishing: the last phase's record, the shards' settled events, the epoch ledger closed,
    the test split (with a validation split), the final checkpoint, model.pt and the MLflow
    model (the best epoch's with checkpoint.keep_best)."""
    if ctl.phases:
        ctl.phases[-1].update(end_step=max(ctl.progress.values(), default=0),
                               end_s=round(time.perf_counter() - ctl.train_started, 3),
                               ended_by="stop", **{f"{ctl.metric}_at_end": round(ctl.headline_value(ctl.totals.metrics), 4)})
    if ctl.shard_group is not None:  # a rebuild still waiting for replay is reported as it stands
        report_shard_events(ctl, ctl.shard_group.settle_all(), ctl.totals.epochs)
    ctl.finish_epochs()
    if ctl.cfg.validated:
        evaluate_test(ctl)
    ctl.totals.checkpoint = ctl.checkpoint("final", ctl.cfg.strategy.timeout_s, named="model.pt").path
    with tempfile.TemporaryDirectory() as tmp:
        import torch

        path = os.path.join(tmp, "model.pt")
        torch.save(ctl.last_state["model"], path)
        ctl.report.tracker.log_file(path)
    from orchestrator.final_model import log_trained_model

    model, which = ctl.last_state["model"], "final"
    if ctl.cfg.checkpoint.keep_best and ctl.best.best is not None:
        model, which = best_state_model(ctl), f"best (epoch {ctl.best.best_epoch})"
    seconds = log_trained_model(ctl.report.tracker, ctl.cfg, ctl.dataset, model)
    if seconds is not None:
        ctl.report.event("model_logged", name="model", seconds=round(seconds, 3), model=which)


def evaluate_test(ctl: "Controller") -> None:
    """data.val_fraction: the test split, evaluated once, on the final model (the mode's
    reference in sharded modes); its test_* metrics join the last validation figures in
    `final`, go to MLflow at the last step and in a `test_evaluated` event."""
    ctl.reslice_tests("test")
    test = switching.evaluate(ctl, "test")
    ctl.totals.metrics = {**ctl.totals.metrics, **test}
    ctl.report.metrics([(k, v, ctl.totals.steps) for k, v in test.items()])
    ctl.report.event("test_evaluated", epoch=ctl.totals.epochs, step=ctl.totals.steps,
                      **{k: round(v, 6) for k, v in test.items()})
    ctl.report.say("test split: " + "  ".join(f"{k} {v:.4f}" for k, v in test.items()))


def best_state_model(ctl: "Controller") -> dict[str, Any]:
    """checkpoint.keep_best: the best epoch's model, held since it was checkpointed, or (a
    resumed run) read back from best.pt."""
    if ctl.best_model is None:
        from orchestrator.checkpoint import load_checkpoint

        directory = ctl.cfg.run.name or ctl.tracker.run_id
        ctl.best_model = load_checkpoint(f"{ctl.cfg.checkpoint.storage.rstrip('/')}/{directory}/best.pt")["model"]
    return ctl.best_model
