"""What the pattern walk knows so far: each value's layout, where it came from, the parameters'
decided splits, and what the walk has decided (constraints, pattern choices, collectives)."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from whalex import _compat as C
from whalex.jaxpr.capture import Captured
from whalex.mesh.virtual import MeshLayout, VirtualDevice
from whalex.planner.patterns import cost
from whalex.planner.patterns.layout import Info, unsplit
from whalex.records.comm import Axes, Comm, ring_bytes
from whalex.records.sharding_plan import ExpertCall, PatternChoice


@dataclasses.dataclass(frozen=True)
class Site:
    """Where an equation sits: its path, the frame of its jaxpr, its TaskGraph and VirtualDevice."""

    path: tuple
    frame: tuple
    tg: int
    vd: VirtualDevice


@dataclasses.dataclass
class Walk:
    """The walk's state; the rules read it and record their decisions in it."""

    cap: Captured
    vds: Sequence[VirtualDevice]
    layout: MeshLayout
    matmul_pattern: str
    info: dict = dataclasses.field(default_factory=dict)          # (frame, var) -> Info
    producer: dict = dataclasses.field(default_factory=dict)      # (frame, var) -> TaskGraph, -1 for a batch input
    origin: dict = dataclasses.field(default_factory=dict)        # (frame, var) -> (param leaf, dims)
    param_spec: dict = dataclasses.field(default_factory=dict)    # leaf -> [axes per dim]
    constraints: dict = dataclasses.field(default_factory=dict)   # (path, "in" | "out", position) -> P
    choices: list[PatternChoice] = dataclasses.field(default_factory=list)
    comms: list[Comm] = dataclasses.field(default_factory=list)
    experts: list[ExpertCall] = dataclasses.field(default_factory=list)
    unmatched: dict = dataclasses.field(default_factory=dict)     # leaf -> (TaskGraph, why no pattern matched it)
    readers: dict = dataclasses.field(default_factory=dict)       # leaf -> the first split-scope operation reading it
    made_at: dict = dataclasses.field(default_factory=dict)       # (frame, var) -> (equation path, output position)
    # (frame, var) -> axes a bridge gathered its batch over
    gathered: dict = dataclasses.field(default_factory=dict)
    # (frame, var, TaskGraph): a bridge's gradient gathered
    sliced: set = dataclasses.field(default_factory=set)

    @property
    def b(self) -> int:
        return self.cap.global_batch

    def batch_spec(self, vd: VirtualDevice, aval) -> tuple:
        spec = list(unsplit(len(aval.shape)))
        if aval.shape and aval.shape[0] % self.b == 0:
            spec[0] = vd.batch_axes
        return tuple(spec)

    def plain(self, vd: VirtualDevice, aval, batch: bool) -> Info:
        """A value split only on its batch dimension (when batch-major), else whole."""
        return Info(self.batch_spec(vd, aval) if batch else unsplit(len(aval.shape)), batch)

    def shards(self, axes) -> int:
        return self.layout.axis_size(axes) if axes else 1

    def group_bytes(self, aval, info: Info) -> float:
        return cost.group_bytes(aval, info, self.shards)

    def comm(self, tg, kind, axes, nbytes, reason):
        n = self.shards(axes)
        if n > 1 and nbytes > 0:
            self.comms.append(Comm(tg, kind, tuple(axes), ring_bytes(kind, nbytes, n), reason))

    def read(self, frame, v) -> Info:
        if isinstance(v, C.Literal):
            return Info(unsplit(np.ndim(v.val)), False)
        return self.info.get((frame, v), Info(unsplit(len(v.aval.shape)), False))

    def param_of(self, frame, v):
        """(leaf, dims) of the parameter `v` is (a view of), or None."""
        if isinstance(v, C.Literal):
            return None
        return self.origin.get((frame, v))

    def decide_param(self, leaf: int, dim: int, axes: Axes) -> bool:
        """Split parameter `leaf` on `dim` over `axes`, unless its layout is already decided."""
        if leaf in self.param_spec:
            return False
        spec = [None] * len(self.cap.jaxpr.jaxpr.invars[leaf].aval.shape)
        spec[dim] = axes
        self.param_spec[leaf] = spec
        return True

    def forced(self, vd: VirtualDevice) -> str:
        """The matmul pattern the scope or the Config asks for ("auto": the cheaper)."""
        return vd.strategy.pattern if vd.strategy.pattern != "auto" else self.matmul_pattern
