"""Pipeline schedules live in `whalex.core.schedules` (plain data the planner makes, lowering runs
and the Plan's view draws); this name stays for the code that imports them from lowering."""
from whalex.core.schedules import BWD, FWD, IDLE, SCHEDULES, Schedule, Task, astuple, make_schedule, render, stage_order  # noqa: F401
