"""A checkpoint taken: the lowest answering rank's state plus the run's position, handed to the
Checkpointer (orchestrator/persistence/run_state.py), which stores it now (`wait`: the final and
the interrupted checkpoint) or in the background while the replicas train on (the periodic ones,
with checkpoint.background); `report_written` turns what each write came to into the run's
`checkpoint` / `checkpoint_failed` events. The MLflow writes asked for before a checkpoint are
stored before it is written (at most CHECKPOINT_FLUSH_S), so a run resumed from it finds every
metric it covers. The state taken is the run's newest at once (`RunContext.last_state`); the
clocks the next checkpoint is due by move only once a write is stored (Checkpointer's doc)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from orchestrator.errors import MemberLost, TrainingError
from orchestrator.fleet.model_state import whole_state
from orchestrator.persistence.run_state import CHECKPOINT_FLUSH_S, UNSAVED, Position

if TYPE_CHECKING:
    from orchestrator.control.context import RunContext
    from orchestrator.persistence.run_state import Checkpointer
    from orchestrator.reporting.reporter import Reporter



class Written(NamedTuple):
    """A checkpoint taken: where it goes, and the members found lost while taking it."""
    path: str
    lost: list[MemberLost]


def take(run: "RunContext", tag: str, timeout_s: float, named: Optional[str] = None, step: Optional[int] = None,
         details: Optional[dict[str, Any]] = None, wait: bool = True, probation: Optional[dict[str, Any]] = None) -> Written:
    """The lowest answering rank's model and optimizer state (all replicas hold the same
    parameters at an epoch's end, or the mode's reference) plus the run's position. The final one
    says the run finished (a named run is not started again from it). `step`: the run's step it
    is stored under (default: the last epoch end's; one taken inside an epoch counts that epoch's
    steps so far); `details`: more fields for its event; `wait`: stored before this returns (a
    store that fails raises TrainingError), else written in the background unless
    checkpoint.background is off. Returns the named copy's path if there is one, else the
    store's, and the members found lost on the way (MemberLost each: the caller hands them to
    the failure policy, never drops them). `probation`: a switch's guard still judging (its
    `saved()` form), kept as the state's "probation" so a run resumed from it is on probation too."""
    t = time.perf_counter()
    ranks = run.fleet.group.ranks
    if not ranks:
        raise TrainingError(f"checkpoint {tag}: no replica left to take the model from")
    lost = []
    if run.phase.spec.split_state:  # fsdp: gathered whole from every member (a lost one: MemberLost)
        state = whole_state(run.fleet.group, ranks, f"checkpoint {tag}", run.cfg.strategy.timeout_s)
        ranks = []
    for i, rank in enumerate(ranks):  # a member that does not answer (hung, dying): the next one's copy
        try:
            state = run.fleet.group.call([rank], "state", what=f"checkpoint {tag}", timeout_s=timeout_s)[0]
            break
        except MemberLost as exc:
            if i == len(ranks) - 1:
                raise
            lost.append(exc)  # the caller hands it to the failure policy
            run.report.say(f"checkpoint {tag}: {exc}; taking replica {ranks[i + 1]}'s copy")
    position = run.position.save()
    unsaved = Position.unsaved(position)
    state.update(epoch=run.ledger.totals.epochs, mlflow_run_id=run.tracker.run_id,
                 config=run.cfg.model_dump(mode="json"), run=position, finished=tag == "final")
    if probation is not None:
        state["probation"] = probation
    step = run.ledger.totals.steps if step is None else step
    wait = wait or not run.cfg.checkpoint.background
    fields = {"epoch": run.ledger.totals.epochs, "step": step, **({UNSAVED: unsaved} if unsaved else {}),
              **(details or {})}
    try:
        path, _ = run.checkpoints.write(state, tag, step, run.ledger.totals.epochs, run.tracker.run_id, named,
                                        wait=wait, before=run.tracker.stored(), fields=fields)
    except Exception as exc:  # the store failed
        raise TrainingError(f"checkpoint {tag}: writing it failed ({type(exc).__name__}: {exc})") from None
    finally:
        run.checkpoints.taken_s[(tag, step)] = round(time.perf_counter() - t, 4)  # the replicas waited this long
    for name, why in unsaved.items():
        run.report.say(f"checkpoint {tag} written without its {name} part: {why}")
    report_written(run.checkpoints, run.report)
    return Written(path, lost)


def report_written(checkpoints: "Checkpointer", report: "Reporter") -> None:
    """An event for each checkpoint write that came to an end since the last look: `checkpoint`
    (with `seconds` on the training path and `write_s` in the background), or
    `checkpoint_failed` (the store failed, or a newer checkpoint replaced it before it began)."""
    for done in checkpoints.written():
        seconds = checkpoints.taken_s.pop((done.tag, done.step), None)
        if done.failed or done.superseded_by:
            reason = done.failed or f"superseded by {done.superseded_by} before it was written"
            report.event("checkpoint_failed", tag=done.tag, reason=reason, **done.fields)
            report.say(f"checkpoint {done.tag} not written ({reason}); the previous one is kept")
            continue
        if done.flush_late:
            report.say(f"checkpoint {done.tag}: MLflow had not stored the run's metrics within {CHECKPOINT_FLUSH_S:g}s; "
                            "the checkpoint was written anyway and they follow in the background")
        report.event("checkpoint", path=done.path, seconds=seconds, write_s=done.write_s, **done.fields,
                     **({"stored": done.stored} if done.stored != done.path else {}))
