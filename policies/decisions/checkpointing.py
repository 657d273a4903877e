"""When an epoch end writes a checkpoint (checkpoint.every_epochs, checkpoint.every_s)."""
from __future__ import annotations


def due(epoch: int, now_s: float, last_s: float, every_epochs: int, every_s: float) -> bool:
    """Whether the epoch that just ended (`epoch`, counted from 1) gets a checkpoint: every
    `every_epochs`-th epoch, or once at least `every_s` seconds have passed between `last_s` (when
    the last checkpoint was written, or training started) and `now_s`. 0 turns a rule off."""
    if every_epochs > 0 and epoch % every_epochs == 0:
        return True
    return every_s > 0 and now_s - last_s >= every_s
