"""A schedule as text: one row per stage, one column per tick."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from whalex.records.schedules import Schedule


def render(schedule: Schedule) -> str:
    """A text picture: one row per stage, one column per tick (F3: the forward of micro-batch 3,
    B3 its backward, W3 a split backward's weight gradient; with virtual stages a cell names the chunk
    too: F3c5 is the forward of micro-batch 3 through chunk 5)."""
    rows, V = [], schedule.virtual_stages
    for s in range(schedule.num_stages):
        cells = [(f"{r[s].kind}{r[s].microbatch}" + (f"c{r[s].chunk}" if V > 1 else "") if r[s] else "..")
                 for r in schedule.ticks]
        head = f"stage {s}" + (f" (chunks {','.join(map(str, schedule.chunks_of(s)))})" if V > 1 else "")
        rows.append(f"{head}: " + " ".join(f"{c:>{5 if V > 1 else 3}}" for c in cells))
    return "\n".join(rows)
