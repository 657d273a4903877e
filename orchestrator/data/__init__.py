"""A job's data on the driver: in-memory datasets, file sources planned from metadata, torch Datasets, placement."""
