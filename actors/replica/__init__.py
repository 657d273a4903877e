"""ModelReplica: one model copy in a Ray actor, its epoch loop, its reducer and learning rate."""
