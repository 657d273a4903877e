"""sandblaster's coordinator on the driver: one L-BFGS iteration at every pass's (epoch's) end.

The replicas computed the pass's gradient as tasks (a partition each) and pushed every task's
sum to the shards (policies/rules/sandblaster.py `SandblasterWorker`). Here, once every stream
of the epoch has ended:
1. the tasks some shard lacks are computed again by the live replicas (`gradient_tasks`): a
   replica lost after its partition was reported and before its sum was pushed, or a shard
   rebuilt during the pass (its sums went with it); a shard that already holds a task drops the
   second copy, so each task counts once on every shard;
2. every shard sets "g" = the task sums / the pass's rows, and the pass's loss is the tasks'
   loss sums / rows;
3. the coordinator (`LbfgsCoordinator`, scalars only) runs one iteration through the shards'
   operations, which moves x on the shards;
4. the shards are snapshotted, so a shard rebuilt later starts from the moved x.
A shard rebuilt since the last iteration lost its slice of the history: every shard drops its
history and the coordinator starts afresh from the current x (`history_resets`). A resumed run
starts afresh the same way (the history is not in a checkpoint; x is, as the shards' values).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from orchestrator.errors import TrainingError
from orchestrator.fleet.shard_group import ShardSlices
from policies.rules.sandblaster import LbfgsCoordinator

if TYPE_CHECKING:
    from orchestrator.control.context import RunContext

FILL_ATTEMPTS = 3  # rounds of computing missing tasks again before the pass is given up
NO_LIMIT = 10**9  # the coordinator's own iteration limits: stop.epochs bounds the passes instead


def coordinate_pass(run: "RunContext", epoch: int) -> tuple[dict[str, float], Optional[str]]:
    """Steps 1-4 for pass `epoch`: (the iteration's figures for the epoch's metrics, why L-BFGS
    stopped (its tolerances) or None)."""
    group, phase, s = run.fleet.shard_group, run.phase, run.cfg.strategy
    slices = ShardSlices(group, s.timeout_s)
    part_rows = list(phase.lease_plan[0])
    tasks, rows = len(part_rows), sum(part_rows)
    filled = fill_missing(run, slices, epoch, tasks)  # a shard dead meanwhile is rebuilt here, first
    resets = 0
    if phase.coordinator is not None and phase.coordinator_generations != group.generations:
        slices.forget()  # a rebuilt shard's history is gone: nobody's is used again
        phase.coordinator, resets = None, 1
    if phase.coordinator is None:
        phase.coordinator = LbfgsCoordinator(slices, lr=s.step_size, max_iter=NO_LIMIT, max_eval=NO_LIMIT,
                                             history_size=s.history_size)
        phase.coordinator_generations = group.generations
    [(_, _, loss_sum, covered), *_] = slices.held()
    if covered != rows:
        raise TrainingError(f"sandblaster: pass {epoch} covered {covered} rows of {rows}")
    slices.finish_pass(rows, tasks)
    co = phase.coordinator
    co.slices = slices
    moved = co.iteration(loss_sum / rows)
    group.snapshot_now(s.timeout_s)
    if resets:
        run.report.event("sandblaster_history_reset", epoch=epoch, generations=group.generations)
    figures = {"pass_loss": loss_sum / rows, "lbfgs_step": co.t, "lbfgs_history": float(len(co.history)),
               "filled_tasks": float(filled), "history_resets": float(resets)}
    return figures, (None if moved else f"sandblaster converged: {co.why}")


def fill_missing(run: "RunContext", slices: ShardSlices, epoch: int, tasks: int) -> int:
    """Have the live replicas compute the tasks of pass `epoch` that some shard lacks; how many.
    A replica whose call did not come back (died, hung, raised) is not asked again here: its
    tasks go to the others in the next round (its own repair is the failure path's)."""
    filled, ranks, missing = 0, sorted(run.fleet.group.ranks), []
    for _ in range(FILL_ATTEMPTS):
        everywhere = set(range(tasks))
        for pass_id, ids, _, _ in slices.held():
            everywhere &= set(ids) if pass_id == epoch else set()
        missing = sorted(set(range(tasks)) - everywhere)
        if not missing:
            return filled
        if not ranks:
            break
        share = {r: missing[i::len(ranks)] for i, r in enumerate(ranks)}
        run.report.event("sandblaster_fill", epoch=epoch, tasks=missing, by_rank={str(r): t for r, t in share.items()})
        outs = run.fleet.group.outcomes(ranks, "gradient_tasks", what="the pass's missing tasks", peers=False,
                                        per_rank=lambda r: (epoch, share[r]))
        ranks = [r for r in ranks if outs[r].ok]
        filled += len(missing)
    raise TrainingError(f"sandblaster: pass {epoch}'s tasks {missing} were not computed after {FILL_ATTEMPTS} rounds "
                        f"(replicas left to ask: {ranks})")
