"""Model factories: `model.factory: examples.models:<name>`. Copy one to start your own."""
from __future__ import annotations

from torch import nn


def mnist_mlp(hidden: int = 256, in_features: int = 784, num_classes: int = 10) -> nn.Module:
    """Two-layer MLP on flattened images (any input shape is flattened)."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
    )


def mnist_cnn(num_classes: int = 10) -> nn.Module:
    """The benchmark CNN: conv 1->32 3x3, pool, conv 32->64 3x3, pool, fc 3136->128, fc 128->10
    (421,642 parameters) on 1x28x28 inputs."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, num_classes),
    )


def wide_mlp(in_features: int = 32, hidden: int = 2048, depth: int = 6, num_classes: int = 4) -> nn.Module:
    """A communication-bound MLP (~21M parameters at the defaults) for builtin:synthetic."""
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    layers.append(nn.Linear(hidden, num_classes))
    return nn.Sequential(*layers)


def tiny_mlp(in_features: int = 32, hidden: int = 32, num_classes: int = 4) -> nn.Module:
    """A small MLP for builtin:synthetic: fast tests."""
    return mnist_mlp(hidden=hidden, in_features=in_features, num_classes=num_classes)


def mlp_bn(in_features: int = 784, hidden: int = 64, num_classes: int = 10) -> nn.Module:
    """An MLP with BatchNorm: its running statistics are module buffers that every mode keeps
    consistent across replicas (see docs/modes.md)."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(in_features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
    )
