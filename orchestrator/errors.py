"""Errors the user can act on. The CLI turns a ConfigError into one line and exit code 2."""


class ConfigError(ValueError):
    """Bad input (config field, file, factory, data source); nothing has been started."""


class TrainingError(RuntimeError):
    """A run that started and could not finish (a replica died, a collective timed out)."""


import threading as _threading

# Set by the SIGTERM handler: the controller's loop raises KeyboardInterrupt when it sees it,
# so a signal whose exception landed in code that swallows it (a finalizer) still ends the run.
INTERRUPTED = _threading.Event()
