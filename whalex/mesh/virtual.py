"""VirtualDevice generation (Whale section 3.2.1) and the JAX mesh the plan runs on.

TaskGraphs that are not pipelined are collocated (Whale's Example 2): they run one after the
other on the same devices. One model replica spans D = the largest device count any TaskGraph
asks for; when the cluster has K = r * D devices, the whole model gets r-way nested data
parallelism. Split degrees must divide each other, so that every `split(d)` owns a set of
innermost mesh axes whose sizes multiply to d; its batch is sharded over the remaining axes.
Devices are taken sequentially, so each split group is a run of consecutive devices.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from whalex.errors import PlanError
from whalex.primitives.scopes import Strategy

DATA = "data"


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """Mesh axis names and sizes, outermost first (the innermost axis varies fastest)."""

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.axis_sizes))

    def build(self, devices: Sequence | None):
        """A `Mesh` over `devices` (sequential order), or an `AbstractMesh` when there are none."""
        types = (AxisType.Auto,) * len(self.axis_names)
        if devices is None:
            return AbstractMesh(self.axis_sizes, self.axis_names, axis_types=types)
        grid = np.array(list(devices)[: self.size], dtype=object).reshape(self.axis_sizes)
        return Mesh(grid, self.axis_names, axis_types=types)

    def axis_size(self, axes: Sequence[str]) -> int:
        sizes = dict(zip(self.axis_names, self.axis_sizes))
        return int(np.prod([sizes[a] for a in axes])) if axes else 1


@dataclasses.dataclass(frozen=True)
class VirtualDevice:
    """The devices one TaskGraph runs on: one group per model replica (nested data parallelism)."""

    taskgraph: int
    strategy: Strategy
    device_count: int                      # devices per replica of this TaskGraph
    groups: tuple[tuple[int, ...], ...]    # device indices, one tuple per replica
    model_axes: tuple[str, ...]            # mesh axes its weights are split over (split only)
    batch_axes: tuple[str, ...]            # mesh axes its batch is sharded over

    @property
    def devices(self) -> tuple[int, ...]:
        return self.groups[0]

    @property
    def nested_dp(self) -> int:
        return len(self.groups)

    @property
    def data_parallel(self) -> int:
        """How many ways the TaskGraph's batch is divided."""
        return self.device_count * len(self.groups) if self.strategy.kind == "replicate" else len(self.groups)


def resolve_count(strategy: Strategy, num_devices: int) -> int:
    n = num_devices if strategy.device_count is None else strategy.device_count
    if n > num_devices:
        raise PlanError(
            f"wh.{strategy.label()} asks for {n} devices but the cluster has {num_devices}; lower the "
            f"device_count to at most {num_devices}, or leave it out to use every device. On CPU, simulate {n} "
            f"devices: set XLA_FLAGS=--xla_force_host_platform_device_count={n} before jax is imported.")
    if num_devices % n:
        raise PlanError(
            f"wh.{strategy.label()} asks for {n} devices, which does not divide the cluster's "
            f"{num_devices}: nested data parallelism needs a divisor. Use one of "
            f"{[d for d in range(1, num_devices + 1) if num_devices % d == 0]}.")
    return n


def mesh_layout(strategies: Sequence[Strategy], num_devices: int) -> MeshLayout:
    """Mesh axes for collocated TaskGraphs: ('data', 'model') or a chain of model axes."""
    counts = [resolve_count(s, num_devices) for s in strategies]
    replica = max(counts, default=1)
    for s, n in zip(strategies, counts):
        if replica % n:
            raise PlanError(
                f"wh.{s.label()} uses {n} devices, which does not divide the {replica} devices of one model "
                "replica (the largest device_count of any scope); make every device_count divide the largest.")
    degrees = sorted({n for s, n in zip(strategies, counts) if s.kind == "split" and n > 1})
    for a, b in zip(degrees, degrees[1:]):
        if b % a:
            raise PlanError(
                f"split device counts {a} and {b} do not divide each other, so they cannot share one mesh; "
                f"use split counts that divide each other (e.g. {a} and {a * (b // a + 1)}).")
    model = degrees[-1] if degrees else 1
    names, sizes = [DATA], [num_devices // model]
    chain = [1] + degrees
    ratios = [chain[i + 1] // chain[i] for i in range(len(degrees))]
    for i, r in reversed(list(enumerate(ratios))):
        names.append("model" if len(degrees) == 1 else f"model{i}")
        sizes.append(r)
    return MeshLayout(tuple(names), tuple(sizes))


def virtual_devices(strategies: Sequence[Strategy], layout: MeshLayout) -> tuple[VirtualDevice, ...]:
    """One VirtualDevice per TaskGraph, with the mesh axes for its weights and its batch."""
    k = layout.size
    out = []
    for i, s in enumerate(strategies):
        n = resolve_count(s, k)
        if s.kind == "split" and n > 1:
            model_axes = _innermost_axes(layout, n)
        else:
            model_axes = ()
        batch_axes = tuple(a for a, size in zip(layout.axis_names, layout.axis_sizes)
                           if a not in model_axes and size > 1) or (layout.axis_names[0],)
        groups = tuple(tuple(range(g * n, (g + 1) * n)) for g in range(k // n))
        out.append(VirtualDevice(i, s, n, groups, model_axes, batch_axes))
    return tuple(out)


def _innermost_axes(layout: MeshLayout, n: int) -> tuple[str, ...]:
    axes, prod = [], 1
    for name, size in reversed(list(zip(layout.axis_names, layout.axis_sizes))):
        if prod == n:
            break
        axes.append(name)
        prod *= size
    if prod != n:
        raise PlanError(f"no set of mesh axes of {layout} multiplies to split({n}).")
    return tuple(reversed(axes))
