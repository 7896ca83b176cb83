"""Carrying out a plan: sharding patterns and bridges, pipeline schedules, the step programs
(GSPMD, uneven data parallel, pipeline) and the emission of shardings / shard_map / jit. Every
decision (balance, stages, memory options) arrives from the planner; nothing here decides one."""
import sys

from whalex.core import capture, interpret, parts, random_rows

# Old import paths (whalex.lowering.capture, ...): these modules moved down to whalex.core; the
# aliases keep code written against the old paths importing. whalex itself uses whalex.core.
for _module in (capture, interpret, parts, random_rows):
    sys.modules[f"{__name__}.{_module.__name__.rsplit('.', 1)[1]}"] = _module
del _module
