"""Sandblaster's coordinator: L-BFGS through shard operations equals torch.optim.LBFGS."""
from __future__ import annotations

import pytest
import torch
from sklearn.datasets import load_digits

from policies.rules.gradient_tasks import GradientPass, TaskHandout, task_bounds
from policies.rules.sandblaster import LbfgsCoordinator, LocalSlices, SliceVectors, combine
from policies.rules.sharding import shard_bounds


def problem(seed=0):
    """Softmax regression on sklearn's digits (full batch): a smooth convex problem."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
    return model, x, y


def flat_grad_and_loss(model, x, y):
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]), float(loss.detach())


def reference(**opt):
    """torch.optim.LBFGS, one .step() (max_iter iterations), on the same start."""
    model, x, y = problem()
    lbfgs = torch.optim.LBFGS(model.parameters(), **opt)

    def closure():
        lbfgs.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    lbfgs.step(closure)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def sandblaster(shards, **opt):
    """The coordinator over `shards` slices; the "replica" computes the full-batch gradient at x
    (assembled from the slices) and sets each shard's slice of it."""
    model, x, y = problem()
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    bounds = shard_bounds(flat.numel(), shards)
    slices = [SliceVectors(flat[lo:hi].clone()) for lo, hi in bounds]

    def evaluate():
        torch.nn.utils.vector_to_parameters(torch.cat([s.v["x"] for s in slices]), params)
        g, loss = flat_grad_and_loss(model, x, y)
        for (lo, hi), s in zip(bounds, slices):
            s.set("g", g[lo:hi].clone())
        return loss

    coordinator = LbfgsCoordinator(LocalSlices(slices), **opt)
    while coordinator.iteration(evaluate()):
        pass
    return torch.cat([s.v["x"] for s in slices]), coordinator, slices


@pytest.mark.parametrize("shards", [1, 3])
def test_twenty_iterations_equal_torch_lbfgs(shards):
    want = reference(lr=1.0, max_iter=20, history_size=10)
    got, coordinator, _ = sandblaster(shards, lr=1.0, max_iter=20, history_size=10)
    assert coordinator.n_iter == 20 and coordinator.why == "max_iter"
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())
    start = problem()[0]
    moved = torch.cat([p.detach().reshape(-1) for p in start.parameters()])
    assert float((got - moved).abs().max()) > 0.1  # it did move: the equality is not of two starts


def test_history_is_bounded_and_dropped_on_the_shards():
    _, coordinator, slices = sandblaster(2, lr=1.0, max_iter=12, history_size=3)
    assert len(coordinator.history) == 3
    for s in slices:  # x, g, d, g_prev and the three newest (s, y) pairs: older pairs are dropped
        assert sorted(s.v) == sorted(["x", "g", "d", "g_prev"] + [n for pair in coordinator.history for n in pair[:2]])


def test_a_tolerance_ends_the_run_before_max_iter():
    _, coordinator, _ = sandblaster(2, lr=1.0, max_iter=20, tolerance_change=1e-2)
    assert coordinator.done and coordinator.why != "max_iter" and coordinator.n_iter < 20, coordinator.why


def test_partial_scalars_combine_across_shards():
    a, b = torch.randn(10), torch.randn(10)
    parts = [SliceVectors(a[:4].clone()), SliceVectors(a[4:].clone())]
    for p, piece in zip(parts, (b[:4], b[4:])):
        p.set("b", piece.clone())
    ops = [("dot", "x", "b"), ("absmax", "x"), ("axpy", "x", 2.0, "b"), ("abssum", "x")]
    whole = combine(ops, LocalSlices(parts).run(ops))
    assert whole[0] == pytest.approx(float(a.dot(b)), rel=1e-6)
    assert whole[1] == pytest.approx(float(a.abs().max()))
    assert whole[2] == pytest.approx(float((a + 2 * b).abs().sum()), rel=1e-6)
    with pytest.raises(ValueError, match="unknown shard operation"):
        parts[0].run([("norm", "x")])


