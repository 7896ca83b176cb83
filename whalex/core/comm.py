"""`Comm`: one collective a plan implies (written by the sharding patterns, ZeRO and the planner,
read by the Plan's views)."""
from __future__ import annotations

import dataclasses

Axes = tuple  # tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Comm:
    """One collective the plan implies, with its per-device traffic in bytes (ring algorithm)."""

    taskgraph: int
    kind: str            # all-reduce | all-gather | reduce-scatter | all-to-all
    axes: Axes
    bytes: float
    reason: str
