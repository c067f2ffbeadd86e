"""Tensor parallelism on CPU processes: rank 0 schedules and sends each step's plan, every rank runs
its shard of the model, and the ranks all-reduce (``tensor_parallel``)."""