def test_a_pass_counts_each_task_once_and_drops_copies_and_other_passes():
    g = GradientPass(3)
    g.begin(7)
    assert g.add(7, 0, torch.tensor([1.0, 2.0, 3.0]))
    assert g.add(7, 1, torch.tensor([1.0, 0.0, -1.0]))
    assert not g.add(7, 1, torch.tensor([9.0, 9.0, 9.0]))  # a backup's copy of task 1: dropped
    assert not g.add(6, 2, torch.tensor([9.0, 9.0, 9.0]))  # a late copy from the pass before
    mean, tasks = g.finish(4)
    assert tasks == [0, 1] and torch.equal(mean, torch.tensor([0.5, 0.5, 0.5])) and g.dropped == 2
    g.begin(8)  # a new pass starts from nothing
    assert g.add(8, 1, torch.ones(3)) and g.finish(1)[1] == [1]
    with pytest.raises(ValueError, match="has 2 values; the slice 3"):
        g.add(8, 2, torch.ones(2))
    with pytest.raises(ValueError, match="over 0 rows"):
        g.finish(0)


def test_tasks_go_to_whoever_asks_and_the_straggler_gets_a_backup():
    tasks = task_bounds(1000, 300)
    assert tasks == [(0, 300), (300, 600), (600, 900), (900, 1000)]
    h = TaskHandout(tasks)
    assert h.next("slow", 0.0) == 0 and h.next("fast", 0.0) == 1
    assert h.finished(1, "fast", 0.1) and h.rate["fast"] == pytest.approx(3000)
    assert h.next("fast", 0.1) == 2 and h.finished(2, "fast", 0.2)
    assert h.next("fast", 0.2) == 3 and h.finished(3, "fast", 0.25)
    # nothing unstarted: the fast worker backs up the slow one's task, once
    assert h.next("fast", 0.25) == 0 and h.backups == 1
    assert h.next("fast", 0.25) is None  # it is already computing the only unfinished task
    assert h.next("third", 0.25) is None  # max_copies (2) running
    assert h.finished(0, "fast", 0.35) and h.complete
    assert not h.finished(0, "slow", 3.0)  # the straggler's copy came second: it does not count
    assert h.done == {0: "fast", 1: "fast", 2: "fast", 3: "fast"} and h.rate["slow"] == pytest.approx(100)
    with pytest.raises(ValueError):
        task_bounds(0, 10)


def test_the_backup_goes_to_the_task_expected_to_end_last():
    h = TaskHandout(task_bounds(300, 100))
    h.rate.update({"a": 1000.0, "b": 10.0})
    assert [h.next(w, 0.0) for w in ("a", "b", "c")] == [0, 1, 2]  # c never measured: assumed the slowest
    assert h.finished(0, "a", 0.1)
    assert h.next("a", 0.1) == 2  # c's task (no rate: infinite) before b's (ends at 10 s)
    assert h.next("d", 0.1) == 1


class InProcessShards:
    """The shards' side of the pass in this process: each slice's GradientPass and x (what
    ParameterShard runs), reached the way a replica's RayShardClient reaches the real ones."""

    def __init__(self, x: torch.Tensor, bounds):
        self.bounds, self.x = bounds, x.clone()
        self.passes = [GradientPass(hi - lo) for lo, hi in bounds]

    def pull(self, into: torch.Tensor) -> list[int]:
        into.copy_(self.x)
        return [0] * len(self.bounds)

    def add_gradient(self, pass_id, task_id, grad_sum, loss_sum, rows) -> bool:
        return any([p.add(pass_id, task_id, grad_sum[lo:hi], loss_sum, rows)
                    for p, (lo, hi) in zip(self.passes, self.bounds)])

    def task_held(self, pass_id, task_id) -> bool:
        return all(p.pass_id == pass_id and task_id in p.tasks for p in self.passes)


