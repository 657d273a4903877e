"""Test tooling shipped for tests, the soak and benchmarks: fault injection, a local autoscaling cluster."""
