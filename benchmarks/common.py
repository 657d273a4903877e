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


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="finish in about 3 minutes on 2 cores")
    p.add_argument("--json", metavar="PATH", help="write results (BENCHMARKS.md contract) to PATH")
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
