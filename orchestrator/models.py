"""The driver's view of policies/rules/factory.py: the same functions, errors as ConfigError."""
from __future__ import annotations

from typing import Any

import torch

from orchestrator.errors import ConfigError
from policies.rules.factory import FactoryError, load_factory, make_optimizer  # noqa: F401 (re-exported)
from policies.rules.factory import build_model as _build_model


def build_model(spec: str, kwargs: dict[str, Any], seed: int) -> torch.nn.Module:
    """policies.rules.factory.build_model; a FactoryError becomes a ConfigError (exit code 2)."""
    try:
        return _build_model(spec, kwargs, seed)
    except FactoryError as exc:
        raise ConfigError(str(exc)) from None