def test_the_mode_s_worker_pushes_one_sum_per_partition_and_a_served_again_partition_counts_once():
    """SandblasterWorker: batches of partitions 0, 0, 1, then (end of segment) partition 1 again
    from a second worker; each shard holds tasks 0 and 1 once, with the gradient of the summed
    loss over their rows, and the pass's loss and rows; the parameters never move."""
    from policies.rules.recipe import Recipe
    from policies.rules.gradient_tasks import SandblasterWorker
    from policies.rules.sharding import FlatParams
    from policies.rules.tasks import Classification

    model, x, y = problem()
    before = [p.detach().clone() for p in model.parameters()]
    flat = FlatParams(list(model.parameters()))
    shards = InProcessShards(flat.params.clone(), [(0, 1000), (1000, flat.numel)])
    batches = [(0, slice(0, 40)), (0, slice(40, 70)), (1, slice(70, 100))]
    where = []
    worker = SandblasterWorker(model, flat, shards, lambda: where[-1], Classification(), Recipe())
    worker.begin_segment(3)
    for part, rows in batches:
        where.append([(part, rows.stop - rows.start)])
        worker.step(x[rows], y[rows])
    assert worker.end_epoch() == {"tasks_pushed": 2, "tasks_counted": 2, "tasks_superseded": 0, "tasks_backup": 0}
    again = SandblasterWorker(model, flat, shards, lambda: [(1, 30)], Classification(), Recipe())
    assert again.fill(3, 1, [(x[70:100], y[70:100])]) is False  # partition 1's first copy is already in
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    want = {}
    for task, rows in ((0, slice(0, 70)), (1, slice(70, 100))):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows], reduction="sum").backward()
        want[task] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    whole = torch.cat([p.sum for p in shards.passes]).float()
    torch.testing.assert_close(whole, want[0] + want[1], rtol=1e-4, atol=1e-4)
    for p in shards.passes:
        pass_id, tasks, loss_sum, rows = p.held()
        assert (pass_id, tasks, rows) == (3, [0, 1], 100) and p.dropped == 1
    full = float(torch.nn.functional.cross_entropy(model(x[:100]), y[:100], reduction="sum"))
    assert loss_sum == pytest.approx(full, rel=1e-5)


class TailReader:
    """What the worker reads of a PartitionReader: the pass's tail flag and the dropped partitions."""

    def __init__(self):
        self.drained, self.dropped, self.backups = False, set(), set()

    def drop(self, partition):
        self.dropped.add(partition)


def test_in_a_pass_s_tail_a_copy_already_in_is_dropped_part_way_and_its_partial_sum_never_pushed():
    """The straggler's partition 2 is backed up by another replica whose whole copy reaches the
    shards first: the straggler, asking at its next step (the pass's tail), drops its partial sum,
    reads no more of the partition and trains nothing more of it; the shards hold task 2 once,
    the backup's sum over all its rows."""
    from policies.rules.recipe import Recipe
    from policies.rules.gradient_tasks import SandblasterWorker
    from policies.rules.sharding import FlatParams
    from policies.rules.tasks import Classification

    model, x, y = problem()
    flat = FlatParams(list(model.parameters()))
    shards = InProcessShards(flat.params.clone(), [(0, 1000), (1000, flat.numel)])
    late_reader, backup_reader = TailReader(), TailReader()
    late = SandblasterWorker(model, flat, shards, lambda: [(2, 20)], Classification(), Recipe(), lambda: late_reader)
    backup = SandblasterWorker(model, flat, shards, lambda: [(2, 20)], Classification(), Recipe(), lambda: backup_reader)
    late.begin_segment(5)
    backup.begin_segment(5)
    assert late.step(x[0:20], y[0:20]).dropped is None  # before the tail: no question asked
    late_reader.drained = backup_reader.drained = True
    backup_reader.backups.add(2)
    for lo in (0, 20, 40):  # the backup copy, whole (it asks once, at its first step: not in yet)
        assert backup.step(x[lo:lo + 20], y[lo:lo + 20]).dropped is None
    assert backup.end_epoch() == {"tasks_pushed": 1, "tasks_counted": 1, "tasks_superseded": 0, "tasks_backup": 1}
    assert backup.end_epoch()["tasks_backup"] == 0  # the pass's next segment (after a pause): counted once
    late.CHECK_S = 0.0
    out = late.step(x[20:40], y[20:40])
    assert out.dropped == 20 and out.rows == 0 and late_reader.dropped == {2}
    assert late.step(x[40:60], y[40:60]).dropped == 20  # the batch cut ahead of the drop: not trained
    assert late.end_epoch() == {"tasks_pushed": 0, "tasks_counted": 0, "tasks_superseded": 1, "tasks_backup": 0}
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x[:60]), y[:60], reduction="sum").backward()
    want = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(torch.cat([p.sum for p in shards.passes]).float(), want, rtol=1e-4, atol=1e-4)
    for p in shards.passes:
        assert p.held()[1] == [2] and p.held()[3] == 60 and p.dropped == 0


