"""The sharding patterns' decisions as plain records: made by the planner
(`whalex.planner.patterns`), carried out by lowering, shown by the Plan and its views, so that none
of them imports another for its types."""
from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from whalex.records.comm import Axes, Comm


@dataclasses.dataclass(frozen=True)
class PatternChoice:
    """Which sharding pattern a ShardingUnit got, and what each candidate would have cost."""

    taskgraph: int
    unit: str            # matmul | embedding
    param: str
    pattern: str
    costs: tuple[tuple[str, float], ...]


@dataclasses.dataclass(frozen=True)
class Coverage:
    """One parameter a split TaskGraph reads, and the layout it got; `note` says why a parameter
    was left whole (no sharding pattern matched the operation that reads it)."""

    taskgraph: int
    strategy: str            # "split(4)"
    param: str
    shape: tuple[int, ...]
    spec: P
    note: str = ""

    @property
    def left_whole(self) -> bool:
        """A matrix (or larger) the split leaves whole on every device: compute and memory not divided."""
        return self.spec == P() and len(self.shape) >= 2


@dataclasses.dataclass(frozen=True)
class ExpertCall:
    """An MoE experts call run expert-parallel: groups over `token_axes`, experts over `expert_axes`."""

    path: tuple
    taskgraph: int
    activation: str
    token_axes: Axes
    expert_axes: Axes
    experts_per_device: int


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Parameter and batch PartitionSpecs, the constraints lowering inserts (bridges and pinned
    layouts), the patterns chosen and the collectives they imply."""

    param_specs: tuple[P, ...]
    batch_specs: tuple[P, ...]
    constraints: dict          # (path, "in" | "out", position) -> PartitionSpec
    choices: tuple[PatternChoice, ...]
    comms: tuple[Comm, ...]
    experts: tuple[ExpertCall, ...] = ()
    coverage: tuple[Coverage, ...] = ()
    padding: tuple[tuple[int, int, int], ...] = ()   # (leaf, dim, devices): stored padded to a multiple of devices

    def comm_bytes(self, taskgraph: int | None = None) -> float:
        return sum(c.bytes for c in self.comms if taskgraph is None or c.taskgraph == taskgraph)
