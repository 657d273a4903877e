"""The decisions the controller asks for: failure, stop, switch, scaling, checkpoints, leases, learning-rate rules, the cost model (pure, no Ray)."""
