"""Run every benchmark (quick with --quick), write benchmarks/results/<name>.json and
benchmarks/results/summary.md (the table docs/benchmarks.md shows).

    python benchmarks/run_all.py [--quick]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    names = sorted(os.path.basename(f)[:-3] for f in glob.glob(os.path.join(HERE, "*.py"))
                   if os.path.basename(f) not in ("run_all.py", "common.py"))
    failed = []
    for name in names:
        out = os.path.join(RESULTS, f"{name}.json")
        cmd = [sys.executable, os.path.join(HERE, f"{name}.py"), "--json", out] + (["--quick"] if args.quick else [])
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        if subprocess.run(cmd).returncode != 0:
            failed.append(name)
    write_summary()
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def write_summary() -> None:
    lines = ["| benchmark | ratio (higher is better for us) | value | quick | date | cores |", "|---|---|---|---|---|---|"]
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        data = json.load(open(path))
        for key, value in data["ratios"].items():
            lines.append(f"| {data['benchmark']} | {key} | {value:.3f} | {data['quick']} | "
                         f"{data['env']['date'][:10]} | {data['env']['cores']} |")
    with open(os.path.join(RESULTS, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
