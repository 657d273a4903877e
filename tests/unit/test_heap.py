"""actors/replica/heap.py: with the thresholds fixed, memory a step frees is reused by the next step
instead of being given back and faulted in again. Each case runs in a fresh process (the
thresholds are process-wide), allocating and freeing a step's worth of 8 MB arrays 20 times
(numpy takes them straight from malloc; the effect on a replica's steps is measured by
benchmarks/throughput.py, docs/benchmarks.md)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

STEPS = """
import json, resource, sys
import numpy as np
from actors.replica.heap import keep_heap
kept = keep_heap() if sys.argv[1] == "keep" else None
def step():
    xs = [np.ones(2 * 2**20, dtype=np.float32) for _ in range(5)]  # 5 x 8 MB, as a forward pass's activations
    return sum(float(x[-1]) for x in xs)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def steps_faults(kind: str) -> dict:
    out = subprocess.run([sys.executable, "-c", STEPS, kind], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the thresholds are glibc's (Linux)")
def test_freed_step_memory_is_reused_not_faulted_in_again():
    kept = steps_faults("keep")
    default = steps_faults("default")
    assert kept["kept"] is True
    pages = 20 * 5 * 8 * 2**20 // 4096  # what 20 steps would fault in if nothing were reused
    assert kept["faults"] < pages // 100, kept
    # the default thresholds give the pages back and fault them in again: the case the fix is for
    assert default["faults"] > pages // 10, default
