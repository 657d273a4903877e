"""fsdp's rule (policies/rules/fsdp.py) on a real two-process gloo group, no Ray: the steps equal
one process training on the union of the replicas' batches, and the state the replicas give in
slices, joined, loads into a group of another size (policies/rules/split_state.py); plus its pure
parts (units, the cut, the memory estimate, the config's refusals)."""
from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

from policies.rules.fsdp import estimate_bytes, optimizer_slots, shard_units
from policies.rules.split_state import join, rows_of


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(6, 16)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(2)])
        self.act = torch.nn.ReLU()
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        x = self.act(self.embed(x))
        for b in self.blocks:
            x = self.act(b(x))
        return self.head(x)


SPEC = {"name": "adamw", "lr": 0.01, "weight_decay": 0.01, "momentum": 0.0}


def batches(seed: int = 1) -> list[list]:
    """Per step, each rank's (x, y) or None (its data ran out): uneven rows, an empty step."""
    g = torch.Generator().manual_seed(seed)

    def b(n):
        return (torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))

    return [[b(5), b(3)], [b(4), b(4)], [b(6), None], [b(2), b(7)]]


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from actors.replica.reducer import ProcessGroupReducer, new_process_group
    from policies.rules.fsdp import FsdpWorker

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=30))
    pg = new_process_group(store, rank, world, "gloo", timedelta(seconds=30), default=True)
    reducer = ProcessGroupReducer()
    reducer.configure(store, pg, 30.0)
    worker = FsdpWorker(Net(), SPEC, reducer, rebuild=Net, adopt=lambda m: None)
    steps = batches()
    for i, step in enumerate(steps):
        mine = step[rank]
        more = any(s[rank] is not None for s in steps[i + 1:])
        x, y = mine if mine is not None else (None, None)
        result = worker.step(x, y, more)
    stats = worker.end_epoch()
    mine = [(PROBE[i:i + 1], i) for i in range(1 if rank == 0 else 3)]  # uneven test slices: rank 0 is padded
    outs = []
    with worker.evaluating():  # as ModelReplica.evaluate
        for x, target in worker.in_lock_step(mine):
            logits = worker.model(x)  # every member runs as many forwards
            if target is not None:
                outs.append(logits)
    evaluated = torch.cat(outs)
    state = worker.share()
    torch.save({"state": state, "bytes": stats["state_bytes"], "loss": result.loss, "rows": result.rows,
                "evaluated": evaluated}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


PROBE = torch.randn(4, 6, generator=torch.Generator().manual_seed(9))


def _reload(rank: int, world: int, port: int, out: str, evaluate_first: bool) -> None:
    """A replica of a group of `world` loading the joined whole state (a regroup: load_full, then
    a step nobody has rows for, or an evaluation, shards the model and loads its rows), giving its
    slices, then training a step."""
    import torch.distributed as dist

    from actors.replica.reducer import ProcessGroupReducer, new_process_group
    from policies.rules.fsdp import FsdpWorker

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=30))
    pg = new_process_group(store, rank, world, "gloo", timedelta(seconds=30), default=True)
    reducer = ProcessGroupReducer()
    reducer.configure(store, pg, 30.0)
    worker = FsdpWorker(Net(), SPEC, reducer, rebuild=Net, adopt=lambda m: None)
    worker.load_full(torch.load(os.path.join(out, "whole.pt"), weights_only=False))
    if evaluate_first:  # as ModelReplica.evaluate does, before any step
        with worker.evaluating():
            evaluated = [worker.model(x) for x, _ in worker.in_lock_step([(PROBE, None)])]
        torch.save(torch.cat(evaluated), os.path.join(out, f"evaluated{rank}.pt"))
    else:
        assert worker.step(None, None).rows == 0
    torch.save(worker.share(), os.path.join(out, f"again{rank}.pt"))
    x, y = batches(seed=rank + 5)[0][0]
    assert torch.isfinite(torch.tensor(worker.step(x, y).loss))  # training goes on after either
    dist.destroy_process_group()


def two_replicas_stepped(tmp_path):
    """Two fsdp replicas step on their batches: their slices joined equal one process's step on
    the union; each held about half. Returns the joined whole state."""
    import torch.multiprocessing as mp

    from actors.replica.reducer import free_port

    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["state"]["rank"] == 0 and r1["state"]["rank"] == 1  # each gives its own slices
    whole = join([r0["state"]["slices"], r1["state"]["slices"]])

    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.01)
    for step in batches():
        xs = [s for s in step if s is not None]
        x, y = torch.cat([s[0] for s in xs]), torch.cat([s[1] for s in xs])
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
    for name, value in ref.state_dict().items():
        assert torch.allclose(whole["model"][name], value, atol=1e-5), name
    moments = whole["optimizer"]["state"]
    for name, p in ref.named_parameters():
        assert torch.allclose(moments[name]["exp_avg"], opt.state[p]["exp_avg"], atol=1e-6), name
    assert r0["loss"] == pytest.approx(float(loss), rel=1e-5) and r0["rows"] == 9
    with torch.no_grad():
        expected = ref(PROBE)
    assert r0["evaluated"].shape[0] == 1 and r1["evaluated"].shape[0] == 3  # padding forwards are not yielded as batches
    assert torch.allclose(r0["evaluated"], expected[:1], atol=1e-5) and torch.allclose(r1["evaluated"], expected[:3], atol=1e-5)
    # each replica holds about half of the parameters, gradients and AdamW's two moments
    size = 4 * sum(p.numel() * 4 for p in ref.parameters())
    for r in (r0, r1):
        assert 0.45 * size <= r["bytes"] <= 0.6 * size

    return whole


