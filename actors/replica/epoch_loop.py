"""A replica's epoch loop (`ModelReplica.run_epoch` runs it): lease partitions, take steps of
the mode's rule, stream progress rows, end the segment ("epoch", "interrupted" or "paused").
The loop keeps its place in the epoch in the replica's cursor, so a segment interrupted by a
membership change or paused for a switch or a grow goes on where it stopped. `replica` is the
ModelReplica (actors/replica/model_replica.py) whose state the loop reads and moves."""
from __future__ import annotations

import math
import time
from typing import Any, Iterator, Optional, Protocol

from actors.partitions.server import is_pause
from policies.messages import Evaluation, Progress, ProgressRow, SegmentEnd, Stepping
from policies.rules.modes import Diverged, Interrupted

Message = Stepping | Progress | Evaluation | SegmentEnd  # what the epoch stream sends (policies/messages.py)


_UNREAD = object()  # the cursor has not looked ahead yet
_FETCH = object()  # the cursor's next batch is to be asked for (the epoch was paused for a phase switch)


class LoopHost(Protocol):
    """What the loop needs of the replica that runs it (ModelReplica, actors/replica/model_replica.py):
    its identity and config, the model and its update rule, the partition reader and data
    cursor, the evaluation sums, and the calls the loop makes back."""

    rank: int
    cfg: dict[str, Any]
    spec: Any  # the mode's registry entry
    model: Any
    worker: Any  # the mode's update rule (policies/rules/)
    client: Any  # the shards' client (sharded modes)
    reader: Any  # the partition reader (actors/partitions/reader.py)
    recipe: Any
    flat: Any
    step: int
    probation_until: int
    cursor: Any
    local_buffers: Any
    has_buffers: bool
    slow: Any
    lr_moves: Any
    current_lr: Any

    def leave_group(self) -> None: ...
    def apply_lr(self, *args: Any) -> Any: ...
    def slow_down(self, *args: Any) -> Any: ...
    def evaluate(self, *args: Any) -> Any: ...
    def evaluate_reference(self, *args: Any) -> Any: ...


