"""The Pool engine, both ends: the owner dispatching chunks and collecting
results, the loops on the workers, and the slot processes that run them."""
