"""Build the user's model and optimizer from the config (on the driver to check, in actors to use).

Actors import this module, never the driver package; orchestrator/models.py turns a
FactoryError into the driver's ConfigError."""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from policies.rules.imports import NotImportable, import_function
from policies.rules.recipe import make_optimizer  # noqa: F401 (one place builds optimizers: policies/rules/recipe.py)



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


def momentum_buffers(opt: Any) -> "dict[str, torch.Tensor] | None":
    """The optimizer's per-element state, one flat tensor per state key in its parameters'
    order (SGD's momentum_buffer, Adam's exp_avg and exp_avg_sq, Adagrad's sum, ...: every
    state tensor shaped like its parameter; zeros where a parameter has none yet). Scalar
    state (Adam's step) is not included. None when it keeps none at all."""
    params = _params(opt) if opt is not None else []
    keys = sorted({k for p in params for k, v in opt.state.get(p, {}).items()
                   if torch.is_tensor(v) and v.shape == p.shape})
    if not keys:
        return None
    out = {}
    for key in keys:
        parts = []
        for p in params:
            v = opt.state.get(p, {}).get(key)
            parts.append((v if v is not None else torch.zeros_like(p)).detach().reshape(-1))
        out[key] = torch.cat(parts)
    return out


def set_momentum_buffers(opt: Any, flat: "dict[str, torch.Tensor]") -> None:
    """Overwrite (or create) the optimizer's per-element state from `flat` (as momentum_buffers)."""
    for key, values in flat.items():
        offset = 0
        for p in _params(opt):
            n = p.numel()
            opt.state.setdefault(p, {})[key] = values[offset:offset + n].view_as(p).clone().to(p.dtype)
            offset += n
