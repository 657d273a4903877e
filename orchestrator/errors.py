"""Errors the user can act on. The CLI turns a ConfigError into one line and exit code 2."""


class ConfigError(ValueError):
    """Bad input (config field, file, factory, data source); nothing has been started."""


class TrainingError(RuntimeError):
    """A run that started and could not finish (a replica died, a collective timed out)."""


class MemberLost(TrainingError):
    """Replicas whose processes died while the driver waited on a call to them (during a repair,
    a switch or a grow). Not the end of the run: the controller hands each to the failure
    policy as a failure, like a death seen on an epoch stream."""

    def __init__(self, ranks: list[int], what: str, cause: str = "died") -> None:
        self.ranks, self.what, self.cause = sorted(ranks), what, cause  # cause: died | hung (no answer in time)
        super().__init__(f"{what}: replica(s) {self.ranks} {cause}")


import contextlib as _contextlib
import threading as _threading

# Set by the interrupt handler: the controller's loop raises KeyboardInterrupt when it sees it,
# so a signal whose exception landed in code that swallows it (a finalizer) still ends the run.
INTERRUPTED = _threading.Event()
_held = {"depth": 0, "pending": False}  # inside issued_whole(): an interrupt waits for the way out


def raise_interrupt(signum=None, frame=None) -> None:
    """The driver's SIGINT/SIGTERM handler: KeyboardInterrupt where the main thread is, unless
    it is issuing a fan-out of calls (issued_whole), which then raises it on its way out."""
    INTERRUPTED.set()
    if _held["depth"]:
        _held["pending"] = True
        return
    raise KeyboardInterrupt


@_contextlib.contextmanager
def issued_whole():
    """Calls sent to several actors that only make sense together (every member's epoch stream
    and the server's start of the epoch; a group call) go out all or none: an interrupt landing
    between two of them would leave the ones sent waiting on peers that were never asked (an
    allreduce replica alone in its collective), and the interrupted run's checkpoint could not
    be taken from them. The interrupt is raised once the last call is sent."""
    _held["depth"] += 1
    try:
        yield
    finally:
        _held["depth"] -= 1
        if not _held["depth"] and _held["pending"]:
            _held["pending"] = False
            raise KeyboardInterrupt
