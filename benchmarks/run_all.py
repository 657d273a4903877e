"""Run every benchmark, keep every run's JSON, and summarise all runs of the current code.

    python benchmarks/run_all.py [--quick] [--repeat N] [--only NAME ...] [--summary-only]

Each run of a benchmark writes benchmarks/results/runs/<name>-<commit>-<UTC timestamp>.json
(<commit>: the first 7 digits of the code's git commit, "-dirty" after it when the work tree
differed from it); nothing else is written per run. benchmarks/results/summary.md is then
regenerated: for every ratio, the median over all recorded runs of the current code with the
min-max range and the number of runs: the current code is the newest run's (git commit,
uncommitted-difference digest), runs of any other code are left out, and quick and full runs
are summarised apart. `make bench` runs this with --quick; run it three times (or once with
--repeat 3) on the final code before quoting figures (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict

from common import code_version

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
RUNS = os.path.join(RESULTS, "runs")


def benchmark_names() -> list[str]:
    return sorted(os.path.basename(f)[:-3] for f in glob.glob(os.path.join(HERE, "*.py"))
                  if os.path.basename(f) not in ("run_all.py", "common.py", "gpu_check.py"))  # gpu_check: a check, not a benchmark


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="each benchmark in quick mode (about 3 minutes)")
    p.add_argument("--repeat", type=int, default=1, metavar="N", help="run the whole set N times (default 1)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks")
    p.add_argument("--summary-only", action="store_true", help="rewrite summary.md from the recorded runs")
    args = p.parse_args()
    names = benchmark_names()
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            p.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(names)}")
        names = [n for n in names if n in args.only]
    os.makedirs(RUNS, exist_ok=True)
    failed = []
    if not args.summary_only:
        for rep in range(1, args.repeat + 1):
            for name in names:
                stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
                out = os.path.join(RUNS, f"{name}-{code_tag()}-{stamp}.json")
                cmd = [sys.executable, os.path.join(HERE, f"{name}.py"), "--json", out] + (["--quick"] if args.quick else [])
                print(f"== [{rep}/{args.repeat}] {name}: {' '.join(cmd)}", flush=True)
                if subprocess.run(cmd).returncode != 0 or not os.path.exists(out):
                    failed.append(f"{name} (repeat {rep})")
    print(write_summary())
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def code_tag() -> str:
    """The code a run measures, for its file name: the commit's first 7 digits, "-dirty" when the
    work tree differs from it (benchmarks/results aside), "nogit" outside a git checkout."""
    code = code_version()
    return (code["git_commit"] or "nogit")[:7] + ("-dirty" if code["git_dirty"] else "")


def load_runs() -> list[dict]:
    runs = []
    for path in sorted(glob.glob(os.path.join(RUNS, "*.json"))):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        data["_file"] = os.path.relpath(path, RESULTS)
        runs.append(data)
    return runs


def code_key(run: dict) -> tuple:
    env = run["env"]
    return env.get("git_commit"), env.get("git_dirty"), env.get("git_diff_sha1")


def fmt(value: float) -> str:
    return f"{value:.3f}"


def write_summary() -> str:
    """summary.md: per benchmark, mode (quick/full) and ratio, the median over the runs of the
    newest code that ran that benchmark (a benchmark not rerun after a change keeps its last
    code's runs, and says which code that was), min-max, and every run's value in the order
    they ran."""
    runs = [r for r in load_runs() if r["env"].get("git_commit")]
    lines = ["# Benchmark summary", ""]
    if not runs:
        lines.append("No recorded runs yet: `make bench` (or `python benchmarks/run_all.py --quick`).")
    else:
        current = []
        for bench in sorted({r["benchmark"] for r in runs}):
            mine = [r for r in runs if r["benchmark"] == bench]
            newest = max(mine, key=lambda r: r["env"]["date"])
            current += [r for r in mine if code_key(r) == code_key(newest)]
        env = max(runs, key=lambda r: r["env"]["date"])["env"]
        lines += [
            f"Runs summarised: {len(current)} of {len(runs)} recorded: per benchmark, the runs of the newest code "
            "that ran it (the `code` column; `+` marks uncommitted changes); runs of older code are left out.",
            f"Machine: {env['machine']}, {env['cores']} cores; Python {env['python']}, torch {env['torch']}, "
            f"Ray {env['ray']}.",
            "Each value is the median over the runs of that benchmark (each run's ratio is itself what the "
            "benchmark reports, see docs/benchmarks.md); the range is the lowest and highest run; "
            "higher is better for this project.",
            "Rerun: `make bench` (= `python benchmarks/run_all.py --quick`); `--repeat N` runs the set N times.",
            "",
            "| benchmark | code | mode | ratio (higher is better for us) | median | min-max | runs | every run |",
            "|---|---|---|---|---|---|---|---|",
        ]
        groups: dict[tuple, list[dict]] = defaultdict(list)
        for r in sorted(current, key=lambda r: r["env"]["date"]):
            groups[(r["benchmark"], "quick" if r["quick"] else "full")].append(r)
        for (bench, mode), rs in sorted(groups.items()):
            code = rs[-1]["env"]["git_commit"][:7] + ("+" if rs[-1]["env"]["git_dirty"] else "")
            keys = list(dict.fromkeys(k for r in rs for k in r["ratios"]))
            for key in keys:
                values = [r["ratios"][key] for r in rs if r["ratios"].get(key) is not None]
                if not values:
                    continue
                lines.append(f"| {bench} | `{code}` | {mode} | {key} | **{fmt(statistics.median(values))}** | "
                             f"{fmt(min(values))}-{fmt(max(values))} | {len(values)} of {len(rs)} | "
                             f"{', '.join(fmt(v) for v in values)} |")
        lines += ["", "Runs summarised:", ""]
        lines += [f"- `{r['_file']}` ({r['benchmark']}, {'quick' if r['quick'] else 'full'}, {r['env']['date']})"
                  for r in sorted(current, key=lambda r: r["env"]["date"])]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(RESULTS, "summary.md"), "w", encoding="utf-8") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
