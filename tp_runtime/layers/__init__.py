"""Tensor-parallel building blocks. Each parameter carries a `weight_loader` that takes its own shard."""
