"""Errors the user can act on. The CLI turns a ConfigError into one line and exit code 2."""


class ConfigError(ValueError):
    """Bad input (config field, file, factory, data source); nothing has been started."""


class TrainingError(RuntimeError):
    """A run that started and could not finish (a replica died, a collective timed out)."""


class MemberLost(TrainingError):
    """Replicas whose processes died while the driver waited on a call to them (during a repair,
    a switch or a grow). Not the end of the run: the controller hands each to the failure
    policy as a failure, like a death seen on an epoch stream."""

    def __init__(self, ranks: list[int], what: str, cause: str = "died", causes: dict[int, str] | None = None,
                 errors: dict[int, tuple[str, str]] | None = None) -> None:
        self.ranks, self.what = sorted(ranks), what
        # rank -> died | hung (no answer in time) | error (the call raised in the replica: user code)
        self.causes = {r: (causes or {}).get(r, cause) for r in self.ranks}
        self.errors = dict(errors or {})  # cause error: rank -> (the error's line, the replica's traceback)
        self.cause = self.causes[self.ranks[0]] if self.ranks else cause
        said = ", ".join(f"{r} {c}" for r, c in self.causes.items())
        super().__init__(f"{what}: replica(s) {said}")


import contextlib as _contextlib
import threading as _threading


class Interrupts:
    """One run's interrupt state. The trainer that runs in the main thread routes SIGINT and
    SIGTERM to its own (`handler`); its controller's loop raises KeyboardInterrupt when it sees
    `seen` set, so a signal whose exception landed in code that swallows it (a finalizer) still
    ends the run. Each trainer has its own: two in one process never see each other's."""

    def __init__(self) -> None:
        self.seen = _threading.Event()
        self._depth = 0  # inside whole(): an interrupt waits for the way out
        self._pending = False

    def handler(self, signum=None, frame=None) -> None:
        """The driver's SIGINT/SIGTERM handler: KeyboardInterrupt where the main thread is,
        unless it is issuing a fan-out of calls (`whole`), which then raises it on its way out."""
        self.seen.set()
        if self._depth:
            self._pending = True
            return
        raise KeyboardInterrupt

    @_contextlib.contextmanager
    def whole(self):
        """Calls sent to several actors that only make sense together (every member's epoch
        stream and the server's start of the epoch; a group call) go out all or none: an
        interrupt landing between two of them would leave the ones sent waiting on peers that
        were never asked (an allreduce replica alone in its collective), and the interrupted
        run's checkpoint could not be taken from them. The interrupt is raised once the last
        call is sent."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._pending:
                self._pending = False
                raise KeyboardInterrupt
