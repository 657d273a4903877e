"""The checkpoint keeper: the newest checkpoint held in memory, outliving the driver (checkpoint.in_memory)."""
