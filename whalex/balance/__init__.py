"""Hardware-aware balance: profiling (FLOPs), Algorithm 1 and the cost model, automatic pipeline
partitioning, device calibration and refinement of a split on the real step."""
