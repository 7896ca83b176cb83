"""The captured loss cut into stages: the record the planner decides (`whalex.planner.stage_cut`) and
the pipeline carries out."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class StageCut:
    """The captured loss cut into stages: equations, parameters, and what crosses each boundary."""

    eqns: tuple[tuple[int, ...], ...]          # top-level equation indices per stage
    params: tuple[tuple[int, ...], ...]        # parameter leaves per stage (a tied leaf in each stage reading it)
    boundaries: tuple[tuple[Any, ...], ...]    # vars sent from stage k to k+1, k < S-1

    @property
    def num_stages(self) -> int:
        return len(self.eqns)

    def live_in(self, s: int) -> tuple:
        """The values stage s receives from stage s - 1 (none for the first)."""
        return self.boundaries[s - 1] if s > 0 else ()

    def live_out(self, s: int, outvars: Sequence[Any]) -> tuple:
        """The values stage s sends on; the last stage's are the loss's outputs `outvars`."""
        return self.boundaries[s] if s < self.num_stages - 1 else tuple(outvars)
