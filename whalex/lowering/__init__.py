"""Carrying out a plan: sharding patterns and bridges, pipeline schedules, the step programs
(GSPMD, uneven data parallel, pipeline) and the emission of shardings / shard_map / jit. Every
decision (balance, stages, memory options) arrives from the planner; nothing here decides one."""
