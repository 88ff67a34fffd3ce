"""Benchmarks of isojax; run each from the repository root as `python -m bench.NAME`."""
