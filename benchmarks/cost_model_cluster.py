"""The cost model against measured samples/s on a `ray.cluster_utils.Cluster` of 3 nodes: the
runs and the two calibrations of `benchmarks/cost_model.py` (its docstring), the measured runs
on a 0-CPU head and two worker nodes of 2 logical CPUs each.

    python benchmarks/cost_model_cluster.py [--quick] [--json PATH]
"""
from __future__ import annotations

from cost_model import main

if __name__ == "__main__":
    main(nodes=3)
