"""Example datasets written to Parquet from installed packages (nothing is downloaded):

    python -m examples.datasets regression runs/data/regression   # scikit-learn's Friedman #1
    python -m examples.datasets tiny_lm runs/data/tiny_lm         # the stdlib's pydoc topics text
    python -m examples.datasets all runs/data                     # both, under one directory

Each writes a directory of several Parquet files with several row groups, the shape a real
training set has, for examples/regression.yaml and examples/tiny_lm.yaml to stream from.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

CONTEXT = 64  # tokens a tiny_lm model sees; each row holds CONTEXT + 1 bytes (inputs and the next byte)


def _write(table: pa.Table, path: str, files: int, row_group_rows: int) -> str:
    os.makedirs(path, exist_ok=True)
    for i, lo in enumerate(np.linspace(0, table.num_rows, files + 1).astype(int)[:-1]):
        hi = int(np.linspace(0, table.num_rows, files + 1).astype(int)[i + 1])
        pq.write_table(table.slice(lo, hi - lo), os.path.join(path, f"part-{i:03d}.parquet"), row_group_size=row_group_rows)
    return path


def write_regression(path: str, rows: int = 20_000, seed: int = 0) -> str:
    """Friedman #1 (scikit-learn): y = 10 sin(pi x1 x2) + 20 (x3 - 0.5)^2 + 10 x4 + 5 x5 + noise
    over 10 uniform features (5 of them irrelevant): a `features` column (10 float32 as a
    fixed-size list) and a float `target` column (standardized: mean 0, variance 1). With unit
    noise the best possible R^2 is ~0.96."""
    from sklearn.datasets import make_friedman1

    x, y = make_friedman1(n_samples=rows, n_features=10, noise=1.0, random_state=seed)
    x = x.astype(np.float32)
    y = (y - y.mean()) / y.std()  # standardized, as one would prepare a target for SGD (R^2 does not change)
    features = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])
    return _write(pa.table({"features": features, "target": pa.array(y.astype(np.float32))}), path, 4, 2_500)


def text_corpus() -> bytes:
    """~0.46 MB of English: the Python documentation's topics, as shipped with the standard
    library (pydoc_data.topics), as ASCII (the few other characters become '?')."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("ascii", errors="replace")


def write_text(path: str, context: int = CONTEXT) -> str:
    """The corpus cut into rows of context + 1 bytes (a `text` binary column): a row's first
    `context` bytes are the inputs, each next byte the target (examples/text.py decodes them)."""
    data = text_corpus()
    n = (len(data) - 1) // context
    rows = [data[i * context : i * context + context + 1] for i in range(n)]
    rows = [r for r in rows if len(r) == context + 1]
    return _write(pa.table({"text": pa.array(rows, pa.binary())}), path, 2, 1_000)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("regression", "tiny_lm", "all"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    kind, path = argv
    if kind in ("regression", "all"):
        print("wrote", write_regression(os.path.join(path, "regression") if kind == "all" else path))
    if kind in ("tiny_lm", "all"):
        print("wrote", write_text(os.path.join(path, "tiny_lm") if kind == "all" else path))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