def test_a_task_dropped_in_the_tail_and_lost_with_a_rebuilt_shard_is_filled_with_all_its_rows():
    """The straggler drops partition 2 in the pass's tail (the backup's copy is in on every
    shard); then shard 0 dies and is rebuilt without the pass's sums, and the coordinator has the
    straggler compute task 2 again (ModelReplica.gradient_tasks through its PartitionReader's
    `task_batches`): the fill reads the partition whole though this pass dropped it, so the
    rebuilt shard holds task 2 over all its rows; a fill with no rows raises instead of pushing
    an empty sum that would count as the task."""
    from actors.partitions.reader import PartitionReader
    from policies.rules.recipe import Recipe
    from policies.rules.gradient_tasks import SandblasterWorker
    from policies.rules.sharding import FlatParams
    from policies.rules.tasks import Classification

    model, x, y = problem()
    flat = FlatParams(list(model.parameters()))
    shards = InProcessShards(flat.params.clone(), [(0, 1000), (1000, flat.numel)])
    reader = PartitionReader(None, [None] * 3, 0, 20, False, torch.device("cpu"), 5)
    reader.source.seen = {2: {"x": x[:60], "y": y[:60]}}  # mapped already: no object store
    reader.drained = True
    late = SandblasterWorker(model, flat, shards, lambda: [(2, 20)], Classification(), Recipe(), lambda: reader)
    late.begin_segment(5)
    for p in shards.passes:  # the backup's whole copy of task 2 is in
        p.add(5, 2, torch.zeros(p.n), 0.0, 60)
    late.CHECK_S = 0.0
    assert late.step(x[0:20], y[0:20]).dropped == 20 and reader.dropped == {2}
    late.end_epoch()
    shards.passes[0] = GradientPass(shards.passes[0].n)  # shard 0 rebuilt: the pass's sums gone
    assert late.fill(5, 2, reader.task_batches(2)) is True
    assert shards.passes[0].held()[1:] == ([2], pytest.approx(float(torch.nn.functional.cross_entropy(
        model(x[:60]), y[:60], reduction="sum")), rel=1e-5), 60)
    with pytest.raises(RuntimeError, match="task 1 of pass 5 to fill had no rows"):
        late.fill(5, 1, iter(()))
    assert shards.passes[0].held()[1] == [2]


def test_a_grant_answered_after_its_pass_was_left_says_nothing_of_the_next_pass():
    """The helper thread's grant of a pass left part way (an interrupted epoch) comes back during
    the next pass: its "queue is empty" and backup copies are not that pass's tail."""
    import threading


    from actors.partitions.reader import PartitionReader

    late = threading.Event()

    class Reader(PartitionReader):
        def _grant(self, completed, epoch):
            self.calls += 1
            if self.calls == 1:  # pass 1 starts with partition 0; the next grant is asked on the helper thread
                return {"leases": [{"partition": 0, "epoch": 1}], "last": False}
            if self.calls == 2:  # pass 1's second grant: answered only once pass 2 is under way
                assert late.wait(10)
                return {"leases": [{"partition": 1, "epoch": 1, "backup": True}], "last": True, "drained": True}
            return {"leases": [{"partition": 1, "epoch": 2}], "last": True}  # pass 2: a plain grant

    reader = Reader(object(), [None, None], rank=0, batch_size=2, shuffle=False, device=torch.device("cpu"), timeout_s=5)
    reader.source.seen = {0: {"rows": 0}, 1: {"rows": 1}}  # mapped already: no object store
    first = reader.partitions()
    assert next(first)[0]["partition"] == 0
    first.close()  # the pass is left (its grant still out)
    second = reader.partitions()
    assert next(second)[0]["partition"] == 1
    late.set()
    reader.prefetch.shutdown(wait=True)
    assert not reader.drained and not reader.backups


