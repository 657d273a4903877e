"""A replica's epoch loop (`ModelReplica.run_epoch` runs it): lease partitions, take steps of
the mode's rule, stream progress rows, end the segment ("epoch", "interrupted" or "paused").
The loop keeps its place in the epoch in the replica's cursor, so a segment interrupted by a
membership change or paused for a switch or a grow goes on where it stopped. `self` is the
ModelReplica (actors/replica.py) whose state the loop reads and moves."""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional

from actors.partition_server import is_pause
from policies.modes import Diverged, Interrupted

if TYPE_CHECKING:
    from actors.replica import ModelReplica

_UNREAD = object()  # the cursor has not looked ahead yet
_FETCH = object()  # the cursor's next batch is to be asked for (the epoch was paused for a phase switch)


def run_epoch(self: "ModelReplica", epoch: int, log_every: int, trace_ids: bool = False,
              first_grant: Optional[dict] = None, resume: bool = False,
              announce: bool = False) -> Iterator[dict[str, Any]]:
    """Lease partitions and take steps of the mode's rule over every row of them until the
    server has no more for this replica this epoch (lock-step modes: until no replica has a
    batch left, with empty steps meanwhile); then (allreduce) evaluate this replica's test
    slice. A Ray streaming generator: makes a progress row every `log_every` steps (display,
    step metrics, stall check) and sends the rows made so far at most every
    `tracking.progress_interval_s`; yields last the totals with the rows not yet sent (one
    call per epoch, no call per step), and the partitions finished since the last grant
    request (`unreported`) for the controller to report. `first_grant`: the grant this replica
    starts the epoch with. `resume`: go on with the epoch where the last segment was
    interrupted (the interrupted batch first). `announce`: yield {"kind": "stepping"} with
    the wall time once the first step of this segment is done. A step interrupted by a
    membership change ends the segment with a {"kind": "interrupted"} item; a non-finite
    loss ends the run (RuntimeError naming the step); any other error leaves the process
    group first, so peers are not left waiting."""
    self.model.train()
    cur = self.cursor if resume and self.cursor is not None and self.cursor["epoch"] == epoch else None
    base_batch = int(self.cfg["data"]["batch_size"]) * int(self.cfg["data"].get("accumulate", 1))  # micro-batches x k
    follow_share(self, base_batch)
    if cur is None:
        batches = self.reader.epoch_batches(first_grant)
        cur = self.cursor = {"epoch": epoch, "batches": batches, "pending": next(batches, None),
                              "following": _UNREAD, "ended": False}
    consumed, comm_s, steps, samples, loss = [], 0.0, 0, 0, float("nan")
    t_epoch = t_window = t_sent = time.perf_counter()
    window, rows = 0, []
    win_compute, win_comm, win_real = 0.0, 0.0, 0  # this progress window: compute and wait seconds, real steps
    win = StepWindow()  # this progress window's per-step figures (allreduce: waiting, spread, diversity)
    send_every = float(self.cfg["tracking"]["progress_interval_s"])
    lock_step = self.worker.lock_step
    straggles_inside = getattr(self.worker, "straggles_inside", False)  # backups: the delay is the step's own
    eval_every = (self.cfg.get("eval") or {}).get("every_steps")  # eval.every_steps: between epoch ends too
    while True:
        if cur["pending"] is _FETCH:  # after a pause: ask the server again
            cur["pending"] = next(cur["batches"], None)
        current = cur["pending"]  # kept in the cursor until its step is done: retried after an interruption
        if current is None and not (lock_step and not cur["ended"]):
            break
        current_pause = is_pause(current)
        if current_pause and not lock_step:  # a phase switch: stop at this partition boundary
            cur["pending"] = _FETCH
            yield from pause_segment(self, epoch, steps, samples, time.perf_counter() - t_epoch, comm_s, consumed, loss, rows)
            return
        real = current is not None and not current_pause
        if real and cur["following"] is _UNREAD:
            cur["following"] = next(cur["batches"], None)  # look ahead one batch
        following = cur["following"] if real else None
        x, y = current[:2] if real else (None, None)
        pause = current_pause or is_pause(following)  # lock-step: every member stops after this step
        if self.lr_moves:
            self.apply_lr()
        t_step = time.perf_counter()
        try:
            result = self.worker.step(x, y, following is not None or current_pause, pause)
        except Interrupted as exc:
            self.leave_group()  # fail the peers' pending collectives now, not at their timeout
            yield segment_end(self, "interrupted", epoch, steps, samples, time.perf_counter() - t_epoch, comm_s,
                                    consumed, loss, rows, reason=str(exc))
            return
        except FloatingPointError as exc:
            self.leave_group()
            lr = self.cfg["optimizer"]["lr"]
            raise Diverged(f"training diverged: {exc} at step {self.step + 1} (epoch {epoch}) with "
                               f"optimizer.lr {lr:g}; the step was not applied and the last checkpoint is kept; "
                               "lower optimizer.lr") from None
        except Exception:
            self.leave_group()
            raise
        if self.slow and real and not straggles_inside:  # a slower device: its compute takes longer, not its waiting
            self.slow_down(time.perf_counter() - t_step - result.comm_s)
        compute = time.perf_counter() - t_step - result.comm_s  # a deliberate straggler's sleep included
        figures = getattr(self.worker, "last", None)
        if figures:
            win.add(figures)
        norm = self.recipe.last.grad_norm
        if real and norm is not None and math.isfinite(norm):  # fp16's skipped steps have none
            win.add_norm(norm)
        follow_share(self, base_batch)
        cur["pending"], cur["following"] = following, _UNREAD
        if lock_step and pause:
            cur["pending"] = _FETCH
        if lock_step and not result.go_on:
            cur["ended"] = True
        comm_s += result.comm_s
        win_comm += result.comm_s
        steps += 1
        self.step += 1
        if announce:
            announce = False
            yield {"kind": "stepping", "rank": self.rank, "t_wall": time.time(), "step": self.step,
                   "mode": self.spec.name}
        if eval_every and self.step % eval_every == 0:
            t_eval = time.perf_counter()
            yield interval_evaluation(self, epoch)
            t_eval = time.perf_counter() - t_eval  # not training time: out of this window's speed and the epoch's
            t_window += t_eval
            t_epoch += t_eval
        if real:
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
            self.apply_lr()  # the row reports the rate the next step takes
            rows.append({"rank": self.rank, "epoch": epoch, "step": self.step, "step_in_epoch": steps,
                         "loss": loss, "samples_per_s": window / (now - t_window),
                         "compute_s": win_compute / win_real if win_real else None,
                         "comm_share": win_comm / (now - t_window), "lr": self.current_lr(),
                         "comm_s": win_comm / log_every, **win.row(win_comm / log_every),
                         "batch_rows": self.reader.batch_size,
                         "period": getattr(self.worker, "balanced_period", None),  # local SGD's, balanced
                         **({"skipped_steps": self.recipe.skipped} if self.recipe.scaler is not None else {})})
            t_window, window, win_compute, win_comm, win_real = now, 0, 0.0, 0.0, 0
            win = StepWindow()
            if now - t_sent >= send_every:  # each message to the driver costs the step loop
                yield {"kind": "progress", "rank": self.rank, "rows": rows}
                rows, t_sent = [], now
        if cur["ended"]:
            break
        if lock_step and result.paused:
            yield from pause_segment(self, epoch, steps, samples, time.perf_counter() - t_epoch, comm_s, consumed, loss, rows)
            return
    cur["ended"] = True
    train_s = time.perf_counter() - t_epoch  # the step loop only: not the epoch's end or the evaluation
    try:
        mode_stats = self.worker.end_epoch()  # e.g. waits for this epoch's pushes
    except Interrupted as exc:
        self.leave_group()  # resuming redoes only the end of the epoch
        yield segment_end(self, "interrupted", epoch, steps, samples, train_s, comm_s, consumed, loss, rows,
                                reason=str(exc))
        return
    if self.flat is not None and self.has_buffers:  # the reference model's buffers: the replicas' averaged
        self.client.set_buffers(self.rank, self.local_buffers())
    evaluation = self.evaluate() if self.flat is None else None  # sharded modes: see evaluate_reference
    self.cursor = None
    yield segment_end(self, "epoch", epoch, steps, samples, train_s, comm_s, consumed, loss, rows,
                            eval=evaluation, mode=mode_stats, partitions=list(self.reader.read),
                            unreported=self.reader.unreported)