def run_epoch(replica: "LoopHost", epoch: int, log_every: int, trace_ids: "bool | str" = False,
              first_grant: Optional[dict] = None, resume: bool = False,
              announce: bool = False) -> Iterator[Message]:
    """Lease partitions and take steps of the mode's rule over every row of them until the
    server has no more for this replica this epoch (lock-step modes: until no replica has a
    batch left, with empty steps meanwhile); then (allreduce) evaluate this replica's test
    slice. A Ray streaming generator: makes a progress row every `log_every` steps (display,
    step metrics, stall check) and sends the rows made so far at most every
    `tracking.progress_interval_s`; yields last the totals with the rows not yet sent (one
    call per epoch, no call per step), and the partitions finished since the last grant
    request (`unreported`) for the controller to report. `trace_ids` (tests): True, the row ids of
    every step go with the segment's end; a directory, they are also appended to a file there
    at each step (`trace_rows`). `first_grant`: the grant this replica
    starts the epoch with. `resume`: go on with the epoch where the last segment was
    interrupted (the interrupted batch first). `announce`: yield `Stepping` with
    the wall time once the first step of this segment is done. A step interrupted by a
    membership change ends the segment with an "interrupted" `SegmentEnd`; a non-finite
    loss ends the run (RuntimeError naming the step), except on a switch's probation, where the
    step is skipped and counted (`skipped_steps`); any other error leaves the process
    group first, so peers are not left waiting."""
    replica.model.train()
    begin = getattr(replica.worker, "begin_segment", None)  # sandblaster: the pass is the epoch
    if begin is not None:
        begin(epoch)
    replica.recipe.skip_nonfinite = epoch <= replica.probation_until  # a switch on probation (Recipe.finite)
    cur = replica.cursor if resume and replica.cursor is not None and replica.cursor["epoch"] == epoch else None
    base_batch = int(replica.cfg["data"]["batch_size"]) * int(replica.cfg["data"].get("accumulate", 1))  # micro-batches x k
    follow_share(replica, base_batch)
    if cur is None:
        batches = replica.reader.epoch_batches(first_grant)
        cur = replica.cursor = {"epoch": epoch, "batches": batches, "pending": next(batches, None),
                              "following": _UNREAD, "ended": False}
    consumed, comm_s, steps, samples, loss = [], 0.0, 0, 0, float("nan")
    t_epoch = t_window = t_sent = time.perf_counter()
    window, rows = 0, []
    win_compute, win_comm, win_real = 0.0, 0.0, 0  # this progress window: compute and wait seconds, real steps
    win = StepWindow()  # this progress window's per-step figures (allreduce: waiting, spread, diversity)
    send_every = float(replica.cfg["tracking"]["progress_interval_s"])
    lock_step = replica.worker.lock_step
    straggles_inside = getattr(replica.worker, "straggles_inside", False)  # backups: the delay is the step's own
    eval_every = (replica.cfg.get("eval") or {}).get("every_steps")  # eval.every_steps: between epoch ends too
    max_steps = (replica.cfg.get("stop") or {}).get("max_steps")  # lock-step modes only: every member stops alike
    while True:
        if max_steps is not None and replica.step >= max_steps:
            break  # stop.max_steps: the epoch ends here for every member, after the same update
        if cur["pending"] is _FETCH:  # after a pause: ask the server again
            cur["pending"] = next(cur["batches"], None)
        current = cur["pending"]  # kept in the cursor until its step is done: retried after an interruption
        if current is None and not (lock_step and not cur["ended"]):
            break
        current_pause = is_pause(current)
        if current_pause and not lock_step:  # a phase switch: stop at this partition boundary
            cur["pending"] = _FETCH
            yield from pause_segment(replica, epoch, steps, samples, time.perf_counter() - t_epoch, comm_s, consumed, loss, rows)
            return
        real = current is not None and not current_pause
        if real and cur["following"] is _UNREAD:
            cur["following"] = next(cur["batches"], None)  # look ahead one batch
        following = cur["following"] if real else None
        x, y = current[:2] if real else (None, None)
        pause = current_pause or is_pause(following)  # lock-step: every member stops after this step
        if replica.lr_moves:
            replica.apply_lr()
        t_step = time.perf_counter()
        try:
            result = replica.worker.step(x, y, following is not None or current_pause, pause)
        except Interrupted as exc:
            replica.leave_group()  # fail the peers' pending collectives now, not at their timeout
            yield segment_end(replica, "interrupted", epoch, steps, samples, time.perf_counter() - t_epoch, comm_s,
                                    consumed, loss, rows, reason=str(exc))
            return
        except FloatingPointError as exc:
            replica.leave_group()
            lr = replica.cfg["optimizer"]["lr"]
            raise Diverged(f"training diverged: {exc} at step {replica.step + 1} (epoch {epoch}) with "
                               f"optimizer.lr {lr:g}; the step was not applied and the last checkpoint is kept; "
                               "lower optimizer.lr") from None
        except Exception:
            replica.leave_group()
            raise
        if replica.slow and real and not straggles_inside:  # a slower device: its compute takes longer, not its waiting
            replica.slow_down(time.perf_counter() - t_step - result.comm_s)
        compute = time.perf_counter() - t_step - result.comm_s  # a deliberate straggler's sleep included
        figures = getattr(replica.worker, "last", None)
        if figures:
            win.add(figures)
        norm = replica.recipe.last.grad_norm
        if real and norm is not None and math.isfinite(norm):  # fp16's skipped steps have none
            win.add_norm(norm)
        follow_share(replica, base_batch)
        cur["pending"], cur["following"] = following, _UNREAD
        if lock_step and pause:
            cur["pending"] = _FETCH
        if lock_step and not result.go_on:
            cur["ended"] = True
        comm_s += result.comm_s
        win_comm += result.comm_s
        steps += 1
        replica.step += 1
        if announce:
            announce = False
            yield Stepping(replica.rank, time.time(), replica.step)
        if eval_every and replica.step % eval_every == 0:
            t_eval = time.perf_counter()
            yield interval_evaluation(replica, epoch)
            t_eval = time.perf_counter() - t_eval  # not training time: out of this window's speed and the epoch's
            t_window += t_eval
            t_epoch += t_eval
        if real:
            replica.reader.trained_one()  # the rows count as served, trained or (backups) dropped late
            if isinstance(trace_ids, str):  # tests: every step's row ids, kept outside the run's processes
                trace_rows(trace_ids, replica, epoch, current)
            trained = len(y) if result.dropped is None else 0  # backups: a late replica's rows were not trained on
            samples += trained
            window += trained
            if result.dropped is None:  # a dropped step stopped when it was late: no measure of this replica's speed
                win_compute += compute
                win_real += 1
            loss = result.loss
            if trace_ids:
                consumed.append(current[3]["ids"][current[2].numpy()].tolist())
        elif trace_ids and lock_step:  # an empty step: kept, so rank r's i-th entry is the group's i-th step
            consumed.append([])
        if steps % log_every == 0:
            now = time.perf_counter()
            replica.apply_lr()  # the row reports the rate the next step takes
            measured = {"comm_s": win_comm / log_every, **win.row(win_comm / log_every)}
            counts_skips = replica.recipe.scaler is not None or replica.recipe.skipped
            rows.append(ProgressRow(replica.rank, epoch, replica.step, steps, loss, window / (now - t_window),
                                    win_compute / win_real if win_real else None, win_comm / (now - t_window),
                                    replica.current_lr(), batch_rows=replica.reader.batch_size,
                                    period=getattr(replica.worker, "balanced_period", None),  # local SGD's, balanced
                                    skipped_steps=replica.recipe.skipped if counts_skips else None, **measured))
            t_window, window, win_compute, win_comm, win_real = now, 0, 0.0, 0.0, 0
            win = StepWindow()
            if now - t_sent >= send_every:  # each message to the driver costs the step loop
                yield Progress(replica.rank, rows)
                rows, t_sent = [], now
        if cur["ended"]:
            break
        if lock_step and result.paused:
            yield from pause_segment(replica, epoch, steps, samples, time.perf_counter() - t_epoch, comm_s, consumed, loss, rows)
            return
    cur["ended"] = True
    train_s = time.perf_counter() - t_epoch  # the step loop only: not the epoch's end or the evaluation
    try:
        mode_stats = replica.worker.end_epoch()  # e.g. waits for this epoch's pushes
    except Interrupted as exc:
        replica.leave_group()  # resuming redoes only the end of the epoch
        yield segment_end(replica, "interrupted", epoch, steps, samples, train_s, comm_s, consumed, loss, rows,
                                reason=str(exc))
        return
    if replica.flat is not None and replica.has_buffers:  # the reference model's buffers: the replicas' averaged
        replica.client.set_buffers(replica.rank, replica.local_buffers())
    try:
        evaluation = replica.evaluate() if replica.flat is None else None  # sharded modes: see evaluate_reference
    except Interrupted as exc:  # fsdp evaluates in lock step: a peer lost meanwhile
        replica.leave_group()
        yield segment_end(replica, "interrupted", epoch, steps, samples, train_s, comm_s, consumed, loss, rows,
                          reason=str(exc))
        return
    replica.cursor = None
    yield segment_end(replica, "epoch", epoch, steps, samples, train_s, comm_s, consumed, loss, rows,
                            eval=evaluation, mode=mode_stats, partitions=list(replica.reader.read),
                            unreported=replica.reader.unreported)

