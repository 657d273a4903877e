"""The actors as the driver holds them: replicas, shards, the partition server, the pause gate, the cluster."""
