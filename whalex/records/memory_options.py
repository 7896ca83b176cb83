"""The memory options a program carries, as plain records: `MemoryOptions` (ZeRO level, offloaded
state), `Precision` (amp, comm_dtype, loss scaling) and `RematPlan` (what each remat segment
recomputes). Made by the planner with memory's policies, read by lowering, memory and the Plan's
views, so that none imports another for its types."""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp

if TYPE_CHECKING:                 # types only: the record layer sits below the jaxpr layer
    from whalex.jaxpr.segments import Segment

STATE_OFFLOAD = ("opt_state", "params")     # the training state offload moves to the host ("activations": remat's)


@dataclasses.dataclass(frozen=True)
class MemoryOptions:
    """ZeRO level, offloaded state, and per stored parameter leaf its data-parallel mesh axes."""

    zero_level: int = 0
    offload: tuple[str, ...] = ()                         # subset of STATE_OFFLOAD
    zero_axes: tuple[tuple[str, ...], ...] | None = None  # None: ZeRO has no axes to shard over

    @classmethod
    def from_config(cls, config, zero_axes: Sequence[Sequence[str]] | None) -> MemoryOptions:
        offload = tuple(t for t in (config.offload or ()) if t in STATE_OFFLOAD)
        axes = None if zero_axes is None else tuple(tuple(a) for a in zero_axes)
        return cls(config.zero_level, offload, axes)

    def offloads(self, what: str) -> bool:
        return what in self.offload

    @property
    def active(self) -> bool:
        return self.zero_level > 0 or bool(self.offload)



HALF = {"bf16": jnp.bfloat16, "fp16": jnp.float16}

@dataclasses.dataclass(frozen=True)
class Precision:
    """The precision options a program needs: compute dtype, gradient communication dtype."""

    amp: str | None = None
    comm: str | None = None
    period: int = 2000            # Config.loss_scale_period
    batch_axes: tuple = ()        # per TaskGraph: the mesh axes its batch is sharded over
    local: Any = dataclasses.field(default_factory=dict, compare=False)   # n -> loss captured at batch / n

    @classmethod
    def from_config(cls, config) -> Precision | None:
        if config.amp is None and config.comm_dtype is None:
            return None
        return cls(config.amp, config.comm_dtype, config.loss_scale_period)

    @property
    def scaled(self) -> bool:
        return self.amp == "fp16"

    @property
    def comm_dtype(self):
        return HALF[self.comm] if self.comm else None


@dataclasses.dataclass(frozen=True)
class RematPlan:
    """What each remat segment recomputes (a layer within a TaskGraph), and whether boundary
    activations are offloaded."""

    levels: tuple            # per TaskGraph: None | "full" | a jax.checkpoint_policies name
    mode: Any = None         # Config.remat as given ("full", a policy name, "auto", or None)
    layers: Any = None       # whalex.memory.layers.Layers: remat applies per layer within a TaskGraph
    offload: bool = False    # offload="activations"
    budget: float | None = None      # remat="auto": the per-device budget in bytes
    segment_levels: tuple | None = None   # remat="auto": per segment (layer), overriding `levels`
    saved: float | None = None       # bytes per device JAX keeps for the backward pass with this remat
    baseline: float | None = None    # the same without remat
    state: float | None = None       # remat="auto": the per-device state the budget also holds
    flops: float | None = None       # training FLOPs of the loss with this remat (recomputation included)
    baseline_flops: float | None = None    # the same without remat
    offloaded: float | None = None   # offload="activations": bytes per device sent to the host a step
    compiled: float | None = None    # remat="auto" on an XLA topology: the compiled step's bytes per device
    compiles: int = 0                # how many compiles that choice took

    @property
    def active(self) -> bool:
        return self.offload or any(level is not None for level in self.levels + (self.segment_levels or ()))

    @property
    def cuts(self) -> tuple[int, ...]:
        """Top-level equations where a remat segment starts besides TaskGraph boundaries (layers)."""
        return self.layers.cuts if self.layers is not None else ()

    def level(self, index: int, seg: Segment):
        """The level of segment `index` (its own under remat="auto", else its TaskGraph's)."""
        if self.segment_levels is not None and index < len(self.segment_levels):
            return self.segment_levels[index]
        return self.levels[seg.taskgraph] if seg.taskgraph < len(self.levels) else None

    def describe(self) -> str:
        layers = self.layers
        if self.segment_levels is not None:
            line = f"remat ({self.mode}): per layer, " + self._per_layer()
        else:
            parts = [f"TG{i} {level or 'none'}" for i, level in enumerate(self.levels)]
            line = f"remat ({self.mode}): " + ", ".join(parts) if self.mode is not None else ""
            if line and layers is not None and len(layers.names) > 1:
                line += (f", per layer ({len(layers.names)} layers found at module depth {layers.depth}: "
                         f"{_names(layers.names)})")
        if line and self.saved is not None and self.baseline:
            line += (f"; saved for the backward pass {_mib(self.saved)}/device, {_mib(self.baseline)} without remat "
                     f"({self.saved / self.baseline:.0%}, as JAX counts residuals)")
        if line and self.flops is not None and self.baseline_flops:
            line += f"; recomputation adds {self.flops / self.baseline_flops - 1:.0%} to the step's FLOPs"
        if self.budget is not None:
            line += f"; budget {_mib(self.budget)}/device with {_mib(self.state or 0)} of state"
        if self.compiled is not None:
            line += (f"; decided from XLA's compiled step, {_mib(self.compiled)}/device "
                     f"({self.compiles} compile{'s' if self.compiles > 1 else ''})")
        if self.offload:
            line = (line + "; " if line else "") + \
                "activations at layer and TaskGraph boundaries offloaded to pinned_host"
        return line


    def _per_layer(self) -> str:
        """The level of each layer, runs of equal levels grouped: 'GPT/Block_0 .. GPT/Block_7 full'."""
        levels, layers = self.segment_levels, self.layers
        if layers is None or len(layers.names) != len(levels):
            counts = collections.Counter(level or "none" for level in levels)
            return ", ".join(f"{n} x {level}" for level, n in counts.items()) + f" of {len(levels)} segments"
        runs: list = []
        for name, level in zip(layers.names, levels):
            if runs and runs[-1][2] == level:
                runs[-1][1] = name
            else:
                runs.append([name, name, level])
        return "; ".join(f"{a}{'' if a == b else ' .. ' + b} {level or 'none'}" for a, b, level in runs) + \
            f" ({len(levels)} layers at module depth {layers.depth})"


def _names(names, shown: int = 4) -> str:
    return ", ".join(names) if len(names) <= shown + 1 else ", ".join(names[:shown]) + f", ... {names[-1]}"


def _mib(n) -> str:
    return f"{n / 2**20:.2f} MiB"
