"""The partition server and a replica's side of it: leases, reading planned files and torch Datasets, decoding."""
