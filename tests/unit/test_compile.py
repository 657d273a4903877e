"""model.compile: the replica compiles its model's forward (torch.compile) once, before a mode's
worker may move the parameters into flat buffers (policies/rules/sharding.py FlatParams); the compiled
forward must then train exactly as the eager one does, whatever the parameters' storage."""
import pytest
import torch
import torch.nn.functional as F

from examples.models import tiny_mlp
from policies.rules.sharding import FlatParams

pytestmark = pytest.mark.full  # ~20 s of compiling on CPU


def trained(compile_first: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = tiny_mlp(in_features=8, hidden=16, num_classes=3)
    if compile_first:  # as ModelReplica does, before the worker is built
        model.forward = torch.compile(model.forward)
    flat = FlatParams(list(model.parameters()))  # parameters become views into one buffer
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        flat.grads.zero_()
        F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            flat.params.sub_(flat.grads, alpha=0.1)
    assert list(model.state_dict()) == ["1.weight", "1.bias", "3.weight", "3.bias"]  # no wrapper in the keys
    return [p.detach().clone() for p in model.parameters()]


def test_a_compiled_forward_trains_as_the_eager_one_through_flat_parameters():
    for a, b in zip(trained(True), trained(False)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
