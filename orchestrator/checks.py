"""Helpers for the checks made before anything starts: a timeout for blocking calls that have
none of their own (filesystem listings, store lookups), and whether a local directory or file can be
written."""
from __future__ import annotations

import os
import tempfile
import queue
import threading
from typing import Any, Callable, Optional


def bounded(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """fn() in a daemon thread; its result, its exception, or TimeoutError after timeout_s
    (the thread is left to finish on its own and never keeps the process alive)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"bounded: {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what}: no answer within {timeout_s:g}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Lane:
    """A call made again and again with a timeout (the scaling policy's look at the cluster on
    every poll): one daemon thread runs them one at a time, instead of a new thread per call.
    A call past its timeout is left to finish on that thread; until it does, the next call
    fails at once (TimeoutError saying so) rather than queueing behind it or starting another
    thread: a stuck dependency costs one thread, however often it is asked."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: "queue.Queue[tuple[Callable[[], Any], dict[str, Any], threading.Event]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._busy: Optional[threading.Event] = None  # the last call's done flag
        self._busy_what = ""

    def call(self, fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
        if self._busy is not None and not self._busy.is_set():
            raise TimeoutError(f"{what}: the previous call ({self._busy_what}) has not returned yet")
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=f"lane: {self.name}", daemon=True)
            self._thread.start()
        box: dict[str, Any] = {}
        done = threading.Event()
        self._busy, self._busy_what = done, what
        self._jobs.put((fn, box, done))
        if not done.wait(timeout_s):
            raise TimeoutError(f"{what}: no answer within {timeout_s:g}s")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _serve(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the caller
                box["error"] = exc
            finally:
                done.set()


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (its type's name when it has none)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def bad_local_path(path: str) -> Optional[str]:
    """Why `path` can never name a local file (a NUL byte, a name or a whole path longer than
    the filesystem allows), or None."""
    if "\x00" in path:
        return "the path holds a NUL byte"
    if len(os.fsencode(os.path.abspath(path))) >= 4096:  # PATH_MAX on Linux
        return "the path is longer than 4095 bytes"
    longest = max((len(os.fsencode(part)) for part in path.split(os.sep)), default=0)
    if longest > 255:  # NAME_MAX on the usual filesystems
        return f"a name in the path is {longest} bytes long; at most 255 allowed"
    return None


def writable_local_dir(path: str) -> Optional[str]:
    """None if a directory can be created at `path` (or is there) and written to, else why not.
    Writes and removes a probe file in the nearest existing ancestor (os.access says yes to root
    where nothing can be written, e.g. /proc); creates nothing else."""
    why = bad_local_path(path)
    if why:
        return why
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"{probe} is not a directory"
    try:
        fd, name = tempfile.mkstemp(prefix=".orchestrator-probe-", dir=probe)
        os.close(fd)
        os.remove(name)
    except OSError as exc:
        return f"{probe} is not writable: a probe file there gives {exc.strerror or type(exc).__name__}"
    return None


def writable_local_file(path: str) -> Optional[str]:
    """None if a file can be written at `path` (not a directory; a file already there opened for
    appending, which changes nothing; else its directory there or creatable, and written to by a
    probe file), else why not. Creates nothing."""
    why = bad_local_path(path)
    if why:
        return why
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return f"{path} is a directory"
    if not os.path.exists(path):
        return writable_local_dir(os.path.dirname(path))
    try:  # a file already there (or /dev/null, a pipe): opened for appending without blocking, nothing changes
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
    except OSError as exc:
        return f"{path} is not writable: opening it gives {exc.strerror or type(exc).__name__}"
    return None