def interval_evaluation(replica: "LoopHost", epoch: int) -> Evaluation:
    """eval.every_steps: the evaluation sums of the mode's reference model (this replica's own
    in allreduce and local SGD; the server copy or center in sharded modes) on this replica's
    slice of the evaluated split, at this step; the controller adds every member's for the
    step and finishes them into metrics."""
    sums = replica.evaluate_reference()
    replica.model.train()
    return Evaluation(replica.rank, epoch, replica.step, sums)


def rebatch(replica: "LoopHost", batch: int) -> None:
    """data.adaptive_batch: the next segment's batches hold `batch` rows (x data.accumulate), and
    allreduce's worker fits its buckets to the new global batch at its next step."""
    if batch != replica.cfg["data"]["batch_size"]:
        replica.cfg["data"]["batch_size"] = batch
        if hasattr(replica.worker, "batch"):
            replica.worker.batch, replica.worker.group = batch * int(replica.cfg["data"].get("accumulate", 1)), None


def follow_share(replica: "LoopHost", base_batch: int) -> None:
    """Cut the next batches at the worker's share of the global batch (load-balanced
    allreduce's `batch_share`; `base_batch` when it has none), completing a short last batch
    from the next partition while the share differs from `base_batch`."""
    share = getattr(replica.worker, "batch_share", None)
    replica.reader.batch_size = share or base_batch
    replica.reader.span = share is not None and share != base_batch


