"""Model factories: `model.factory: examples.models:<name>`. Copy one to start your own."""
from __future__ import annotations

import os
from typing import Optional

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
    consistent across replicas (see docs/modes-synchronous.md)."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(in_features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
    )


class _FailingMLP(nn.Module):
    """tiny_mlp whose forward raises after `fail_after_calls` calls in its process, in training
    or (`in_eval`) in evaluation."""

    def __init__(self, inner: nn.Module, fail_after_calls: int, once_marker: Optional[str], in_eval: bool) -> None:
        super().__init__()
        self.inner, self.fail_after_calls, self.once_marker, self.in_eval = inner, fail_after_calls, once_marker, in_eval
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > self.fail_after_calls and self.training != self.in_eval:
            if self.once_marker is None or self._claim(self.once_marker):
                raise RuntimeError(f"injected failure in forward (call {self.calls})")
        return self.inner(x)

    @staticmethod
    def _claim(path: str) -> bool:
        """Create `path` atomically: True for the one process that created it (replicas in lock
        step reach the failing call at the same moment, so an exists-then-create check races)."""
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False


def failing_mlp(in_features: int = 32, num_classes: int = 4, fail_after_calls: int = 20,
                once_marker: Optional[str] = None, in_eval: bool = False) -> nn.Module:
    """Chaos experiments: tiny_mlp whose training forward raises a RuntimeError after
    `fail_after_calls` calls in each replica's process, as a bug in user code would (`in_eval`:
    its evaluation's forward instead, e.g. out of memory on a larger evaluation batch). With
    `once_marker` (a file path) only the first replica to get there raises, once."""
    return _FailingMLP(tiny_mlp(in_features=in_features, num_classes=num_classes), fail_after_calls, once_marker,
                       in_eval)


def regression_mlp(in_features: int = 10, hidden: int = 64, outputs: int = 1) -> nn.Module:
    """An MLP for regression: `outputs` float values per row (one per target column)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, outputs))


class TinyLM(nn.Module):
    """A small causal transformer over token ids [n, T] -> next-token logits [n, T, vocab]."""

    def __init__(self, vocab: int = 128, context: int = 64, dim: int = 96, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        import torch

        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(context, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        t = tokens.shape[1]
        h = self.embed(tokens.long()) + self.position[:t]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)  # no buffer: nothing to sync
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


def tiny_lm(vocab: int = 128, context: int = 64, dim: int = 96, layers: int = 2, heads: int = 4) -> nn.Module:
    """A character-level causal transformer (~240k parameters at the defaults)."""
    return TinyLM(vocab, context, dim, layers, heads)


def linear(in_features: int = 1024, num_classes: int = 10) -> nn.Module:
    """A linear classifier on flattened inputs: benchmarks/memory.py's model, tiny next to its
    data, so the memory measured is the data's."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, num_classes))
