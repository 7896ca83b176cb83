"""`Cluster`: the devices a plan may use and what kind each one is."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax

from whalex.distributed import maybe_initialize
from whalex.errors import ClusterError
from whalex.mesh.specs import DeviceSpec, lookup


@dataclasses.dataclass(frozen=True, init=False)
class Cluster:
    """Device kinds (one per device) and, unless abstract, the `jax.Device`s they map onto.

    `Cluster(kinds=[...])` declares kinds for the first len(kinds) local devices (e.g. simulated
    CPU devices planned as if they were heterogeneous GPUs; execution stays exact).
    """

    specs: tuple[DeviceSpec, ...]
    devices: tuple[Any, ...] | None
    measured: tuple[float, ...] | None = None     # calibrated FLOP/s per device, when measured
    spread: tuple[float, ...] | None = None       # relative spread of each measured speed (0.05: +-5%)

    def __init__(self, kinds: Sequence[str] | None = None, devices: Sequence[Any] | None = None):
        maybe_initialize()      # join a whalex.launch process group before touching devices
        available = list(devices) if devices is not None else list(jax.devices())
        if kinds is None:
            kinds = [d.device_kind for d in available]
        kinds = list(kinds)
        if not kinds:
            raise ClusterError("a Cluster needs at least one device kind.")
        if len(kinds) > len(available):
            raise ClusterError(
                f"Cluster declares {len(kinds)} device kinds but only {len(available)} devices are visible; "
                "declare at most that many, use Cluster.abstract(kinds=...) to plan without devices, or "
                f"simulate more CPU devices with XLA_FLAGS=--xla_force_host_platform_device_count={len(kinds)}.")
        object.__setattr__(self, "specs", tuple(lookup(k) for k in kinds))
        object.__setattr__(self, "devices", tuple(available[: len(kinds)]))
        object.__setattr__(self, "measured", None)
        object.__setattr__(self, "spread", None)

    @classmethod
    def detect(cls) -> "Cluster":
        """Every device `jax.devices()` reports (all processes), kinds read from the devices."""
        maybe_initialize()
        return cls(devices=jax.devices())

    @classmethod
    def abstract(cls, kinds: Sequence[str]) -> "Cluster":
        """Kinds only, no devices: enough to plan and lower, not to run."""
        obj = object.__new__(cls)
        kinds = list(kinds)
        if not kinds:
            raise ClusterError("Cluster.abstract needs at least one device kind.")
        object.__setattr__(obj, "specs", tuple(lookup(k) for k in kinds))
        object.__setattr__(obj, "devices", None)
        object.__setattr__(obj, "measured", None)
        object.__setattr__(obj, "spread", None)
        return obj

    def with_speeds(self, speeds, spread=None) -> "Cluster":
        """A copy whose device speeds (FLOP/s) are measured ones instead of the spec table's.

        `spread`: optional relative noise of each speed (0.05 reads +-5%), shown beside the speed in
        `plan.summary()`; `calibrate()` fills it in.
        """
        speeds = tuple(float(s) for s in speeds)
        if len(speeds) != self.size or not all(math.isfinite(s) and s > 0 for s in speeds):
            raise ClusterError(f"with_speeds needs {self.size} positive speeds, got {speeds}.")
        if spread is not None:
            spread = tuple(float(s) for s in spread)
            if len(spread) != self.size or not all(math.isfinite(s) and s >= 0 for s in spread):
                raise ClusterError(f"with_speeds needs {self.size} non-negative relative spreads (0.05 for +-5%), "
                                   f"got {spread}.")
        obj = object.__new__(type(self))
        object.__setattr__(obj, "specs", self.specs)
        object.__setattr__(obj, "devices", self.devices)
        object.__setattr__(obj, "measured", speeds)
        object.__setattr__(obj, "spread", spread)
        return obj

    @property
    def speeds(self) -> tuple[float, ...]:
        """FLOP/s per device: calibrated if measured, else the spec table's FP32 peak."""
        return self.measured if self.measured is not None else tuple(s.fp32_flops for s in self.specs)

    @property
    def speed_source(self) -> str:
        return "calibrated" if self.measured is not None else "spec table"

    @property
    def size(self) -> int:
        return len(self.specs)

    @property
    def is_abstract(self) -> bool:
        return self.devices is None

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    @property
    def is_heterogeneous(self) -> bool:
        return len(set(self.kinds)) > 1

    @property
    def platform(self) -> str:
        """The platform to lower for: the real one, or 'cuda' for an abstract GPU cluster."""
        if self.devices is not None:
            return self.devices[0].platform
        return "cpu" if all(s.platform == "cpu" for s in self.specs) else "cuda"

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for k in self.kinds:
            counts[k] = counts.get(k, 0) + 1
        desc = " + ".join(f"{n}x {k}" for k, n in counts.items())
        extra = (", abstract" if self.is_abstract else "") + (", calibrated" if self.measured else "")
        return f"Cluster({desc}{extra})"
