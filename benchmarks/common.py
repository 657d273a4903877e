"""Shared benchmark plumbing: environment facts, the JSON contract, a small table, medians."""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
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


def environment() -> dict[str, Any]:
    import ray
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__,
            "cores": os.cpu_count(), "machine": platform.machine(),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


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