def pause_segment(replica: "LoopHost", epoch: int, steps: int, samples: int, train_s: float, comm_s: float,
                  consumed: list, loss: float, rows: list[ProgressRow]) -> Iterator[SegmentEnd]:
    """End the segment for a phase switch, keeping the epoch's cursor: the mode's end of
    epoch first (pushes acknowledged, buffers synchronized), then a "paused" item."""
    try:
        mode_stats = replica.worker.end_epoch()
    except Interrupted as exc:
        replica.leave_group()
        yield segment_end(replica, "interrupted", epoch, steps, samples, train_s, comm_s, consumed, loss, rows,
                                reason=str(exc))
        return
    if replica.flat is not None and replica.has_buffers:
        replica.client.set_buffers(replica.rank, replica.local_buffers())
    # the partitions it trained since its last grant request: reported by the replica itself when it
    # goes on, or by the driver when it is moved off a drained node instead (reconfig/evacuate.py)
    yield segment_end(replica, "paused", epoch, steps, samples, train_s, comm_s, consumed, loss, rows, mode=mode_stats,
                      unreported=list(replica.reader.unreported), position=replica.reader.position())


def trace_rows(directory: str, replica: "LoopHost", epoch: int, batch: tuple) -> None:
    """Append the step's row ids to <directory>/rows-<rank>-<pid>.jsonl, flushed at once (a test
    reads what a killed run trained)."""
    import json
    import os

    with open(os.path.join(directory, f"rows-{replica.rank}-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps({"epoch": epoch, "rank": replica.rank, "step": replica.step,
                            "ids": [int(i) for i in batch[3]["ids"][batch[2].numpy()]]}) + "\n")

def segment_end(replica: "LoopHost", kind: str, epoch: int, steps: int, samples: int, train_s: float, comm_s: float,
                consumed: list, loss: float, rows: list[ProgressRow], **more: Any) -> SegmentEnd:
    return SegmentEnd(kind, replica.rank, epoch, steps, samples, train_s, comm_s, consumed, loss, rows, replica.step,
                      replica.spec.name, **more)


class StepWindow:
    """One progress window's per-step figures from a worker that measures them (allreduce's
    `StepFigures`): seconds waiting for the busiest replica, the busy spread across replicas
    (busiest / least busy) and the gradient diversity, each averaged over the steps that had it."""

    def __init__(self) -> None:
        self.sums = {"wait_s": 0.0, "spread": 0.0, "diversity": 0.0}
        self.counts = {"wait_s": 0, "spread": 0, "diversity": 0}
        self.norms: list[float] = []  # each step's gradient norm before clipping (policies/rules/recipe.py)

    def add_norm(self, norm: float) -> None:
        self.norms.append(norm)

    def add(self, figures: dict[str, Any]) -> None:
        for k in self.sums:
            v = figures.get(k)
            if v is not None and math.isfinite(v):  # an fp16 step whose gradient overflowed: no figure
                self.sums[k] += v
                self.counts[k] += 1

    def row(self, comm_s: float) -> dict[str, Any]:
        """The progress row's figures: wait_s (per step), comm_s (`comm_s`, the collective's
        seconds per step, less the waiting: the transfer itself), busy_spread,
        gradient_diversity, grad_norm (the mean of the steps'); {} when none."""
        norm = {"grad_norm": sum(self.norms) / len(self.norms)} if self.norms else {}
        if not any(self.counts.values()):
            return norm
        mean = {k: self.sums[k] / self.counts[k] if self.counts[k] else None for k in self.sums}
        out: dict[str, Any] = {"busy_spread": mean["spread"], "gradient_diversity": mean["diversity"], **norm}
        if mean["wait_s"] is not None:
            out["wait_s"] = mean["wait_s"]
            out["comm_s"] = max(0.0, comm_s - mean["wait_s"])
        return out
