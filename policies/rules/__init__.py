"""The worker-side update rules and the training step: what a replica runs (no Ray)."""
