"""Build the user's model and optimizer from the config (on the driver to check, in actors to use).

Actors import this module, never the driver package; orchestrator/factory.py turns a
FactoryError into the driver's ConfigError."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable

import torch



class FactoryError(ValueError):
    """model.factory cannot give a model (a one-line message naming the key)."""


def load_factory(spec: str) -> Callable[..., torch.nn.Module]:
    """Import 'module:function'; FactoryError naming model.factory when it cannot."""
    module_name, _, func_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or an error raised while importing the module
        raise FactoryError(f"config error: model.factory: cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise FactoryError(f"config error: model.factory: {module_name!r} has no function {func_name!r}")
    return func


def build_model(spec: str, kwargs: dict[str, Any], seed: int) -> torch.nn.Module:
    """The model every replica starts from: same factory, same seed, same initial parameters."""
    factory = load_factory(spec)
    torch.manual_seed(seed)
    try:
        model = factory(**kwargs)
    except Exception as exc:
        raise FactoryError(f"config error: model.factory: {spec}(**model.kwargs) failed ({type(exc).__name__}: {exc})") from None
    if not isinstance(model, torch.nn.Module):
        raise FactoryError(f"config error: model.factory: {spec} returned {type(model).__name__}, not a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise FactoryError(f"config error: model.factory: {spec} returned a module with no trainable parameters")
    return model


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float, momentum: float,
                   weight_decay: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, weight_decay=weight_decay)
    raise FactoryError(f"config error: optimizer.name: unknown optimizer {name!r}")
