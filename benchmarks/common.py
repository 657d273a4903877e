"""Shared benchmark plumbing: environment facts, the JSON contract, a small table, medians."""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import hashlib
import platform
import statistics
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


# each mode's mnist example (examples/) and what it sets on it: a mode without an example of its
# own runs allreduce's with strategy.mode set
MODE_EXAMPLES = {"allreduce": ("mnist_allreduce.yaml", []), "downpour": ("mnist_downpour.yaml", []),
                 "easgd": ("mnist_easgd.yaml", []), "local_sgd": ("mnist_local_sgd.yaml", []),
                 "hogwild": ("mnist_hogwild.yaml", []), "gossip": ("mnist_allreduce.yaml", ["strategy.mode=gossip"]),
                 "fsdp": ("mnist_allreduce.yaml", ["strategy.mode=fsdp"]),
                 "sandblaster": ("mnist_allreduce.yaml", ["strategy.mode=sandblaster"])}


def mode_example(mode: str) -> tuple[str, list[str]]:
    """`mode`'s example (its path) and the settings that make it that mode."""
    example, sets = MODE_EXAMPLES[mode]
    return os.path.join(REPO, "examples", example), list(sets)


def example_text(mode: str) -> str:
    """`mode`'s example as a results file records it: `examples/<file> [setting ...]`."""
    example, sets = MODE_EXAMPLES[mode]
    return " ".join([f"examples/{example}", *sets])


def parse_args(description: str, extra: tuple = ()) -> argparse.Namespace:
    """--quick, --json PATH, and `extra` (flag, add_argument keywords) pairs."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="finish in about 3 minutes on 2 cores")
    p.add_argument("--json", metavar="PATH", help="write results (BENCHMARKS.md contract) to PATH")
    for flag, kwargs in extra:
        p.add_argument(flag, **kwargs)
    return p.parse_args()


def code_version() -> dict[str, Any]:
    """The code a run measured: the git commit, whether the work tree differed from it (the
    results directory aside: runs write there), and a digest of that difference, so runs of the
    same uncommitted code can be told from runs of other uncommitted code."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, check=True).stdout

    outside_results = ["--", ".", ":(exclude)benchmarks/results"]
    try:
        commit = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain", "--untracked-files=all", *outside_results)
        diff = git("diff", "HEAD", *outside_results)
    except (OSError, subprocess.CalledProcessError):
        return {"git_commit": None, "git_dirty": None, "git_diff_sha1": None}
    untracked = sorted(line[3:] for line in status.splitlines() if line.startswith("??"))
    digest = hashlib.sha1(diff.encode())
    for path in untracked:  # new files count as part of the code too
        full = os.path.join(REPO, path)
        if os.path.isfile(full):
            digest.update(path.encode() + open(full, "rb").read())
    return {"git_commit": commit, "git_dirty": bool(status.strip()),
            "git_diff_sha1": digest.hexdigest() if status.strip() else None}


def environment() -> dict[str, Any]:
    import ray
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__,
            "cores": os.cpu_count(), "machine": platform.machine(),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **code_version()}


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def report(name: str, quick: bool, results: dict[str, Any], ratios: dict[str, float], path: str | None) -> None:
    width = max(len(k) for k in ratios) if ratios else 10
    print(f"\n{name} ({'quick' if quick else 'full'})")
    for key, value in ratios.items():
        print(f"  {key:<{width}}  {value:6.3f}x")
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"benchmark": name, "quick": quick, "env": environment(), "results": results,
                       "ratios": ratios}, f, indent=2)
        print(f"  wrote {path}")


def ray_train_worker(partitions: int, seed: int, lr: float, momentum: float, log_dir: str, **log_fields: Any):
    """Inside a Ray Train worker of a benchmark against Ray Train: the data cut as our replicas
    cut it (`partitions` partitions of mnist5k, this rank's slice of the test split), the same
    CNN and seed, restored from `ray.train.get_checkpoint()` when there is one, wrapped by
    `prepare_model`, SGD as our replicas run it, and a line-buffered log in `log_dir` opened with
    a first line saying who and where from (plus `log_fields`). Returns a SimpleNamespace."""
    import time
    from types import SimpleNamespace

    import ray.train
    import torch
    from ray.train.torch import prepare_model

    from examples.models import mnist_cnn
    from orchestrator.data.in_memory import eval_slices, load_source, partition

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    pid = os.getpid()
    d = load_source("builtin:mnist5k")
    parts = partition(d.train, partitions, seed)
    tensors = [(torch.from_numpy(p.x), torch.from_numpy(p.y)) for p in parts]
    lo, hi = eval_slices(len(d.test), world)[rank]
    torch.manual_seed(seed)
    net = mnist_cnn()
    done_epochs, step, opt_state = 0, 0, None
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as path:
            state = torch.load(os.path.join(path, "state.pt"), weights_only=True)
        net.load_state_dict(state["model"])
        done_epochs, step, opt_state = state["epoch"], state["step"], state["optimizer"]
    model = prepare_model(net)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    log = open(os.path.join(log_dir, f"rank{rank}-pid{pid}.log"), "a", buffering=1)
    log.write(json.dumps({"pid": pid, "rank": rank, **log_fields, "t_start": time.time(), "resume_step": step,
                          "resume_epoch": done_epochs}) + "\n")
    return SimpleNamespace(rank=rank, world=world, tensors=tensors, sizes=[len(p) for p in parts],
                           tx=torch.from_numpy(d.test.x[lo:hi]), ty=torch.from_numpy(d.test.y[lo:hi]), net=net,
                           model=model, opt=opt, done_epochs=done_epochs, step=step, log=log)


class LineTail:
    """The complete lines added to the Ray Train workers' step files (`rank*-pid*.log` in a
    directory) since the last call, a partial last line kept for the next."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self._offsets: dict[str, int] = {}
        self._partial: dict[str, str] = {}

    def new_lines(self) -> list[tuple[str, str]]:
        """(file, line) of every new non-empty complete line."""
        import glob

        out = []
        for path in glob.glob(os.path.join(self.log_dir, "rank*-pid*.log")):
            with open(path, encoding="utf-8") as f:
                f.seek(self._offsets.get(path, 0))
                chunk = f.read()
                self._offsets[path] = f.tell()
            lines = (self._partial.pop(path, "") + chunk).split("\n")
            if lines[-1]:
                self._partial[path] = lines[-1]
            out += [(path, line) for line in lines[:-1] if line]
        return out
