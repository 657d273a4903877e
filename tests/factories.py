"""Deliberately bad model factories for the bad-input tests."""


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
