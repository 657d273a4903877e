"""Keep a training process's freed C heap for its next step instead of handing it back to the
kernel each time.

glibc's malloc gives the top of its heap back to the kernel once more than M_TRIM_THRESHOLD
bytes are free there, and serves any allocation of at least M_MMAP_THRESHOLD bytes with a fresh
mapping that is unmapped when freed. Both thresholds start low (128 KiB) and move with what the
process frees. In a replica they stayed low enough that a step's activations (tens of MB for
the example CNN) were given back at the end of every backward pass and faulted in again, one
zeroed page at a time, at the next forward pass: 14,000-86,000 minor page faults a second per
replica; with the thresholds fixed, 6-641, and steady samples/s 1.168x in an A/B of the two
(benchmarks/results/HISTORY.md, 2026-11-26; docs/cost-model.md, "Where it stops being
trustworthy").

`keep_heap` fixes the thresholds: allocations up to 32 MiB (the largest glibc allows here) come
from the heap, and up to 1 GiB of free heap is kept for reuse. A replica's resident memory then
stays near its peak rather than falling back between steps; the peak itself is what its work
needs either way. Other C libraries (macOS, musl) have no such thresholds: nothing is changed.
"""
from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
TRIM_BYTES = 1 << 30
MMAP_BYTES = 32 << 20


def keep_heap() -> bool:
    """Fix glibc's trim and mmap thresholds for this process (see the module docstring).
    Returns whether both were set (False: not Linux, or no glibc that takes them)."""
    return _thresholds(TRIM_BYTES, MMAP_BYTES)


def return_big_buffers() -> bool:
    """The other way round, for fsdp's replicas on the CPU: every allocation of 1 MiB or more
    gets a mapping of its own, unmapped when freed, and free heap above 1 MiB is trimmed. A
    sharded step makes and frees a unit's gathered parameters and gradients several times (tens
    of MB each): kept in the heap (keep_heap, or glibc's own thresholds, which rise to the
    largest block freed) they held a replica's resident memory at ~8 x the model's bytes above
    its slices (2 replicas, a 51 MB model: 850 MB against 422), creeping up step by step; given
    back, it stays at the slices plus about a unit. The price is time: every step faults its
    buffers in afresh (2.7x the step there; docs/benchmarks.md, "fsdp_memory"). fsdp exists for
    models that do not fit, so memory comes first."""
    return _thresholds(1 << 20, 1 << 20)


def _thresholds(trim_bytes: int, mmap_bytes: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    trim = mallopt(M_TRIM_THRESHOLD, trim_bytes)
    mmap = mallopt(M_MMAP_THRESHOLD, mmap_bytes)
    return bool(trim) and bool(mmap)
