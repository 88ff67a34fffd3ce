"""The only layer that asks JAX about devices and processes: the mesh and shardings (mesh), the step
runner and memory planning (runner), checkpoints of the accumulators (checkpoints)."""
