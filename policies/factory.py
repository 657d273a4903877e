"""Build the user's model and optimizer from the config (on the driver to check, in actors to use).

Actors import this module, never the driver package; orchestrator/factory.py turns a
FactoryError into the driver's ConfigError."""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from policies.imports import NotImportable, import_function



class FactoryError(ValueError):
    """model.factory cannot give a model (a one-line message naming the key)."""


def load_factory(spec: str) -> Callable[..., torch.nn.Module]:
    """Import 'module:function'; FactoryError naming model.factory when it cannot."""
    try:
        return import_function(spec)
    except NotImportable as exc:
        raise FactoryError(f"config error: model.factory: {exc}") from None


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
