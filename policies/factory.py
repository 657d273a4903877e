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


def carry_optimizer_state(old: Any, new: Any) -> str:
    """A phase switch: the old rule's local optimizer's per-parameter state (momentum buffers)
    into the new rule's, when both are the same kind of optimizer over the same parameters; the
    new one's settings (lr, momentum) are its own. Returns "carried", "reset" (the old one held
    state the new one cannot take) or "none" (nothing to carry)."""
    if old is None or not old.state:
        return "none"
    if new is None or type(old) is not type(new):
        return "reset"
    params = {id(p) for group in new.param_groups for p in group["params"]}
    for p, state in old.state.items():
        if id(p) in params:
            new.state[p] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
    return "carried"


def _params(opt: Any) -> list:
    return [p for group in opt.param_groups for p in group["params"]]


def momentum_buffers(opt: Any) -> "torch.Tensor | None":
    """The optimizer's momentum buffers, flat in its parameters' order (zeros where a parameter
    has none); None when it keeps none at all."""
    params = _params(opt) if opt is not None else []
    if not any(opt.state.get(p, {}).get("momentum_buffer") is not None for p in params):
        return None
    return torch.cat([(opt.state.get(p, {}).get("momentum_buffer") if opt.state.get(p, {}).get("momentum_buffer")
                       is not None else torch.zeros_like(p)).detach().reshape(-1) for p in params])


def set_momentum_buffers(opt: Any, flat: "torch.Tensor") -> None:
    """Overwrite (or create) the optimizer's momentum buffers from `flat` (as momentum_buffers)."""
    offset = 0
    for p in _params(opt):
        n = p.numel()
        opt.state.setdefault(p, {})["momentum_buffer"] = flat[offset:offset + n].view_as(p).clone().to(p.dtype)
        offset += n
