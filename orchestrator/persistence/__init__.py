"""What outlives a run: checkpoints, the run's position in them, resuming, the final MLflow model."""