def test_tasks_smaller_than_a_partition_read_every_row_once_each_a_slice_of_its_partition():
    """strategy.task_rows: partitions of 45 and 30 rows cut into tasks of 20 rows, (p, lo, hi)
    in turn; a reader given that table reads each leased task as its own slice of its partition
    (shuffled within it), so the pass's tasks together read every row once, and a task computed
    outside the pass (a fill) reads its slice whole; a table that does not fit the partition is
    a one-line error, never a short task."""
    from actors.partitions.reader import PartitionReader
    from policies.rules.gradient_tasks import partition_tasks

    tasks = partition_tasks([45, 0, 30], 20)
    assert tasks == [(0, 0, 20), (0, 20, 40), (0, 40, 45), (2, 0, 20), (2, 20, 30)]
    parts = {0: {"x": torch.arange(45.0)[:, None], "y": torch.arange(45)},
             2: {"x": torch.arange(100.0, 130.0)[:, None], "y": torch.arange(100, 130)}}
    reader = PartitionReader(None, [None] * 3, 0, 8, True, torch.device("cpu"), 5, tasks=tasks)
    seen = []
    for i, (p, lo, hi) in enumerate(tasks):
        got = [[int(v) for v in y] for _, y, _ in reader.batches({"partition": i, "seed": 7 + i}, parts[p])]
        rows = [v for batch in got for v in batch]
        assert sorted(rows) == [int(v) for v in parts[p]["y"][lo:hi]]  # the slice, each row once
        seen += rows
    assert sorted(seen) == list(range(45)) + list(range(100, 130))
    first = [int(v) for _, y, _ in reader.batches({"partition": 1, "seed": 8}, parts[0]) for v in y]
    assert first != sorted(first)  # shuffled within the task
    reader.source.seen = {2: parts[2]}  # mapped already: no object store
    reader.drop(4)  # dropped in the pass's tail: a fill still reads it whole
    assert sorted(int(v) for _, y in reader.task_batches(4) for v in y) == list(range(120, 130))
    with pytest.raises(RuntimeError, match=r"task 3 is rows \[0, 20\) of partition 2, which has 10"):
        list(reader.batches({"partition": 3, "seed": 0}, {"x": torch.zeros(10, 1), "y": torch.zeros(10)}))


def test_a_partition_s_tasks_taken_one_after_another_read_it_once():
    """With tasks cut from partitions, a partition is let go once a task of another partition
    starts (or the pass ends), not after each task: tasks 0 and 1 of partition 0 come in two
    grants (the second asked for while task 0 trains) and partition 0 is read and let go once;
    then task 2 of partition 1."""
    from actors.partitions.reader import PartitionReader

    class Source:
        def __init__(self):
            self.calls = []

        def new_pass(self):
            pass

        def request(self, partitions):
            pass

        def want(self, partition, upcoming):
            pass

        def get(self, partition):
            if not self.calls or self.calls[-1] != ("get", partition):
                self.calls.append(("get", partition))
            return {"x": torch.zeros(4, 1), "y": torch.zeros(4)}

        def release(self, partition):
            self.calls.append(("release", partition))

    class Reader(PartitionReader):
        def _grant(self, completed, epoch):
            self.calls += 1
            grants = {1: [0], 2: [1, 2], 3: []}
            return {"leases": [{"partition": t, "epoch": 1, "rows": 2} for t in grants[self.calls]],
                    "last": self.calls >= 2}

    reader = Reader(object(), [None, None], rank=0, batch_size=2, shuffle=False, device=torch.device("cpu"),
                    timeout_s=5, tasks=[(0, 0, 2), (0, 2, 4), (1, 0, 2)])
    reader.source = Source()
    assert [lease["partition"] for lease, _ in reader.partitions()] == [0, 1, 2]
    reader.prefetch.shutdown(wait=True)
    assert reader.source.calls == [("get", 0), ("release", 0), ("get", 1), ("release", 1)]
