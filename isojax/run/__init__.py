"""A run's orchestration: measure (isojax.measure), the loop, results and their manifest, sweeps, and
the output folder's commit protocol (outdir, atomic)."""
