"""The statistics: double-float accumulators and per-token sums (accumulators), the state sample
(sample), the float64 read-out (finalize), intrinsic dimension (intrinsic)."""
