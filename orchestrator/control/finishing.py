"""Finishing (the controller's last state): what a run leaves behind once it stops."""
from __future__ import annotations

import os
import tempfile
import time
from typing import TYPE_CHECKING, Any

from orchestrator.control import checkpointing
from orchestrator.control.reconfig import phase_switch
from orchestrator.control.epoch_end import report_shard_events
from policies.messages import SavedState

if TYPE_CHECKING:
    from orchestrator.control.context import RunContext


def finish(run: "RunContext") -> None:
    """Finishing: the last phase's record, the shards' settled events, the epoch ledger closed,
    the test split (with a validation split), the final checkpoint, model.pt and the MLflow
    model (the best epoch's with checkpoint.keep_best)."""
    if run.phase.phases:
        run.phase.phases[-1].update(end_step=max(run.ledger.progress.values(), default=0),
                               end_s=round(time.perf_counter() - run.ledger.train_started, 3),
                               ended_by="stop", **{f"{run.metric}_at_end": round(run.headline_value(run.ledger.totals.metrics), 4)})
    if run.fleet.shard_group is not None:  # a rebuild still waiting for replay is reported as it stands
        report_shard_events(run.report, run.fleet.shard_group.settle_all(), run.ledger.totals.epochs)
    limit = run.cfg.stop.max_steps
    run.finish_epochs(whole=limit is None or run.ledger.totals.steps < limit)  # max_steps: ended inside it
    if run.cfg.validated:
        evaluate_test(run)
    run.ledger.totals.checkpoint = checkpointing.take(run, "final", run.cfg.strategy.timeout_s, named="model.pt").path
    with tempfile.TemporaryDirectory() as tmp:
        import torch

        path = os.path.join(tmp, "model.pt")
        torch.save(run.last_saved.model, path)
        run.report.tracker.log_file(path)
    from orchestrator.persistence.final_model import log_trained_model

    model, which = run.last_saved.model, "final"
    if run.cfg.checkpoint.keep_best and run.policies.best.best is not None:
        model, which = best_state_model(run), f"best (epoch {run.policies.best.best_epoch})"
    seconds = log_trained_model(run.report.tracker, run.cfg, run.dataset, model)
    if seconds is not None:
        run.report.event("model_logged", name="model", seconds=round(seconds, 3), model=which)
    if run.cfg.checkpoint.export:
        export(run, {"final": run.last_saved.model, **({"best": model} if which != "final" else {})})


def export(run: "RunContext", states: dict[str, Any]) -> None:
    """checkpoint.export: each state (final, best) written in the formats asked for
    (orchestrator/persistence/export.py); an `exported` event says where. A failure is said and
    the run still ends well (model.pt holds the final state)."""
    from orchestrator.persistence.export import export_models
    from orchestrator.persistence.final_model import trained_model

    cfg = run.cfg
    try:
        models = {which: trained_model(cfg, state) for which, state in states.items()}
        where = export_models(models, list(cfg.checkpoint.export), cfg.checkpoint.storage,
                              cfg.run.name or run.report.tracker.run_id, run.report.tracker)
    except Exception as exc:
        run.report.say(f"export: not written ({type(exc).__name__}: {' '.join(str(exc).split())})")
        run.report.event("export_failed", error=f"{type(exc).__name__}: {exc}")
        return
    run.report.event("exported", formats=list(cfg.checkpoint.export), **where)
    run.report.say("exported " + ", ".join(cfg.checkpoint.export) + ": " + "  ".join(f"{k} {v}" for k, v in where.items()))


def evaluate_test(run: "RunContext") -> None:
    """data.val_fraction: the test split, evaluated once, on the final model (the mode's
    reference in sharded modes); its test_* metrics join the last validation figures in
    `final`, go to MLflow at the last step and in a `test_evaluated` event."""
    run.reslice_tests("test")
    test = phase_switch.evaluate(run, "test")
    run.ledger.totals.metrics = {**run.ledger.totals.metrics, **test}
    run.report.metrics([(k, v, run.ledger.totals.steps) for k, v in test.items()])
    run.report.event("test_evaluated", epoch=run.ledger.totals.epochs, step=run.ledger.totals.steps,
                      **{k: round(v, 6) for k, v in test.items()})
    run.report.say("test split: " + "  ".join(f"{k} {v:.4f}" for k, v in test.items()))


def best_state_model(run: "RunContext") -> dict[str, Any]:
    """checkpoint.keep_best: the best epoch's model, held since it was checkpointed, or (a
    resumed run) read back from best.pt."""
    if run.ledger.best_model is None:
        from orchestrator.persistence.checkpoint import load_checkpoint

        directory = run.cfg.run.name or run.tracker.run_id
        best = load_checkpoint(f"{run.cfg.checkpoint.storage.rstrip('/')}/{directory}/best.pt")
        run.ledger.best_model = SavedState.of(best).model
    return run.ledger.best_model
