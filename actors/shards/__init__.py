"""Parameter shards: the ParameterShard actor and a replica's client to them."""
