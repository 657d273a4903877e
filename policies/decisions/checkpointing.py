"""When an epoch end writes a checkpoint (checkpoint.every_epochs, checkpoint.every_s), when one is
taken inside an epoch (checkpoint.every_steps, every_s), and when the driver's own node is being
drained."""
from __future__ import annotations


def due(epoch: int, now_s: float, last_s: float, every_epochs: int, every_s: float) -> bool:
    """Whether the epoch that just ended (`epoch`, counted from 1) gets a checkpoint: every
    `every_epochs`-th epoch, or once at least `every_s` seconds have passed between `last_s` (when
    the last checkpoint was written, or training started) and `now_s`. 0 turns a rule off."""
    if every_epochs > 0 and epoch % every_epochs == 0:
        return True
    return every_s > 0 and now_s - last_s >= every_s


def due_inside(steps_since: int, seconds_since: float, every_steps: int, every_s: float) -> bool:
    """Whether a checkpoint is taken now, inside an epoch: `steps_since` (the furthest replica's
    steps since the last checkpoint) reached `every_steps`, or `seconds_since` (since it was
    written, or training started) reached `every_s`. 0 turns a rule off."""
    if every_steps > 0 and steps_since >= every_steps:
        return True
    return every_s > 0 and seconds_since >= every_s


LAST_CALL_S = 10.0  # the driver's node being drained: the second checkpoint, this long before its deadline


def due_for_drain(deadline: float, now: float, taken: int) -> bool:
    """The driver's own node is being drained (`deadline`: wall-clock seconds, 0 when none was
    given): a checkpoint inside the epoch at once (`taken` 0 so far), and once more when
    LAST_CALL_S or less is left before the deadline (`taken` 1), so a run started again loses at
    most the steps of those last seconds."""
    if taken == 0:
        return True
    return taken == 1 and deadline > 0 and deadline - now <= LAST_CALL_S
