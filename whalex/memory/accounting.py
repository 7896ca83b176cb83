"""Per-device memory accounting: what one device holds for the training state, and the bytes of a
pytree under PartitionSpecs."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


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
