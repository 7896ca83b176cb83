"""Profiling: FLOPs per TaskGraph counted from the jaxpr, and per-device memory of a plan.

FLOPs are counted, not measured (`whalex.core.flops`): XLA's cost analysis has no FLOPs on a GPU,
and lowering each TaskGraph only to ask is slow. The trained parameters are differentiated, the
loss (a captured jaxpr's first output) is seeded.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from whalex import _compat as C
from whalex.core.flops import equation_flops


@dataclasses.dataclass(frozen=True)
class FlopsCache:
    """Counts shared between calls of `group_flops` on one jaxpr: `measured` holds each jaxpr's
    per-equation FLOPs, `memo` the counts of the jaxprs it calls."""

    measured: dict = dataclasses.field(default_factory=dict)
    memo: dict = dataclasses.field(default_factory=dict)


def taskgraph_flops(closed: C.ClosedJaxpr, assign: dict, num_taskgraphs: int,
                    num_params: int | None = None) -> tuple[float, ...]:
    """Forward + backward FLOPs of each TaskGraph on the global batch (`group_flops`)."""
    return group_flops(closed, taskgraph_eqns(C.open_jaxpr(closed)[0], assign, num_taskgraphs), num_params=num_params)


def group_flops(closed: C.ClosedJaxpr, groups, cache: FlopsCache | None = None,
                num_params: int | None = None) -> tuple[float, ...]:
    """Forward + backward FLOPs of each group of top-level equations of a captured loss, when the
    first `num_params` inputs (default: all) are trained: the floating ones among them are
    differentiated and the first output, the loss, is seeded."""
    cache = FlopsCache() if cache is None else cache
    per_eqn = _eqn_flops(closed, num_params, cache)
    return tuple(float(sum(per_eqn[i] for i in indices)) for indices in groups)


def _eqn_flops(closed, num_params: int | None, cache: FlopsCache) -> list[float]:
    """Forward + backward FLOPs of each top-level equation (cached per jaxpr and `num_params`)."""
    key = (id(closed), num_params)
    if key not in cache.measured:
        jaxpr, _ = C.open_jaxpr(closed)
        n = len(jaxpr.invars) if num_params is None else num_params
        trained = [k < n for k in range(len(jaxpr.invars))]
        seeds = [k == 0 for k in range(len(jaxpr.outvars))]
        counts = equation_flops(jaxpr, trained, seeds, cache.memo)
        cache.measured[key] = (closed, [f + b for f, b in counts.per_eqn])   # closed kept: its id stays its own
    return cache.measured[key][1]


def taskgraph_eqns(jaxpr, assign: dict, num_taskgraphs: int) -> list[list[int]]:
    """The top-level equation indices of each TaskGraph `0 .. num_taskgraphs - 1`, in order."""
    groups: list[list[int]] = [[] for _ in range(num_taskgraphs)]
    for i in range(len(jaxpr.eqns)):
        tg = assign[(i,)]
        if tg < num_taskgraphs:
            groups[tg].append(i)
    return groups


@dataclasses.dataclass(frozen=True)
class Share:
    """What one memory optimization did to one component of a device's memory."""

    component: str          # "params", "grads", "optimizer state", "activations"
    before: float
    after: float
    by: str                 # e.g. "zero 1", "offload to pinned_host"


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device holds for the training state (from the plan's shardings); offloaded
    state counts in `host`, and `shares` says what each memory optimization saved."""

    device: int
    kind: str
    params: float
    grads: float
    opt_state: float
    capacity: float
    # everything else the device holds at the step's predicted peak (activations, the batch,
    # temporaries): bytes, or a function of none that finds them (whalex.memory.with_peak: one
    # trace of the step, run when `activations` is first read)
    activation_estimate: Any = dataclasses.field(default=0.0, repr=False, compare=False)
    host: float = 0.0            # bytes kept in pinned host memory between steps
    shares: tuple[Share, ...] = ()

    @property
    def activations(self) -> float:
        a = self.activation_estimate
        return float(a() if callable(a) else a)

    @property
    def state(self) -> float:
        return self.params + self.grads + self.opt_state


def spec_shards(spec, axis_sizes: dict) -> int:
    """How many shards a PartitionSpec cuts an array into (product of its mesh axes' sizes)."""
    n = 1
    for entry in spec:
        for a in (entry if isinstance(entry, tuple) else (entry,)):
            if a is not None:
                n *= axis_sizes[a]
    return n


def sharded_bytes(shapes, specs, axis_sizes: dict) -> float:
    """Per-device bytes of a pytree of ShapeDtypeStructs under PartitionSpecs (even shards)."""
    total = 0.0
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    for s, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(specs, is_leaf=is_spec)):
        total += float(np.prod(s.shape, dtype=np.float64)) * np.dtype(s.dtype).itemsize / spec_shards(spec, axis_sizes)
    return total
