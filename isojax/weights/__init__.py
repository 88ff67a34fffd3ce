"""The weights command (python -m isojax.weights: command), the matrix metrics (isotropy) and matrix
files (matrix_files)."""