def regrouped_in_three(tmp_path, whole, evaluate_first: bool) -> None:
    """The joined state loads into a group of 3 (a resize): each keeps its rows, and joined again it is
    the same; the group's first act a step nobody has rows for, or an evaluation (it evaluates
    the state loaded, and training goes on after it)."""
    import torch.multiprocessing as mp

    from actors.replica.reducer import free_port

    torch.save(whole, tmp_path / "whole.pt")
    loaded = Net()
    loaded.load_state_dict(whole["model"])
    with torch.no_grad():
        expected = loaded(PROBE)
    mp.spawn(_reload, args=(3, free_port(), str(tmp_path), evaluate_first), nprocs=3, join=True)
    parts = [torch.load(tmp_path / f"again{r}.pt", weights_only=False) for r in range(3)]
    assert [p["rank"] for p in parts] == [0, 1, 2]
    again = join([p["slices"] for p in parts])
    for name, value in whole["model"].items():
        assert torch.equal(again["model"][name], value), name
    for name, entries in whole["optimizer"]["state"].items():
        for key, value in entries.items():
            assert torch.equal(again["optimizer"]["state"][name][key], value), (name, key)
    head = parts[2]["slices"]["model"]["head.weight"]  # 3 rows over 3 ranks: one each
    assert head.shape == (3, 16) and head.local.shape == (1, 16)
    if evaluate_first:
        for r in range(3):
            assert torch.allclose(torch.load(tmp_path / f"evaluated{r}.pt"), expected, atol=1e-5), r


def test_two_replicas_step_as_one_process_and_an_evaluation_first_after_a_regroup_into_three(tmp_path):
    regrouped_in_three(tmp_path, two_replicas_stepped(tmp_path), evaluate_first=True)


@pytest.mark.full  # ~12 s of processes: make test keeps the regroup whose first act is an evaluation
def test_a_regroup_into_three_whose_first_act_is_a_step_nobody_has_rows_for(tmp_path):
    regrouped_in_three(tmp_path, two_replicas_stepped(tmp_path), evaluate_first=False)


def test_the_cut_is_torch_chunks():
    for n, size in [(16, 3), (3, 3), (3, 4), (5, 4), (0, 2), (7, 1)]:
        chunks = torch.arange(n).chunk(size) if n else ()
        for rank in range(size):
            start, end = rows_of(n, rank, size)
            expected = chunks[rank].tolist() if rank < len(chunks) else []
            assert list(range(start, end)) == expected, (n, size, rank)


def test_units_slots_and_the_memory_estimate():
    net = Net()
    assert shard_units(net) == [net.embed, net.blocks[0], net.blocks[1], net.head]  # the ModuleList's children; ReLU holds none
    assert optimizer_slots(SPEC) == 2 and optimizer_slots({**SPEC, "name": "sgd", "momentum": 0.9}) == 1
    assert optimizer_slots({**SPEC, "name": "sgd"}) == 0
    size = sum(p.numel() * 4 for p in net.parameters())
    assert estimate_bytes(net, SPEC, 4, split=False) == 4 * size
    largest = (16 * 16 + 16) * 4
    assert estimate_bytes(net, SPEC, 4, split=True) == -(-4 * size // 4) + 2 * largest


@pytest.mark.parametrize("change, message", [
    ({"strategy": {"phases": [{"mode": "fsdp", "until": {"epochs": 1}}, {"mode": "allreduce"}]}},
     "one mode for the whole run"),
    ({"strategy": {"mode": "fsdp"}, "model": {"precision": "fp16"}}, "fp32 or bf16"),
    ({"strategy": {"mode": "fsdp"}, "model": {"compile": True}}, "model.compile"),
])
def test_fsdp_refuses_what_it_cannot_take(change, message):
    import yaml

    from orchestrator.config import JobConfig

    raw = yaml.safe_load(open("examples/mnist_allreduce.yaml"))
    raw["strategy"] = {k: v for k, v in raw.get("strategy", {}).items() if k not in ("mode", "phases")}
    for section, values in change.items():
        raw.setdefault(section, {}).update(values)
    with pytest.raises(Exception, match=message):
        JobConfig.from_dict(raw)
    assert JobConfig.from_yaml("examples/mnist_allreduce.yaml", ["strategy.mode=fsdp"]).strategy.mode == "fsdp"
