"""Hardware-aware balance: profiling (FLOPs, memory), Algorithm 1 and the cost model, memory fit,
automatic pipeline partitioning, device calibration and refinement of a split on the real step."""
