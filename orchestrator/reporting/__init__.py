"""What a run tells: MLflow tracking, events, the progress display, the plot, the result."""