def interval_evaluation(self: "ModelReplica", epoch: int) -> dict[str, Any]:
    """eval.every_steps: the evaluation sums of the mode's reference model (this replica's own
    in allreduce and local SGD; the server copy or center in sharded modes) on this replica's
    slice of the evaluated split, at this step; the controller adds every member's for the
    step and finishes them into metrics."""
    sums = self.evaluate_reference()
    self.model.train()
    return {"kind": "evaluation", "rank": self.rank, "epoch": epoch, "step": self.step, "sums": sums}


def follow_share(self: "ModelReplica", base_batch: int) -> None:
    """Cut the next batches at the worker's share of the global batch (load-balanced
    allreduce's `batch_share`; `base_batch` when it has none), completing a short last batch
    from the next partition while the share differs from `base_batch`."""
    share = getattr(self.worker, "batch_share", None)
    self.reader.batch_size = share or base_batch
    self.reader.span = share is not None and share != base_batch


def pause_segment(self: "ModelReplica", epoch: int, steps: int, samples: int, train_s: float, comm_s: float,
                  consumed: list, loss: float, rows: list) -> Iterator[dict[str, Any]]:
    """End the segment for a phase switch, keeping the epoch's cursor: the mode's end of
    epoch first (pushes acknowledged, buffers synchronized), then a "paused" item."""
    try:
        mode_stats = self.worker.end_epoch()
    except Interrupted as exc:
        self.leave_group()
        yield segment_end(self, "interrupted", epoch, steps, samples, train_s, comm_s, consumed, loss, rows,
                                reason=str(exc))
        return
    if self.flat is not None and self.has_buffers:
        self.client.set_buffers(self.rank, self.local_buffers())
    yield segment_end(self, "paused", epoch, steps, samples, train_s, comm_s, consumed, loss, rows, mode=mode_stats)

