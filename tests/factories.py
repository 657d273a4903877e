"""Model factories the tests need and no example has: deliberately bad ones for the bad-input
tests, and unusual but valid ones."""


def not_a_module():
    return 42


def raises():
    raise RuntimeError("boom")


def friedman_net(width: int = 64):
    """A regression model no example uses: 10 features -> one float, with a skip path."""
    from torch import nn

    class FriedmanNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(10, 1)
            self.deep = nn.Sequential(nn.Linear(10, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))

        def forward(self, x):
            return self.linear(x) + self.deep(x)

    return FriedmanNet()


def partly_frozen_mlp():
    """examples.models:tiny_mlp with its first layer frozen (transfer learning's usual shape):
    the frozen weights are in model.parameters() but never trained, sharded or averaged."""
    from examples.models import tiny_mlp

    model = tiny_mlp()
    for p in model[1].parameters():
        p.requires_grad_(False)
    return model


def lr_spike(step: int, steps: int) -> float:
    """optimizer.schedule 'module:function': the rate x30 from half-way on, so the later epochs
    are worse than the best one (checkpoint.keep_best and stop.early_stopping have work to do)."""
    return 1.0 if step < steps // 2 else 30.0
