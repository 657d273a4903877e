"""Loading the user's 'module:function' (model factory, task, decoder): one place, no torch, so
a read task's process can use it without importing torch."""
from __future__ import annotations

import importlib
from typing import Any, Callable


class NotImportable(ValueError):
    """'module:function' names nothing callable (a one-line message; callers add their field)."""


def import_function(spec: str) -> Callable[..., Any]:
    """The function `spec` ('module:function') names; NotImportable when the module cannot be
    imported (or raises while importing) or holds no such function."""
    module_name, _, func_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or an error raised while importing the module
        raise NotImportable(f"cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise NotImportable(f"{module_name!r} has no function {func_name!r}")
    return func
