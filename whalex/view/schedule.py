"""A pipeline schedule that prints as its picture: `print(plan.schedule)` draws stages x ticks.

`ScheduleView` is the lowering's `Schedule` (same fields, same validation) with a text picture for
`str()` and a one-line `repr()`; the Plan holds its schedule as one.
"""
from __future__ import annotations

from whalex.lowering.schedules import Schedule, render


class ScheduleView(Schedule):
    """`str()`: one row per stage, one column per tick (F3: forward of micro-batch 3, B3: its
    backward, ..: idle); `repr()`: name, size, ticks and bubble on one line."""

    def __str__(self) -> str:
        head = (f"{self.name} schedule: {self.num_stages} stages, {self.num_micro_batch} micro-batches, "
                f"{self.num_ticks} ticks, bubble {self.bubble_fraction:.1%}")
        return head + "\n" + render(self)

    def __repr__(self) -> str:
        return (f"Schedule({self.name!r}, stages={self.num_stages}, micro_batches={self.num_micro_batch}, "
                f"ticks={self.num_ticks}, bubble={self.bubble_fraction:.1%})")

    def __eq__(self, other):
        if isinstance(other, Schedule):
            return (self.name, self.num_stages, self.num_micro_batch, self.ticks) == \
                (other.name, other.num_stages, other.num_micro_batch, other.ticks)
        return NotImplemented

    __hash__ = Schedule.__hash__


def as_view(schedule: Schedule | None) -> ScheduleView | None:
    if schedule is None or isinstance(schedule, ScheduleView):
        return schedule
    return ScheduleView(schedule.name, schedule.num_stages, schedule.num_micro_batch, schedule.ticks)
