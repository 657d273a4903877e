"""A phase switch carries the local optimizer's state (policies/rules/factory.py)."""
import torch

from examples.models import tiny_mlp
from policies.rules.factory import carry_optimizer_state, momentum_buffers, set_momentum_buffers


def trained(momentum=0.9):
    torch.manual_seed(0)
    m = tiny_mlp(in_features=4, hidden=8, num_classes=2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum)
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(5, 4)).sum().backward()
        opt.step()
    return m, opt


def test_momentum_is_carried_into_a_new_optimizer_of_the_same_kind_with_its_own_settings():
    m, old = trained()
    new = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.5, nesterov=True)
    assert carry_optimizer_state(old, new) == "carried"
    for p in m.parameters():
        assert torch.equal(new.state[p]["momentum_buffer"], old.state[p]["momentum_buffer"])
        assert new.state[p]["momentum_buffer"] is not old.state[p]["momentum_buffer"]  # a copy
    assert new.param_groups[0]["lr"] == 0.01 and new.param_groups[0]["momentum"] == 0.5
    new.state_dict()  # still a well-formed optimizer


def test_nothing_to_carry_or_a_different_kind_is_said_so():
    m, old = trained()
    assert carry_optimizer_state(None, old) == "none"
    assert carry_optimizer_state(torch.optim.SGD(m.parameters(), lr=0.1), old) == "none"  # no state yet
    assert carry_optimizer_state(old, torch.optim.Adam(m.parameters())) == "reset"
    assert carry_optimizer_state(old, None) == "reset"


def test_momentum_buffers_flatten_and_come_back():
    m, opt = trained()
    flat = momentum_buffers(opt)
    assert list(flat) == ["momentum_buffer"]
    assert flat["momentum_buffer"].numel() == sum(p.numel() for p in m.parameters())
    set_momentum_buffers(opt, {"momentum_buffer": flat["momentum_buffer"] * 2})
    assert torch.allclose(momentum_buffers(opt)["momentum_buffer"], flat["momentum_buffer"] * 2)
    assert momentum_buffers(trained(momentum=0.0)[1]) is None


def test_adams_moments_are_per_element_state_to_average_and_step_is_not():
    """Into allreduce every replica must step alike: AdamW's exp_avg and exp_avg_sq are
    averaged as momentum is; its scalar step stays each replica's own."""
    torch.manual_seed(0)
    m = tiny_mlp(in_features=4, hidden=8, num_classes=2)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(5, 4)).sum().backward()
    opt.step()
    flat = momentum_buffers(opt)
    assert sorted(flat) == ["exp_avg", "exp_avg_sq"]
    set_momentum_buffers(opt, {k: torch.zeros_like(v) for k, v in flat.items()})
    assert all(float(s["exp_avg"].abs().sum()) == 0 and float(s["step"]) == 1 for s in opt.state.values())
