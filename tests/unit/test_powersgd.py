"""PowerSGD against a plain one-process reference of its formulas, and against the exact step when
the rank suffices; replicas in threads meeting at a summing barrier (no Ray)."""
import torch
import torch.nn.functional as F

from policies.rules.allreduce import AllReduceWorker
from policies.rules.powersgd import PowerSgd, compressible, floats_sent
from tests.unit.test_allreduce_rule import ThreadSum, flat, make, reference_training, run_replicas


def steps_data(n=5, seed=4):
    torch.manual_seed(seed)
    return [[(torch.randn(16, 8), torch.randint(0, 3, (16,))) for _ in range(2)] for _ in range(n)]


def train(steps, rank_r, momentum=0.9):
    models = [make(momentum=momentum) for _ in range(2)]
    reducer = ThreadSum(2)

    def replica(rank):
        m, opt = models[rank]
        worker = AllReduceWorker(m, opt, 256, reducer.for_rank(rank), batch=16, compression="powersgd",
                                 powersgd_rank=rank_r)
        for i, step in enumerate(steps):
            result = worker.step(*step[rank], more=i < len(steps) - 1)
            assert result.rows == 32  # the tail (rows, loss sums) is summed exactly, in the first all-reduce
        worker.end_epoch()

    run_replicas(2, replica)
    return models


def test_which_parameters_are_compressed_and_what_a_step_sends():
    assert compressible((16, 8), 2) and not compressible((16,), 2) and not compressible((3, 4), 2)
    # a 16 x 8 matrix at rank 2: 2 x (16 + 8) = 48 floats instead of 128; a bias as it is
    assert floats_sent([(16, 8), (16,)], 2) == 48 + 16


def test_with_a_rank_that_spans_every_gradient_the_step_is_the_exact_one():
    steps = steps_data()
    models = train(steps, rank_r=16)
    ref, _ = reference_training(steps)
    assert torch.equal(flat(models[0][0]), flat(models[1][0]))
    assert torch.allclose(flat(models[0][0]), flat(ref), atol=1e-5)


def test_low_rank_matches_the_formulas_computed_in_one_process_and_replicas_agree():
    """Rank 1, two steps, plain SGD: the parameters equal those from the paper's update written
    out for both replicas' gradients in one process (P = sum M_i Q, orthonormalised; Q' =
    sum M_i^T P; G = P Q'^T; e_i = M_i - G / p; Q <- Q' / p)."""
    steps = steps_data(n=2)
    models = train(steps, rank_r=1, momentum=0.0)
    assert torch.equal(flat(models[0][0]), flat(models[1][0]))
    ref, _ = make(momentum=0.0)
    params = list(ref.parameters())
    comp = PowerSgd(params, 1)  # only its starting Q is used: the same seed every replica draws from
    q = dict(comp.q)
    err = {i: [torch.zeros(params[i].shape[0], params[i].numel() // params[i].shape[0]) for _ in range(2)]
           for i in comp.compressed}
    for step in steps:
        grads = []
        for x, y in step:  # each replica's summed gradient at the same parameters
            ref.zero_grad()
            (F.cross_entropy(ref(x), y) * len(y)).backward()
            grads.append([p.grad.detach().clone() for p in params])
        rows = sum(len(y) for _, y in step)
        new = []
        for i, p in enumerate(params):
            if i not in comp.compressed:
                new.append((grads[0][i] + grads[1][i]) / rows)
                continue
            ms = [grads[k][i].reshape(p.shape[0], -1) + err[i][k] for k in range(2)]
            pm = torch.linalg.qr(ms[0] @ q[i] + ms[1] @ q[i], mode="reduced").Q
            qs = ms[0].t() @ pm + ms[1].t() @ pm
            g = pm @ qs.t()
            err[i] = [ms[k] - g / 2 for k in range(2)]
            q[i] = qs / 2
            new.append(g.view_as(p) / rows)
        with torch.no_grad():
            for p, g in zip(params, new):
                p.sub_(0.1 * g)
    assert comp.compressed  # something was compressed
    assert torch.allclose(flat(models[0][0]), flat(ref), atol=1e-5)
    exact, _ = reference_training(steps, momentum=0.0)
    assert not torch.allclose(flat(models[0][0]), flat(exact), atol=1e-5)  # rank 1 is an approximation
