"""`python -m orchestrator`: the command line, the config reference it generates, the cost-model simulator."""
