"""Sweeps: a grid or random search over any config keys with Ray Tune, tracked as nested MLflow runs.

`python -m orchestrator sweep SWEEP.yaml` or `run_sweep(path_or_SweepConfig)`. The sweep file
names a base job config and a search space over dotted config keys; every trial is one
`ElasticTrainer.fit()` inside a Tune function trainable, in a placement group sized from the
trial's own config (so a sweep never asks the cluster for more than it has: trials that do not
fit together wait their turn). The driver opens one parent MLflow run; each trial is a child
run (tag `mlflow.parentRunId`) in the same experiment. At the end the parent gets a comparison
table and a plot of test accuracy against wall-clock seconds, per trial. See docs/sweeps.md.
"""
from orchestrator.sweep.driver import absolute_uri, run_sweep
from orchestrator.sweep.schema import AshaConfig, SearchSpace, SweepConfig, SweepPlan, load_sweep, plan_sweep
from orchestrator.sweep.summary import SweepResult, comparison_csv, comparison_markdown, plot_metric
from orchestrator.sweep.trial import ends_the_run, trial_resources

__all__ = ["AshaConfig", "SearchSpace", "SweepConfig", "SweepPlan", "SweepResult", "absolute_uri", "comparison_csv",
           "comparison_markdown", "ends_the_run", "load_sweep", "plan_sweep", "plot_metric", "run_sweep",
           "trial_resources"]