def segment_end(self: "ModelReplica", kind: str, epoch: int, steps: int, samples: int, train_s: float, comm_s: float,
                 consumed: list, loss: float, rows: list, **more: Any) -> dict[str, Any]:
    out = {"kind": kind, "rank": self.rank, "epoch": epoch, "steps": steps, "samples": samples,
           "train_s": train_s, "comm_s": comm_s, "consumed": consumed, "loss": loss,
           "progress": rows, "step": self.step, "partitions": [], "unreported": [], "eval": None, "mode": None,
           "mode_name": self.spec.name}
    out.update(more)
    return out


class StepWindow:
    """One progress window's per-step figures from a worker that measures them (allreduce's
    `StepFigures`): seconds waiting for the busiest replica, the busy spread across replicas
    (busiest / least busy) and the gradient diversity, each averaged over the steps that had it."""

    def __init__(self) -> None:
        self.sums = {"wait_s": 0.0, "spread": 0.0, "diversity": 0.0}
        self.counts = {"wait_s": 0, "spread": 0, "diversity": 0}
        self.norms: list[float] = []  # each step's gradient norm before clipping (policies/recipe.py)

    def add_norm(self, norm: float) -> None:
        self.norms.append(norm)

    def add(self, figures: dict[str, Any]) -> None:
        for k in self.sums:
            v = figures.get(k)
            if v is not None:
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
