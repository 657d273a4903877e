"""sandblaster's coordinator on the driver: one L-BFGS iteration at every pass's (epoch's) end.

The replicas computed the pass's gradient as tasks (a partition each) and pushed every task's
sum to the shards (policies/rules/gradient_tasks.py `SandblasterWorker`). Here, once every stream
of the epoch has ended:
1. the tasks some shard lacks are computed again by the live replicas, one task a call
   (`gradient_tasks`, each within strategy.timeout_s): a replica lost after its partition was
   reported and before its sum was pushed, or a shard rebuilt during the pass (its sums went
   with it); a shard that already holds a task drops the second copy, so each task counts once
   on every shard;
2. every shard sets "g" = the task sums / the pass's rows, and the pass's loss is the tasks'
   loss sums / rows;
3. the coordinator (`LbfgsCoordinator`, scalars only) runs one iteration through the shards'
   operations, which moves x on the shards;
4. the shards are snapshotted, so a shard rebuilt later starts from the moved x (a shard that
   misses this snapshot and is rebuilt keeps the previous iterate on its slice: the
   `sandblaster_move_lost` event says which).
The iteration is made once per epoch: an epoch's end carried out again (a replica lost while it
was evaluated, then repaired) takes the figures of the first. A shard rebuilt since the last
iteration lost its slice of the history: every shard drops its history and the coordinator
starts afresh from the current x (`history_resets`). A resumed run starts afresh the same way
(the history is not in a checkpoint; x is, as the shards' values).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from orchestrator.errors import TrainingError
from orchestrator.fleet.outcomes import describe
from orchestrator.fleet.shard_slices import ShardSlices
from policies.rules.sandblaster import LbfgsCoordinator

if TYPE_CHECKING:
    from orchestrator.control.context import RunContext

NO_LIMIT = 10**9  # the coordinator's own iteration limits: stop.epochs bounds the passes instead


def coordinate_pass(run: "RunContext", epoch: int) -> tuple[dict[str, float], Optional[str]]:
    """Steps 1-4 for pass `epoch`: (the iteration's figures for the epoch's metrics, why L-BFGS
    stopped (its tolerances) or None)."""
    group, phase, s = run.fleet.shard_group, run.phase, run.cfg.strategy
    if phase.coordinated is not None and phase.coordinated[0] == epoch:  # this epoch's end, carried out again
        return phase.coordinated[1], phase.coordinated[2]
    slices = ShardSlices(group, s.timeout_s)
    part_rows = list(phase.lease_plan[0])
    tasks, rows = len(part_rows), sum(part_rows)
    filled = fill_missing(run, slices, epoch, tasks)  # a shard dead meanwhile is rebuilt here, first
    resets = 0
    if phase.coordinator is not None and phase.coordinator_generations != group.generations:
        slices.forget()  # a rebuilt shard's history is gone: nobody's is used again
        phase.coordinator, resets = None, 1
        run.report.event("sandblaster_history_reset", epoch=epoch, generations=group.generations)
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
    missed = {f"shard {i}": o for i, o in group.snapshot_now(s.timeout_s).items() if not o.ok}
    if missed:
        run.report.event("sandblaster_move_lost", epoch=epoch, shards=sorted(missed), why=describe(missed))
        run.report.say(f"sandblaster: after iteration {co.n_iter} {describe(missed)}: rebuilt, its slice keeps the "
                       "previous iterate")
    figures = {"pass_loss": loss_sum / rows, "lbfgs_step": co.t, "lbfgs_history": float(len(co.history)),
               "filled_tasks": float(filled), "history_resets": float(resets)}
    phase.coordinated = (epoch, figures, None if moved else f"sandblaster converged: {co.why}")
    return phase.coordinated[1], phase.coordinated[2]


def lacking(slices: ShardSlices, epoch: int, tasks: int) -> list[int]:
    """The tasks of pass `epoch` some shard does not hold."""
    everywhere = set(range(tasks))
    for pass_id, ids, _, _ in slices.held():
        everywhere &= set(ids) if pass_id == epoch else set()
    return sorted(set(range(tasks)) - everywhere)


def fill_missing(run: "RunContext", slices: ShardSlices, epoch: int, tasks: int) -> int:
    """Have the live replicas compute the tasks of pass `epoch` that some shard lacks, one task
    a call (each call within strategy.timeout_s, as a partition's grant is); how many came back.
    A replica whose call did not come back (died, hung, raised) is not asked again here (its
    repair is the failure path's); its task goes to another."""
    group = run.fleet.group
    ranks, failed, filled = sorted(group.ranks), {}, 0
    missing = lacking(slices, epoch, tasks)
    if missing:
        run.report.event("sandblaster_fill", epoch=epoch, tasks=missing)
    for _ in range(2 * tasks + len(ranks)):  # each round fills a task or loses a replica
        if not missing or not ranks:
            break
        share = {r: [t] for r, t in zip(ranks, missing)}
        outs = group.outcomes(sorted(share), "gradient_tasks", what="the pass's missing tasks", peers=False,
                              per_rank=lambda r: (epoch, share[r]))
        for r, out in outs.items():
            if out.ok:
                filled += 1
            else:
                failed[f"replica {r}"] = out
                ranks.remove(r)
        missing = lacking(slices, epoch, tasks)
    if missing:
        raise TrainingError(f"sandblaster: pass {epoch}'s tasks {missing} were not computed again"
                            + (f": {describe(failed)}" if failed else ""))
    return filled
