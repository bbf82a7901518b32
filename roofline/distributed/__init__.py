"""Tensor parallelism: the parallel context, sharded layers and loaders, and the executors that
run one worker per rank (in-process, ``mp`` processes, Ray actors)."""
