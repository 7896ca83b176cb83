"""Carrying out a plan: the step programs (GSPMD `step`, uneven data parallel `uneven`, the uneven
split head `uneven_split` and hybrid `uneven_hybrid`, the `pipeline` package) and what they share:
the emission of the update, shardings, shard_map and jit (`emit`), states in the caller's layout
(`caller_layout`), padded split dimensions, stage rows and batches, stored vjps. Every decision
(sharding patterns, schedule, balance, stages, memory options) arrives from the planner; nothing here
decides one."""
